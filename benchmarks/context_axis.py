"""Benchmark: the update at long rows with each row's positions split over a context axis,
on 8 host (CPU) devices: one device against context axes of 2, 4 and 8, ring and Ulysses.

    python benchmarks/context_axis.py            # rows of 2048 tokens (512 + 1536)
    python benchmarks/context_axis.py --quick    # rows of 1024 tokens

Shape: Llama layout, 4 layers, width 256, 8 query heads and 2 key/value heads, vocab 512;
GRPO (no critic), batch 4 rows, mini-batch 2, 1 epoch, float32, einsum attention. Each
program is compiled ahead of time and its per-device memory read from XLA's analysis; the
step time is the second call's. The host "devices" share this machine's two cores, so
times show what the partitioned program costs here (work that is skipped or duplicated,
the collectives' copies), not a speed-up; the temporaries (activations, attention scores)
are the figure that carries over to accelerators.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxppo  # noqa: E402
import jaxppo.models as jm  # noqa: E402
from jaxppo import sharding as sh  # noqa: E402


def _step(method, context, cfg, rollout, config):
    policy = jm.Model(cfg, context_attention=method or "auto")
    state = jaxppo.TrainState.create(apply_fn=policy, params=policy.init(jax.random.key(0)), tx=optax.adam(1e-5))
    if context is None:
        return jax.jit(lambda s, r, k: jaxppo.update.train_step_fn(s, r, k, config)), state, rollout
    mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=1, context=context), jax.devices()[:context])
    state = sh.shard_state(state, mesh)
    return sh.sharded_train_step(state, config, mesh), state, sh.shard_batch(rollout, mesh)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    q, r = (256, 768) if args.quick else (512, 1536)
    cfg = jm.ModelConfig(model_type="llama", vocab_size=512, hidden_size=256, num_layers=4, num_heads=8,
                         num_kv_heads=2, intermediate_size=1024, max_position_embeddings=q + r,
                         tie_word_embeddings=False)
    b = 4
    rng = np.random.default_rng(0)
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(3, 512, (b, q))), query_mask=jnp.ones((b, q), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(3, 512, (b, r))), response_mask=jnp.ones((b, r), jnp.int32),
        logprobs=jnp.full((b, r), -6.0), values=jnp.zeros((b, r)), rewards=jnp.ones((b, r)))
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=2, ppo_epochs=1, num_generations=2,
                                         kl_loss_coef=0.0)
    rows = []
    for method, context in [(None, None), ("ring", 2), ("ring", 4), ("ring", 8), ("ulysses", 2), ("ulysses", 4),
                            ("ulysses", 8)]:
        step, state, batch = _step(method, context, cfg, rollout, config)
        start = time.perf_counter()
        compiled = step.lower(state, batch, jax.random.key(0)).compile()
        compile_s = time.perf_counter() - start
        mem = compiled.memory_analysis()
        jax.block_until_ready(step(state, batch, jax.random.key(0)))
        start = time.perf_counter()
        out = step(state, batch, jax.random.key(1))
        jax.block_until_ready(out)
        label = "1 device" if context is None else f"context {context}, {method}"
        rows.append((label, mem.argument_size_in_bytes / 2**20, mem.temp_size_in_bytes / 2**20, compile_s,
                     time.perf_counter() - start, int(out[0].step)))
        print(f"  measured {label}", flush=True)

    print(f"\n## GRPO update, rows of {q} + {r} tokens, Llama layout 4 x 256 (8 heads, 2 kv heads), batch {b}, "
          "mini-batch 2, 8 host devices\n")
    print("| layout | arguments / device (MiB) | temporaries / device (MiB) | compile (s) | step (s) | updates |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, a, t, c, s, u in rows:
        print(f"| {label} | {a:.1f} | {t:.1f} | {c:.1f} | {s:.2f} | {u} |")


if __name__ == "__main__":
    main()
