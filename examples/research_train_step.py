"""Research-code pattern: your own Flax model, your own rollouts, `jaxppo.train_step`.

Nothing here uses jaxppo's models or trainer: the policy/value network is defined below as
a plain Flax module, and `train_step` only needs `apply_fn(params, tokens, mask) ->
(logits, values)`. The task: after a random prompt, emit as many copies of a target token as possible. The
score of a response is the fraction of its tokens equal to the target, given at its last
token. Each iteration samples a rollout from the current policy (a plain sampler written
here with `lax.scan`), then calls `train_step` once, which applies exactly
`ppo_epochs * batch_size / mini_batch_size` optimizer updates.

    python examples/research_train_step.py [--iterations 30]
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxppo

VOCAB, PROMPT_LEN, RESPONSE_LEN, TARGET = 16, 4, 8, 3


class PolicyValueNet(nn.Module):
    """A small causal transformer with a value head: tokens, mask -> (logits, values)."""

    vocab: int
    width: int = 32
    heads: int = 2

    @nn.compact
    def __call__(self, tokens, mask):
        length = tokens.shape[1]
        x = nn.Embed(self.vocab, self.width)(tokens) + nn.Embed(length, self.width)(jnp.arange(length))
        attend = jnp.tril(jnp.ones((length, length), bool))[None, None] & mask.astype(bool)[:, None, None, :]
        attend = attend | jnp.eye(length, dtype=bool)[None, None]  # padding rows see themselves
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, use_bias=False)(h, h, mask=attend)
        x = x + nn.Dense(self.width)(nn.gelu(nn.Dense(4 * self.width)(nn.LayerNorm()(x))))
        x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab)(x), nn.Dense(1, kernel_init=nn.initializers.zeros)(x)[..., 0]


def sample(apply_fn, params, prompts, key, temperature):
    """Sample RESPONSE_LEN tokens after `prompts` (B, Q), one full forward per token."""
    b = prompts.shape[0]
    tokens = jnp.concatenate([prompts, jnp.zeros((b, RESPONSE_LEN), jnp.int32)], axis=1)
    mask = jnp.concatenate([jnp.ones_like(prompts), jnp.zeros((b, RESPONSE_LEN), jnp.int32)], axis=1)

    def step(carry, t):
        tokens, mask, key = carry
        key, sub = jax.random.split(key)
        logits, _ = apply_fn(params, tokens, mask)
        next_logits = jax.lax.dynamic_index_in_dim(logits, PROMPT_LEN - 1 + t, axis=1, keepdims=False)
        token = jax.random.categorical(sub, next_logits / temperature)
        tokens = jax.lax.dynamic_update_index_in_dim(tokens, token, PROMPT_LEN + t, axis=1)
        mask = jax.lax.dynamic_update_index_in_dim(mask, jnp.ones_like(token), PROMPT_LEN + t, axis=1)
        return (tokens, mask, key), None

    (tokens, _, _), _ = jax.lax.scan(step, (tokens, mask, key), jnp.arange(RESPONSE_LEN))
    return tokens[:, PROMPT_LEN:]


def make_collect(config: jaxppo.Config):
    @jax.jit
    def collect(state, key):
        k_prompt, k_sample = jax.random.split(key)
        prompts = jax.random.randint(k_prompt, (config.batch.batch_size, PROMPT_LEN), 0, VOCAB)
        responses = sample(state.apply_fn, state.params, prompts, k_sample, config.sampling.temperature)
        batch = {
            "query_tokens": prompts,
            "query_mask": jnp.ones_like(prompts),
            "response_tokens": responses,
            "response_mask": jnp.ones_like(responses),
        }
        logprobs, values, _ = jaxppo.update.response_outputs(state.apply_fn, state.params, batch, config.sampling.temperature)
        scores = jnp.mean((responses == TARGET).astype(jnp.float32), axis=1)
        rewards = jnp.zeros_like(logprobs).at[:, -1].set(scores)
        rollout = jaxppo.RolloutBatch(logprobs=logprobs, values=values, rewards=rewards, **batch)
        return rollout, scores

    return collect


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--mini-batch-size", type=int, default=16)
    parser.add_argument("--ppo-epochs", type=int, default=4)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    # train_step reads the batch's sizes, the loss, the KL term, the temperature and the
    # estimator's settings; every other concern of the Config keeps its defaults here.
    config = jaxppo.Config(batch=jaxppo.BatchConfig(
        batch_size=args.batch_size,
        mini_batch_size=args.mini_batch_size,
        ppo_epochs=args.ppo_epochs,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
    ))
    key = jax.random.key(args.seed)
    key, init_key = jax.random.split(key)
    net = PolicyValueNet(VOCAB)
    tokens = jnp.zeros((1, PROMPT_LEN + RESPONSE_LEN), jnp.int32)
    params = net.init(init_key, tokens, jnp.ones_like(tokens))
    state = jaxppo.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(args.learning_rate))
    collect = make_collect(config)

    print(f"updates per train_step = ppo_epochs * batch_size / mini_batch_size = "
          f"{config.batch.ppo_epochs} * {config.batch.batch_size} / {config.batch.mini_batch_size} = {config.batch.updates_per_step}")
    scores_per_iter = []
    start = time.perf_counter()
    for it in range(args.iterations):
        key, k_collect, k_train = jax.random.split(key, 3)
        rollout, scores = collect(state, k_collect)
        step_before = int(state.step)
        state, metrics = jaxppo.train_step(state, rollout, k_train, config)
        applied = int(state.step) - step_before
        scores_per_iter.append(float(scores.mean()))
        print(f"iter {it:3d}  score {scores_per_iter[-1]:.3f}  "
              f"approxkl {float(metrics['policy/approxkl_avg']):.4f}  "
              f"clipfrac {float(metrics['policy/clipfrac_avg']):.3f}  updates applied {applied}  total {int(state.step)}")
    elapsed = time.perf_counter() - start
    n = max(1, min(5, len(scores_per_iter) // 2))
    first, last = sum(scores_per_iter[:n]) / n, sum(scores_per_iter[-n:]) / n
    print(f"\nmean score: first {n} iterations {first:.3f}, last {n} iterations {last:.3f}")
    print(f"optimizer updates: {int(state.step)} = {args.iterations} iterations x {config.batch.updates_per_step}")
    print(f"wall time {elapsed:.1f} s")
    return {"first": first, "last": last, "step": int(state.step), "updates_per_step": config.batch.updates_per_step}


if __name__ == "__main__":
    main()
