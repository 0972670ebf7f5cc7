"""Custom rewards: a Python function on decoded text, and a jitted function on tokens.

    python examples/custom_reward.py                 # text reward (default)
    python examples/custom_reward.py --token-reward  # the token-level variant

The text reward runs outside jit on the decoded prompt/response strings; it must return
one finite number per response (anything else is a clear error). The token reward is
traced into the compiled rollout: `fn(prompt_ids, prompt_mask, response_ids,
response_mask) -> (batch,)`.
"""

import argparse

import jax.numpy as jnp

import jaxppo
from jaxppo import demo

VOWELS = set("aeiou")


def vowel_reward(prompts, responses):
    """+1 per vowel, -0.5 per character that is not a lowercase letter or a space."""
    return [sum(c in VOWELS for c in r) - 0.5 * sum(not (c.islower() or c == " ") for c in r) for r in responses]


def token_reward(prompt_ids, prompt_mask, response_ids, response_mask):
    """ByT5 ids are byte + 3: reward the bytes of 'e' and ' ' in the response."""
    hits = (response_ids == ord("e") + 3) | (response_ids == ord(" ") + 3)
    return jnp.sum(hits * response_mask, axis=1).astype(jnp.float32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--token-reward", action="store_true")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/custom_reward")
    args = parser.parse_args(argv)
    tokenizer = demo.demo_tokenizer()
    config = jaxppo.Config(
        batch=jaxppo.BatchConfig(batch_size=32, mini_batch_size=8, ppo_epochs=4),
        kl=jaxppo.KLConfig(kl_coef=0.3),
        sampling=jaxppo.SamplingConfig(response_length=12),
        optimizer=jaxppo.OptimizerConfig(learning_rate=1e-3),
        data=jaxppo.DataConfig(query_length=32),
        run=jaxppo.RunConfig(iterations=args.iterations, output_dir=args.output_dir, sample_every=10, progress=False,
                             export_final=False))
    trainer = jaxppo.Trainer(
        config, policy=demo.demo_policy(tokenizer, max_len=44), tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS,
        reward_fns=token_reward if args.token_reward else vowel_reward,
        reward_fn_on="tokens" if args.token_reward else "text")
    return trainer.train()


if __name__ == "__main__":
    main()
