"""Benchmark: per-device compiled memory and step time of `train_step` across mesh shapes,
on 8 host (CPU) devices.

    python benchmarks/scaling.py            # the medium shape
    python benchmarks/scaling.py --quick    # a small shape

Shape (medium): GPT-2 layout, 4 layers, width 512, vocab 384, a policy and a separate
critic, batch 64, mini-batch 16, 4 epochs, 16 + 64 tokens. The 8 "devices" are host
devices sharing this machine's cores, so step times show the cost of the partitioned
program (collectives included), not a speed-up; the memory column is the figure that
carries over to real accelerators: parameters, optimizer states and activations per device.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    width, layers, response = (128, 2, 32) if args.quick else (512, 4, 64)
    cfg = jm.ModelConfig(model_type="gpt2", vocab_size=384, hidden_size=width, num_layers=layers,
                         num_heads=max(1, width // 64), num_kv_heads=max(1, width // 64), intermediate_size=4 * width,
                         max_position_embeddings=16 + response)
    policy, critic = jm.Model(cfg), jm.Model(cfg, kind="value")
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.adam(1e-5))
    b = 64
    rng = np.random.default_rng(0)
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(3, 384, (b, 16))), query_mask=jnp.ones((b, 16), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(3, 384, (b, response))), response_mask=jnp.ones((b, response), jnp.int32),
        logprobs=jnp.full((b, response), -6.0), values=jnp.zeros((b, response)), rewards=jnp.ones((b, response)))
    config = jaxppo.Config.from_settings(batch_size=b, mini_batch_size=16, ppo_epochs=4)
    n_params = sum(x.size for x in jax.tree.leaves(params))

    rows = []
    shapes = [None, (8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (2, 2, 2), (1, 4, 2)]
    for shape in shapes:
        if shape is None:
            step = jax.jit(lambda s, r, k: jaxppo.update.train_step_fn(s, r, k, config))
            s, r = state, rollout
            label = "1 device"
        else:
            mesh = sh.make_mesh(sh.MeshConfig(*shape))
            s, r = sh.shard_state(state, mesh), sh.shard_batch(rollout, mesh)
            step = sh.sharded_train_step(s, config, mesh)
            label = f"{shape[0]} x {shape[1]} x {shape[2]}"
        compiled = step.lower(s, r, jax.random.key(0)).compile()
        mem = compiled.memory_analysis()
        args_mib = mem.argument_size_in_bytes / 2**20
        temp_mib = mem.temp_size_in_bytes / 2**20
        out = step(s, r, jax.random.key(0))
        jax.block_until_ready(out)
        start = time.perf_counter()
        out = step(s, r, jax.random.key(1))
        jax.block_until_ready(out)
        rows.append((label, args_mib, temp_mib, time.perf_counter() - start, int(out[0].step)))
        print(f"  measured {label}", flush=True)

    print(f"\n## train_step per device, {layers} layers, width {width}, policy + critic = {n_params / 1e6:.1f}M "
          f"parameters, batch 64, mini-batch 16, 4 epochs, 8 host devices\n")
    print("| mesh (data x fsdp x tensor) | arguments / device (MiB) | temporaries / device (MiB) | step time (s) | updates |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, a, t, secs, updates in rows:
        print(f"| {label} | {a:.1f} | {t:.1f} | {secs:.2f} | {updates} |")


if __name__ == "__main__":
    main()
