"""Benchmark: compiled memory and compile time of PPO at real model shapes, ahead of time,
with abstract parameters (`jax.eval_shape`: nothing is allocated, so an 8B layout compiles
on a laptop). For each program (the PPO `train_step`, rollout scoring `finish_rollout`, and
`generate`) it prints per-device argument / output / aliased / temporary bytes, the peak
(argument + output - aliased + temporaries) and the compile time.

    python benchmarks/memory.py                    # every row below (about 15 min on 2 cores)
    python benchmarks/memory.py --only qwen-256    # rows whose name contains the text
    python benchmarks/memory.py --only grpo        # LoRA against full fine-tuning, Llama-3.1-8B
    python benchmarks/memory.py --list

Rows compare today's path ("full": the model's full (B, L, V) logits, sliced, which is what
a user's own apply_fn gets) with the built-in head ("resp": LM head at response positions
only; "chunkK": K positions at a time, rematerialised), unrolled with scanned layers, and
remat off with on. Policy + separate critic are trained (float32 master weights, the
trainer's clipped Adam); reference and reward model are frozen copies of the layout. The
"grpo" rows train the policy alone (no critic, no reward model: rewards on the host) with
LoRA rank 16 on every linear layer (base frozen in bf16, reference = adapters off, no copy)
against full fine-tuning (float32 master weights, a bf16 reference copy).

What it predicts: how the compiled program's buffers scale with shapes and settings, and
roughly what one device must hold. What it does not: XLA:CPU's buffer assignment and fusion
differ from XLA:GPU's and TPU's, so absolute bytes are a proxy, not a promise, and compile
times are this CPU's (an accelerator backend compiles at a different speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import time

# 8 host devices for the fsdp rows (set before jax is imported; single-device rows use one).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp

import jaxppo
from jaxppo import sharding as sh
from jaxppo.update.kl import fixed_kl_controller
from jaxppo.update.stats import RunningMoments
from jaxppo.models import Model
from jaxppo.models.decoding import GenerationOutput
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.static import generate_jit
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.run import assembly

import layouts
from tables import print_markdown

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class FullLogits:
    """An apply_fn without the scoring protocol: full logits, sliced (today's path)."""

    fn: object

    def __call__(self, params, tokens, mask):
        return self.fn(params, tokens, mask)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    layout: str
    q: int
    r: int
    batch: int
    mini: int
    head: str = "chunk128"  # "full", "resp" or "chunkK"
    scan: bool = True
    remat: object = False
    dtype: str = "float32"
    frozen_dtype: str = "float32"
    fsdp: int = 1
    layers: int = None  # default: the layout's
    programs: tuple = ("train",)
    critic_free: bool = False  # GRPO family: the policy alone is trained (no critic, no reward model)
    lora: int = 0  # LoRA rank on every linear layer (0: full fine-tuning); with critic_free only


def _rows():
    q5 = dict(layout="qwen2.5-0.5b", batch=8)
    rows = [
        Row("qwen-256-mb4 unrolled full (today)", q=256, r=256, mini=4, head="full", scan=False, **q5),
        Row("qwen-256-mb4 unrolled full, 2 layers", q=256, r=256, mini=4, head="full", scan=False, layers=2, **q5),
        Row("qwen-256-mb4 scanned full", q=256, r=256, mini=4, head="full", **q5),
        Row("qwen-256-mb4 scanned full, 2 layers", q=256, r=256, mini=4, head="full", layers=2, **q5),
        Row("qwen-256-mb4 scanned resp", q=256, r=256, mini=4, head="resp", **q5),
        Row("qwen-256-mb4 scanned chunk128", q=256, r=256, mini=4, **q5),
        Row("qwen-256-mb4 scanned full remat", q=256, r=256, mini=4, head="full", remat=True, **q5),
        Row("qwen-256-mb4 scanned resp remat", q=256, r=256, mini=4, head="resp", remat=True, **q5),
        Row("qwen-256-mb4 scanned chunk128 remat", q=256, r=256, mini=4, remat=True, **q5),
        Row("qwen-256-mb4 unrolled chunk128 remat", q=256, r=256, mini=4, scan=False, remat=True, **q5),
        Row("qwen-256-mb8 scanned chunk128 remat", q=256, r=256, mini=8, remat=True, **q5),
        Row("qwen-1024-mb4 scanned full", q=1024, r=1024, mini=4, head="full", **q5),
        Row("qwen-1024-mb4 scanned chunk128 remat", q=1024, r=1024, mini=4, remat=True, **q5),
        Row("qwen-1024-mb8 scanned chunk128 remat", q=1024, r=1024, mini=8, remat=True, **q5),
        Row("qwen-256 rollout+generate, bf16", q=256, r=256, batch=8, mini=8, layout="qwen2.5-0.5b",
            dtype="bfloat16", frozen_dtype="bfloat16", programs=("score", "generate")),
    ]
    big = dict(q=512, r=512, batch=64, mini=64, remat=True, dtype="bfloat16", frozen_dtype="bfloat16", fsdp=8,
               programs=("train", "score", "generate"))
    rows += [
        Row("llama1b fsdp8 bf16 scanned chunk128 remat", layout="llama3.2-1b", **big),
        Row("llama8b fsdp8 bf16 scanned chunk128 remat", layout="llama3.1-8b", **big),
        Row("llama8b fsdp8 bf16 scanned full remat", layout="llama3.1-8b", head="full",
            **{**big, "programs": ("train",)}),
    ]
    # LoRA against full fine-tuning, GRPO (policy alone, reference scored, reward on the host).
    grpo = dict(layout="llama3.1-8b", q=512, r=512, batch=64, mini=16, remat=True, dtype="bfloat16",
                frozen_dtype="bfloat16", critic_free=True, programs=("train", "score"))
    rows += [
        Row("llama8b 1 device bf16 grpo lora16", lora=16, **grpo),
        Row("llama8b 1 device bf16 grpo full fine-tuning", **grpo),
        Row("llama8b fsdp8 bf16 grpo lora16", lora=16, fsdp=8, **grpo),
        Row("llama8b fsdp8 bf16 grpo full fine-tuning", fsdp=8, **grpo),
    ]
    return rows


def _chunk(head):
    return int(head[len("chunk"):]) if head.startswith("chunk") else None


def _config(row):
    make = layouts.LAYOUTS[row.layout]
    return make() if row.layers is None else make(layers=row.layers)


def _mesh(row):
    return sh.make_mesh(sh.MeshConfig(data=1, fsdp=row.fsdp), jax.devices()[: row.fsdp])


def _with_shardings(tree, mesh):
    shardings = sh.tree_shardings(tree, mesh)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _rows_sharded(tree, mesh):
    rows = sh.batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows), tree)


