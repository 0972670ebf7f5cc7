"""Two weighted reward functions with DAPO (clip-higher, token-level loss, no KL).

    python examples/grpo_two_rewards.py

The score of a completion is `1.0 * lowercase + 0.5 * variety`: the demo's lowercase
count pulls towards lowercase letters, and the variety reward (distinct characters)
keeps the policy from collapsing onto one letter. Each function's own mean and std are
logged as `rewards/<name>/mean` and `/std`; `reward` is the weighted sum. A function may
return None for a row it has no opinion on (here: variety on empty completions).
"""

import argparse

import jaxppo
from jaxppo import demo


def variety(prompts, completions):
    """Distinct characters in the completion; None (no opinion) for an empty one."""
    return [float(len(set(c))) if c else None for c in completions]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/grpo_two_rewards")
    args = parser.parse_args(argv)
    tokenizer = demo.demo_tokenizer()
    # The toy task rewards long lowercase completions, which run to the 16-token budget: DAPO's
    # masking of truncated completions and its overlong punishment would leave nothing to learn.
    config = jaxppo.Config.for_algorithm(
        "dapo", batch_size=64, mini_batch_size=16, ppo_epochs=2, num_generations=8,
        rewards=jaxppo.RewardConfig(mask_truncated_completions=False, overlong_penalty_factor=0.0),
        sampling=jaxppo.SamplingConfig(response_length=16), optimizer=jaxppo.OptimizerConfig(learning_rate=1e-3),
        data=jaxppo.DataConfig(query_length=32),
        run=jaxppo.RunConfig(iterations=args.iterations, output_dir=args.output_dir, sample_every=10, progress=False,
                             export_final=False))
    trainer = jaxppo.Trainer(config, policy=demo.demo_policy(tokenizer, max_len=48), tokenizer=tokenizer,
                             prompts=demo.DEMO_PROMPTS, reward_fns=[demo.lowercase_reward, variety],
                             reward_weights=[1.0, 0.5])
    return trainer.train()


if __name__ == "__main__":
    main()
