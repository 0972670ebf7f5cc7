"""Benchmark: the compiled scan engine vs a Python loop of jitted mini-batch steps, and the
compiled temporary memory of `train_step` across batch and mini-batch sizes.

    python benchmarks/update_loop.py            # full tables (a few minutes on 2 CPU cores)
    python benchmarks/update_loop.py --quick    # smaller, for a smoke run

The Python-loop baseline is the structure PyTorch trainers (and several JAX RLHF libraries)
use: advantages once, then for each epoch a permutation and, for each mini-batch, a
gather and one call of a jitted `update(state, minibatch)`. Both run the same loss, the same
optimizer and the same number of updates; only the driving loop differs.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxppo
from jaxppo.testing.toy import make_toy
from jaxppo.update.minibatches import grads_and_aux
from jaxppo.update.objective import loss_for, token_count
from jaxppo.update.ppo import compute_advantages, train_step

Q, R = 16, 32


def make_state(vocab, width, depth):
    apply_fn, params = make_toy(jax.random.key(0), vocab_size=vocab, width=width, depth=depth, heads=4,
                                max_len=Q + R, seq_len=Q + R)
    return jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.adam(1e-4))


def make_rollout(b, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(R // 2, R + 1, size=(b, 1))
    return jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(0, vocab, size=(b, Q)), jnp.int32),
        query_mask=jnp.ones((b, Q), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(0, vocab, size=(b, R)), jnp.int32),
        response_mask=jnp.asarray(np.arange(R)[None] < lengths, jnp.int32),
        logprobs=jnp.asarray(-np.log(vocab) + 0.1 * rng.normal(size=(b, R)), jnp.float32),
        values=jnp.zeros((b, R), jnp.float32),
        rewards=jnp.asarray(rng.normal(size=(b, R)), jnp.float32),
    )


def python_loop_step(state, rollout, key, config, update, advantages_fn):
    """Same math, driven from Python: one jitted call per mini-batch."""
    advantages, returns = advantages_fn(rollout)
    batch = {
        "query_tokens": rollout.query_tokens, "query_mask": rollout.query_mask,
        "response_tokens": rollout.response_tokens, "response_mask": rollout.response_mask,
        "logprobs": rollout.logprobs, "values": rollout.values, "advantages": advantages, "returns": returns,
    }
    for epoch_key in jax.random.split(key, config.batch.ppo_epochs):
        perm = jax.random.permutation(epoch_key, config.batch.batch_size)
        for m in range(config.batch.num_minibatches):
            idx = perm[m * config.batch.mini_batch_size : (m + 1) * config.batch.mini_batch_size]
            minibatch = {k: v[idx] for k, v in batch.items()}
            state, _ = update(state, minibatch)
    return state


def make_update(config):
    """One jitted mini-batch update: the same gradient code as the engine, minus its
    non-finite guard (so the baseline does slightly less work per update)."""

    @jax.jit
    def update(state, minibatch):
        loss_fn = loss_for(state.apply_fn, config)
        loss, _, grads = grads_and_aux(state.params, minibatch, loss_fn, token_count, config)
        return state.apply_gradients(grads), loss

    return update


def time_fn(fn, repeats):
    fn()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def speed_table(shapes, repeats):
    rows = []
    for name, vocab, width, depth, b, mb in shapes:
        state = make_state(vocab, width, depth)
        rollout = make_rollout(b, vocab)
        config = jaxppo.Config.from_settings(batch_size=b, mini_batch_size=mb, ppo_epochs=4)
        key = jax.random.key(1)
        update = make_update(config)
        advantages_fn = jax.jit(lambda r: compute_advantages(r, config))

        def scan_engine():
            s, m = jaxppo.train_step(state, rollout, key, config)
            jax.block_until_ready(s.params)

        def python_loop():
            s = python_loop_step(state, rollout, key, config, update, advantages_fn)
            jax.block_until_ready(s.params)

        t_scan = time_fn(scan_engine, repeats)
        t_loop = time_fn(python_loop, repeats)
        rows.append((name, b, mb, config.batch.updates_per_step, t_scan, t_loop, t_loop / t_scan))
        print(f"  measured {name}, batch {b}, mini-batch {mb}", flush=True)
    print("\n## seconds per train_step (median of %d), CPU, %s\n" % (repeats, jax.devices()[0].device_kind))
    print("| policy | batch | mini-batch | updates | scan engine (s) | Python loop (s) | loop / scan |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, b, mb, n, ts, tl, ratio in rows:
        print(f"| {name} | {b} | {mb} | {n} | {ts:.4f} | {tl:.4f} | {ratio:.2f}x |")


def memory_table(batch_sizes, mini_batch_sizes, vocab, width, depth):
    state = make_state(vocab, width, depth)
    print(f"\n## compiled temporary memory of train_step (MiB), policy vocab {vocab}, width {width}, "
          f"depth {depth}, {Q}+{R} tokens, ppo_epochs 4\n")
    print("| mini_batch_size | " + " | ".join(f"batch {b}" for b in batch_sizes) + " | largest / smallest valid batch |")
    print("| ---: | " + " | ".join("---:" for _ in batch_sizes) + " | ---: |")
    for mb in mini_batch_sizes:
        cells, temps = [], []
        for b in batch_sizes:
            if b % mb:
                cells.append("invalid (batch % mini-batch != 0)")
                continue
            config = jaxppo.Config.from_settings(batch_size=b, mini_batch_size=mb, ppo_epochs=4)
            rollout = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), make_rollout(b, vocab))
            compiled = train_step.lower(state, rollout, jax.random.key(0), config).compile()
            temps.append(compiled.memory_analysis().temp_size_in_bytes / 2**20)
            cells.append(f"{temps[-1]:.2f}")
        ratio = f"{temps[-1] / temps[0]:.3f}" if len(temps) > 1 else "-"
        print(f"| {mb} | " + " | ".join(cells) + f" | {ratio} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        speed_table([("vocab 256, width 64, depth 2", 256, 64, 2, 32, 8)], repeats=3)
        memory_table([64, 256], [8, 32], 256, 64, 2)
        return
    speed_table(
        [
            ("vocab 256, width 64, depth 2", 256, 64, 2, 64, 8),
            ("vocab 256, width 64, depth 2", 256, 64, 2, 64, 16),
            ("vocab 256, width 128, depth 2", 256, 128, 2, 64, 16),
            ("vocab 1024, width 256, depth 4", 1024, 256, 4, 64, 16),
        ],
        repeats=5,
    )
    memory_table([64, 256, 1024], [8, 32, 128], 256, 128, 2)


if __name__ == "__main__":
    main()
