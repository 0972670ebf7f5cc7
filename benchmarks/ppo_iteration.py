"""Benchmark: seconds per PPO iteration of `PPOTrainer`, split into generation, scoring
(rollout: log-probs, reference, values, reward model, KL-shaped rewards) and update.

    python benchmarks/ppo_iteration.py            # small and medium shapes (several minutes)
    python benchmarks/ppo_iteration.py --quick    # small shape, fewer iterations

Shapes (GPT-2 layout, random weights built locally; separate critic and reward model of
the same shape as the policy; batch 64, mini-batch 16, 4 PPO epochs = 16 optimizer steps
per iteration, 16-token prompts):
  small:  2 layers, width 128, 32-token responses
  medium: 4 layers, width 512, 64-token responses
The first iterations compile; the table reports the median of the later ones, and the
compile (first-iteration) time separately.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np

import jaxppo
import jaxppo.models as jm


def build(directory, layers, width, vocab, positions, tokenizer):
    import torch
    import transformers

    common = dict(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=max(1, width // 64), n_positions=positions,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=0)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**common)).save_pretrained(f"{directory}/policy")
    transformers.GPT2ForSequenceClassification(transformers.GPT2Config(num_labels=1, **common)).save_pretrained(
        f"{directory}/rm")


SHAPES = [("small", 2, 128, 32), ("medium", 4, 512, 64)]  # name, layers, width, response length


def shapes(quick: bool):
    return SHAPES[:1] if quick else SHAPES


def print_table(title: str, rows, first_label: str):
    """The per-iteration table shared with `trl_reference.py`: rows carry name, layers,
    width, response, generation, scoring, update, total and first (seconds)."""
    print(f"\n## {title}\n")
    print(f"| shape | layers | width | response | generation (s) | scoring (s) | update (s) | total (s) | {first_label} (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['name']} | {r['layers']} | {r['width']} | {r['response']} | {r['generation']:.3f} | "
              f"{r['scoring']:.3f} | {r['update']:.3f} | {r['total']:.3f} | {r['first']:.2f} |")


def bench(name, layers, width, response_length, vocab, iterations):
    from jaxppo import demo

    tokenizer = demo.demo_tokenizer()
    if vocab < len(tokenizer):
        raise SystemExit(f"--vocab must be >= {len(tokenizer)} (the byte tokenizer's size)")
    with tempfile.TemporaryDirectory() as d:
        build(d, layers, width, vocab, 16 + response_length, tokenizer)
        config = jaxppo.Config.from_settings(batch_size=64, mini_batch_size=16, ppo_epochs=4)
        tc = dict(iterations=iterations, query_length=16, response_length=response_length,
                  output_dir=f"{d}/run", progress=False, export_final=False, plot=False,
                  report_to="jsonl", sample_every=0, overlong_prompts="truncate", log_every=10**9)
        trainer = jaxppo.Trainer(config.replace(**tc), policy=f"{d}/policy", reward_model=f"{d}/rm",
                                 tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS)
        rows = [trainer.step() for _ in range(iterations)]
    assert all(r["ppo/updates_applied"] == 16 for r in rows)
    phases = ("generation", "scoring", "update")
    med = {k: float(np.median([r["time/" + k] for r in rows[2:]])) for k in phases}
    return dict(name=name, layers=layers, width=width, response=response_length, **med, total=sum(med.values()),
                first=sum(rows[0]["time/" + k] for k in phases))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2's by default)")
    args = parser.parse_args()
    rows = [bench(n, l, w, r, args.vocab, 5 if args.quick else 8) for n, l, w, r in shapes(args.quick)]
    import jax

    print_table(f"seconds per PPO iteration, {jax.devices()[0].platform.upper()}, GPT-2 layout, vocab {args.vocab}, "
                "batch 64, mini-batch 16, 4 epochs (16 updates), 16-token prompts",
                rows, "first iteration incl. compile")


if __name__ == "__main__":
    main()
