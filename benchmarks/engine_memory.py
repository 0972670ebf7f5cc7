"""Benchmark: the update engine's own memory. At a tiny sequence, where activations are
negligible, how many bytes of temporaries does the compiled `train_step` need beyond its
arguments, in units of one gradient (the parameters' bytes)? One gradient is the floor.

Compiled ahead of time with abstract parameters (nothing is allocated) on the CPU:

    python benchmarks/engine_memory.py                   # Qwen2.5-0.5B layout, 2 layers
    python benchmarks/engine_memory.py --layers 8

Policy + separate critic of the same layout, f32, Adam per part (`optax.multi_transform`,
as the trainer builds it), batch 8, mini-batch 4, 1 epoch, 16 prompt + 16 response tokens.
XLA:CPU's buffer assignment is a proxy for accelerator memory, not a promise.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import jaxppo
from jaxppo.models import Model, ModelConfig
from jaxppo.models.model import PolicyAndCritic
from jaxppo.config.optimizer import build_optimizer

from tables import print_markdown


def qwen_layout(layers):
    return ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, num_layers=layers, num_heads=14,
                       num_kv_heads=2, intermediate_size=4864, max_position_embeddings=32768, qkv_bias=True,
                       tie_word_embeddings=True, rope_theta=1000000.0)


def measure(layers, batch=8, mini=4, q=16, r=16, target_kl=None):
    config = qwen_layout(layers)
    policy, critic = Model(config), Model(config, kind="value")
    apply_fn = PolicyAndCritic(policy, critic)
    _, tx = build_optimizer(jaxppo.OptimizerConfig(learning_rate=1e-6), 1, critic=True)
    ppo = jaxppo.Config.from_settings(batch_size=batch, mini_batch_size=mini, ppo_epochs=1, target_kl=target_kl)

    def make_state():
        params = {"policy": policy.init(jax.random.key(0), seq_len=2),
                  "critic": critic.init(jax.random.key(1), seq_len=2)}
        return jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)

    state = jax.eval_shape(make_state)
    rollout = jaxppo.RolloutBatch(
        query_tokens=jax.ShapeDtypeStruct((batch, q), jnp.int32), query_mask=jax.ShapeDtypeStruct((batch, q), jnp.int32),
        response_tokens=jax.ShapeDtypeStruct((batch, r), jnp.int32),
        response_mask=jax.ShapeDtypeStruct((batch, r), jnp.int32),
        logprobs=jax.ShapeDtypeStruct((batch, r), jnp.float32), values=jax.ShapeDtypeStruct((batch, r), jnp.float32),
        rewards=jax.ShapeDtypeStruct((batch, r), jnp.float32))
    key = jax.eval_shape(lambda: jax.random.key(0))
    start = time.perf_counter()
    step = jax.jit(functools.partial(jaxppo.update.train_step_fn, config=ppo), donate_argnums=(0,))
    compiled = step.lower(state, rollout, key).compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    return dict(layers=layers, target_kl=target_kl, params_gib=grad_bytes / 2**30,
                args_gib=mem.argument_size_in_bytes / 2**30, temp_gib=mem.temp_size_in_bytes / 2**30,
                alias_gib=mem.alias_size_in_bytes / 2**30, ratio=mem.temp_size_in_bytes / grad_bytes,
                compile_s=seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="*", default=[2])
    args = parser.parse_args()
    rows = [measure(n, target_kl=kl) for n in args.layers for kl in (None, 0.1)]
    print()
    print_markdown(["layers", "target_kl", "parameters = 1 gradient (GiB)", "arguments (GiB)", "aliased (GiB)",
                    "temporaries (GiB)", "temporaries / gradient", "compile (s)"],
                   [[r["layers"], r["target_kl"], f"{r['params_gib']:.2f}", f"{r['args_gib']:.2f}",
                     f"{r['alias_gib']:.2f}", f"{r['temp_gib']:.2f}", f"{r['ratio']:.2f}x", f"{r['compile_s']:.1f}"]
                    for r in rows], numeric_from=2)


if __name__ == "__main__":
    main()