def _report(compiled, seconds):
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return dict(compile_s=seconds, arg=m.argument_size_in_bytes / GIB, out=m.output_size_in_bytes / GIB,
                alias=m.alias_size_in_bytes / GIB, temp=m.temp_size_in_bytes / GIB, peak=peak / GIB)


def _timed_compile(lower):
    start = time.perf_counter()
    compiled = lower().compile()
    return compiled, time.perf_counter() - start


def _state(row, remat):
    config = _config(row)
    setup = layouts.Setup(row.dtype, row.scan, remat, _chunk(row.head))
    if row.critic_free:
        return layouts.make_policy_state(config, setup, row.lora)[0]
    return layouts.make_state(config, setup)


def train(row):
    state = _state(row, row.remat)
    if row.head == "full":
        state = state.replace(apply_fn=FullLogits(state.apply_fn))
    ppo = (jaxppo.Config.for_algorithm("grpo", batch_size=row.batch, mini_batch_size=row.mini, ppo_epochs=1,
                                          num_generations=8)
           if row.critic_free else jaxppo.Config.from_settings(batch_size=row.batch, mini_batch_size=row.mini, ppo_epochs=1))
    rollout = layouts.abstract_rollout(row.batch, row.q, row.r)
    if ppo.kl.kl_loss_coef:
        rollout = rollout.replace(ref_logprobs=rollout.logprobs)
    key = jax.eval_shape(lambda: jax.random.key(0))
    if row.fsdp > 1:
        mesh = _mesh(row)
        step = sh.sharded_train_step(state, ppo, mesh, donate=True)
        return _timed_compile(lambda: step.lower(_with_shardings(state, mesh), _rows_sharded(rollout, mesh), key))
    step = jax.jit(functools.partial(jaxppo.update.train_step_fn, config=ppo), donate_argnums=(0,))
    return _timed_compile(lambda: step.lower(state, rollout, key))


