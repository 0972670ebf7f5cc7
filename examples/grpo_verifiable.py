"""GRPO with a verifiable reward: a dataset with an `answer` column and an exact-match
reward function that reads it.

    python examples/grpo_verifiable.py                                  # tiny demo policy, CPU
    python examples/grpo_verifiable.py --model DIR --iterations 200     # a local checkpoint

The reward function is called as `f(prompts, completions, **columns)`: naming `answer` in
its signature is enough to receive that column for the rows of the iteration. Each prompt
is sampled `num_generations` times; a group whose completions all score the same (all
right or all wrong) has advantage 0 and is counted in `frac_reward_zero_std`.

On a GPU or TPU with a real model: `--dtype bfloat16`, `--scan-layers`, a
`--logits-chunk-size` of 128-512, and `--mesh-fsdp N` over N devices (see the README).
"""

import argparse
import random

import jaxppo
from jaxppo import demo


def make_dataset(n=64, seed=0):
    """Sums of two small numbers: prompt "3+4=", answer "7"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def exact_match(prompts, completions, answer):
    """1 if the completion, stripped, is exactly the answer; else 0."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="local Hugging Face causal-LM directory (default: demo policy)")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-dir", default="runs/grpo_verifiable")
    args = parser.parse_args(argv)
    config = jaxppo.Config.for_algorithm(
        "grpo", batch_size=64, mini_batch_size=16, ppo_epochs=2, num_generations=8, query_length=8, response_length=2,
        learning_rate=1e-3 if args.model is None else 1e-6, dtype=args.dtype, iterations=args.iterations,
        output_dir=args.output_dir, sample_every=20, progress=False, export_final=args.model is not None)
    if args.model is None:
        tokenizer = demo.demo_tokenizer()
        policy = demo.demo_policy(tokenizer, max_len=10)
    else:
        tokenizer = jaxppo.models.load_tokenizer(args.model)
        policy = args.model
    trainer = jaxppo.Trainer(config, policy=policy, tokenizer=tokenizer, prompts=make_dataset(), reward_fns=[exact_match])
    return trainer.train()


if __name__ == "__main__":
    main()
