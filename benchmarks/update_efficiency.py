"""Benchmark: how much of XLA's own matmul rate `train_step` reaches at a real model's shape.

    jaxppo-fixture                               # once: SmolLM2-135M-Instruct
    python benchmarks/update_efficiency.py       # its update at the real-model side by side's shape

The update: GRPO, 32 rows (4 prompts x 8), 48-token prompts, 24-token responses, one epoch
of 2 mini-batches, float32, with and without each group's prompt once. Its FLOPs are
XLA's own count of the compiled program (`cost_analysis`); the matmul rate is a float32
matmul at the model's MLP shape (tokens x 576 x 1536) on the same machine, timed right
before. Achieved = FLOPs / median seconds per update; the fraction says how much of the
time goes to the model's matmuls at that rate and how much to everything else.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxppo
import jaxppo.models as jm
from jaxppo.models.fixtures import fixture_dir, is_prepared

from shared_prompts import make_rollout
from tables import median_time, print_markdown


def matmul_rate(m, k, n, repeats=5):
    """float32 GFLOP/s of an (m, k) @ (k, n) matmul, compiled, median of `repeats`."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(m, k)), jnp.float32)
    b = jnp.asarray(np.random.default_rng(1).normal(size=(k, n)), jnp.float32)
    f = jax.jit(lambda a, b: a @ b)
    seconds, _ = median_time(lambda: f(a, b).block_until_ready(), repeats)
    return 2 * m * k * n / seconds / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = args.model or fixture_dir()
    if args.model is None and not is_prepared(path):
        raise SystemExit(f"no prepared model in {path}: run `jaxppo-fixture` first, or pass --model DIR")
    model, params = jm.from_pretrained(path)
    prompts, g, q, r = 4, 8, 48, 24
    b = prompts * g
    rollout = make_rollout(prompts, g, q, r, model.config.vocab_size)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=16, ppo_epochs=1,
                                            num_generations=g, kl_loss_coef=0.0)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-6))
    key = jax.random.key(0)
    d, f = model.config.hidden_size, model.config.intermediate_size
    tokens = 16 * (q + r)
    rates = {f"matmul {tokens}x{d}x{f}": matmul_rate(tokens, d, f),
             f"matmul {tokens}x{d}x{d}": matmul_rate(tokens, d, d)}
    rate = max(rates.values())
    rows = []
    for share in (False, True):
        c = config.replace(share_prompts=share)
        start = time.perf_counter()
        compiled = jaxppo.train_step.lower(state, rollout, key, c).compile()
        compile_s = time.perf_counter() - start
        flops = compiled.cost_analysis()["flops"]
        seconds, _ = median_time(lambda: jax.block_until_ready(compiled(state, rollout, key)[0].params), args.repeats)
        achieved = flops / seconds / 1e9
        rows.append(["each prompt once" if share else "every row", f"{flops / 1e12:.2f}", f"{seconds:.2f}",
                     f"{achieved:.0f}", f"{achieved / rate:.0%}", f"{compile_s:.1f}"])
    print(f"\n## train_step's efficiency: {path.rstrip('/').split('/')[-1]}, GRPO, {b} rows, Q={q}, R={r}, "
          f"2 updates, float32, {jax.devices()[0].platform}\n")
    print("matmul rates (GFLOP/s): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + "\n")
    print_markdown(["path", "TFLOP (XLA count)", "s per train_step", "GFLOP/s", "of the matmul rate", "compile s"],
                   rows)


if __name__ == "__main__":
    main()