def _frozen(config, row, kind):
    model = Model(config, kind=kind, dtype=row.frozen_dtype, param_dtype=row.frozen_dtype, scan_layers=row.scan,
                  remat=False, logits_chunk_size=_chunk(row.head))
    return model, jax.eval_shape(lambda: model.init(jax.random.key(0), seq_len=2))


def score(row):
    config = _config(row)
    state = _state(row, False)
    b, q, r = row.batch, row.q, row.r
    host_scores = None
    if row.critic_free:  # the reference only: a frozen copy, or the policy's base with adapters off
        policy = state.apply_fn.__self__
        if row.lora:
            ref_model, ref_params = dataclasses.replace(policy, adapters=False), None
        else:
            ref_model, ref_params = _frozen(config, row, "causal_lm")
        reward_params = None
        spec = RolloutSpec(policy=policy, apply_fn=state.apply_fn, ref_apply=assembly.LogitsOf(ref_model),
                           ref_is_policy=bool(row.lora), keep_ref_logprobs=True, response_length=row.r)
        host_scores = jax.ShapeDtypeStruct((b,), jnp.float32)
    else:
        ref_model, ref_params = _frozen(config, row, "causal_lm")
        reward_model, reward_params = _frozen(config, row, "reward")
        spec = RolloutSpec(policy=state.apply_fn.policy, apply_fn=state.apply_fn,
                           ref_apply=assembly.LogitsOf(ref_model), reward_apply=reward_model.apply,
                           response_length=row.r, policy_params_key="policy")
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    gen = GenerationOutput(i32(b, r), jax.ShapeDtypeStruct((b, r), jnp.float32), i32(b, r))
    kl = jax.eval_shape(lambda: fixed_kl_controller(0.05))
    moments = jax.eval_shape(RunningMoments.zeros)
    args = [state.params, ref_params, reward_params, i32(b, q), i32(b, q), gen, host_scores]
    if row.fsdp > 1:
        mesh = _mesh(row)
        args = [_with_shardings(a, mesh) for a in args[:3]] + [_rows_sharded(a, mesh) for a in args[3:]]
    params, ref, rewards, ids, mask, gen, host_scores = args
    lower = lambda: finish_rollout.lower(spec, params, ref, rewards, (ids, mask), gen, host_scores,  # noqa: E731
                                         Shaping(kl, moments))
    if row.fsdp > 1:
        with jax.set_mesh(mesh):
            return _timed_compile(lower)
    return _timed_compile(lower)


def generate(row):
    config = _config(row)
    policy = Model(config, dtype=row.dtype, param_dtype="float32", scan_layers=row.scan)
    params = jax.eval_shape(lambda: policy.init(jax.random.key(0), seq_len=2))
    b, q = row.batch, row.q
    ids = jax.ShapeDtypeStruct((b, q), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    sampling = Sampling(response_length=row.r, stop_token_ids=(), pad_token_id=0).check(policy)
    if row.fsdp > 1:
        mesh = _mesh(row)
        params, ids = _with_shardings(params, mesh), _rows_sharded(ids, mesh)
    return _timed_compile(lambda: generate_jit.lower(policy, params, ids, ids, key, sampling))


PROGRAMS = {"train": train, "score": score, "generate": generate}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="run rows whose name contains any of these")
    parser.add_argument("--skip", nargs="*", default=(), help="skip rows whose name contains any of these")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args(argv)
    rows = [r for r in _rows() if (args.only is None or any(s in r.name for s in args.only))
            and not any(s in r.name for s in args.skip)]
    if args.list:
        print("\n".join(r.name for r in rows))
        return
    table = []
    for row in rows:
        for program in row.programs:
            try:
                compiled, seconds = PROGRAMS[program](row)
                res = _report(compiled, seconds)
                cells = [f"{res['compile_s']:.1f}"] + [f"{res[k]:.2f}" for k in ("arg", "out", "alias", "temp", "peak")]
            except Exception as err:  # report the row and go on
                cells = [f"failed: {type(err).__name__}: {str(err)[:80]}"] + [""] * 5
            line = [row.name, program, f"{row.q}+{row.r}", f"{row.mini}/{row.batch}", row.fsdp] + cells
            print(" | ".join(str(c) for c in line), flush=True)
            table.append(line)
    print()
    print_markdown(["row", "program", "tokens", "mini/batch", "devices", "compile (s)", "arguments GiB",
                    "outputs GiB", "aliased GiB", "temporaries GiB", "peak GiB"], table, numeric_from=4)


if __name__ == "__main__":
    main()
