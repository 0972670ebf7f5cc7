"""Benchmark: seconds per generation batch of GRPO-family training with `PPOTrainer`,
split into generation, scoring and update; the side-by-side reference is
`trl_grpo_reference.py` (TRL's GRPOTrainer) at the same shapes.

    python benchmarks/grpo_iteration.py                 # vocab 384 and 50257
    python benchmarks/grpo_iteration.py --vocab 384     # one vocabulary
    python benchmarks/grpo_iteration.py --bf16          # bfloat16 compute (TRL: bf16=True)

Shape (issue 9): GPT-2 layout, random weights built locally (2 layers, width 128), byte
tokenizer, 16 prompts x 4 generations = 64 completions of 32 tokens (16-token prompts),
mini-batches of 16 completions, 4 epochs = 16 optimizer updates per generation batch.
Two configurations: "dapo" with beta 0 (no reference model at all) and "grpo" with beta
0.04 (KL term in the loss: the reference scores every completion). The first iterations
compile; the table reports the median of the later ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxppo  # noqa: E402

CASES = [("dapo", 0.0), ("grpo", 0.04)]  # (loss / algorithm, beta)
PROMPTS, GENERATIONS, RESPONSE, QUERY = 16, 4, 32, 16


def lowercase(prompts, completions, **_):
    """The demo's reward: lowercase ASCII letters in each completion."""
    return [float(sum(c.isascii() and c.islower() for c in text)) for text in completions]


def bench(algorithm, beta, vocab, iterations, directory, chunk=None, dtype="float32"):
    from jaxppo import demo

    tokenizer = demo.demo_tokenizer()
    # TRL's loss_type="dapo" neither masks truncated completions nor punishes overlong ones
    # by default: the dapo preset's overlong settings are off here, so both sides do the same.
    config = jaxppo.Config.for_algorithm(algorithm, batch_size=PROMPTS * GENERATIONS, mini_batch_size=16,
                                         ppo_epochs=4, num_generations=GENERATIONS, kl_loss_coef=beta,
                                         mask_truncated_completions=False, overlong_penalty_factor=0.0)
    tc = dict(iterations=iterations, query_length=QUERY, response_length=RESPONSE,
              output_dir=f"{directory}/run-{algorithm}", progress=False, export_final=False, plot=False,
              report_to="jsonl", sample_every=0, overlong_prompts="truncate", log_every=10**9,
              logits_chunk_size=chunk, dtype=dtype)
    trainer = jaxppo.Trainer(config.replace(**tc), policy=f"{directory}/policy", tokenizer=tokenizer,
                             prompts=demo.DEMO_PROMPTS, reward_fns=[lowercase])
    assert (trainer.parts.ref_params is None) == (beta == 0)
    rows = [trainer.step() for _ in range(iterations)]
    assert all(r["ppo/updates_applied"] == 16 for r in rows)
    phases = ("generation", "scoring", "update")
    med = {k: float(np.median([r["time/" + k] for r in rows[2:]])) for k in phases}
    return dict(case=f"{algorithm} / beta {beta}", vocab=vocab, **med, total=sum(med.values()),
                first=sum(rows[0]["time/" + k] for k in phases),
                length=float(np.mean([r["completions/mean_length"] for r in rows])))


def print_table(title, rows, first_label):
    """The table shared with `trl_grpo_reference.py`."""
    print(f"\n## {title}\n")
    print(f"| case | vocab | generation (s) | scoring (s) | update (s) | total (s) | {first_label} (s) | mean length |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['vocab']} | {r['generation']:.3f} | {r['scoring']:.3f} | {r['update']:.3f} | "
              f"{r['total']:.3f} | {r['first']:.2f} | {r['length']:.1f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=[384, 50257])
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--logits-chunk-size", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 parameters and optimizer")
    args = parser.parse_args()
    dtype = "bfloat16" if args.bf16 else "float32"
    import jax

    from jaxppo import demo
    from ppo_iteration import build

    rows = []
    for vocab in args.vocab:
        with tempfile.TemporaryDirectory() as d:
            build(d, 2, 128, vocab, QUERY + RESPONSE + 8, demo.demo_tokenizer())
            rows += [bench(a, b, vocab, args.iterations, d, args.logits_chunk_size, dtype) for a, b in CASES]
    print_table(f"jaxppo seconds per generation batch, {jax.devices()[0].platform.upper()}, {dtype}, GPT-2 layout 2x128, "
                f"{PROMPTS} prompts x {GENERATIONS} generations x {RESPONSE} tokens, mini-batch 16, 16 updates",
                rows, "first batch incl. compile")


if __name__ == "__main__":
    main()
