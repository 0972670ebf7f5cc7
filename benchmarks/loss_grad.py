"""Benchmark: one PPO loss gradient (policy + separate critic, mini-batch 16) with the
entropy as a metric only (what `total_loss` does when `ent_coef` is 0) and with the entropy
differentiated (what it did before).

    python benchmarks/loss_grad.py                 # small shape, vocab 50257, and medium, vocab 384

Variants are timed interleaved (median of 5 rounds), so drift in the machine's speed hits
them alike.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo
from jaxppo.models.config import ModelConfig
from jaxppo.models.model import Model, PolicyAndCritic
from jaxppo.update.objective import total_loss


def bench(layers, width, response, vocab, rounds=5):
    q, b = 16, 16
    cfg = ModelConfig(model_type="gpt2", vocab_size=vocab, hidden_size=width, num_layers=layers,
                      num_heads=max(1, width // 64), num_kv_heads=max(1, width // 64), intermediate_size=4 * width,
                      max_position_embeddings=q + response)
    policy, critic = Model(cfg, "causal_lm"), Model(cfg, "value")
    apply_fn = PolicyAndCritic(policy, critic)
    key = jax.random.key(0)
    params = {"policy": policy.init(key), "critic": critic.init(key)}
    rng = np.random.default_rng(0)
    batch = dict(query_tokens=jnp.asarray(rng.integers(3, vocab, (b, q)), jnp.int32),
                 query_mask=jnp.ones((b, q), jnp.int32),
                 response_tokens=jnp.asarray(rng.integers(3, vocab, (b, response)), jnp.int32),
                 response_mask=jnp.ones((b, response), jnp.int32), logprobs=jnp.full((b, response), -6.0),
                 values=jnp.zeros((b, response)), advantages=jnp.asarray(rng.normal(size=(b, response)), jnp.float32),
                 returns=jnp.asarray(rng.normal(size=(b, response)), jnp.float32))
    config = jaxppo.Config.from_settings(batch_size=64, mini_batch_size=16, ppo_epochs=4)
    # A tiny non-zero ent_coef differentiates the entropy, as the loss did for ent_coef 0 before.
    with_entropy = dataclasses.replace(config, ent_coef=1e-30)
    def grad(apply_fn, cfg_):
        return jax.jit(jax.value_and_grad(lambda p, x: total_loss(p, x, apply_fn=apply_fn, config=cfg_), has_aux=True))

    variants = {"entropy a metric (now)": grad(apply_fn, config),
                "entropy differentiated (before)": grad(apply_fn, with_entropy)}
    times = {name: [] for name in variants}
    for f in variants.values():
        jax.block_until_ready(f(params, batch))
    for _ in range(rounds):
        for name, f in variants.items():
            t = time.perf_counter()
            jax.block_until_ready(f(params, batch))
            times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def main():
    print(f"\n## one PPO loss gradient, policy + critic, mini-batch 16, 16-token prompts, "
          f"{jax.devices()[0].platform.upper()}\n")
    print("| shape | vocab | variant | ms | vs before |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, layers, width, response, vocab in [("small", 2, 128, 32, 50257), ("medium", 4, 512, 64, 384)]:
        res = bench(layers, width, response, vocab)
        before = res["entropy differentiated (before)"]
        for variant, t in res.items():
            print(f"| {name} | {vocab} | {variant} | {1e3 * t:.1f} | {before / t:.2f}x |")


if __name__ == "__main__":
    main()
