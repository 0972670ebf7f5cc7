"""Benchmark on one accelerator: PPO `train_step` of a Qwen2.5-0.5B-layout (or --layout) policy + critic
in bf16 compute (float32 master weights, the trainer's clipped Adam), and `generate` of the
same policy: compile time, step time, tokens/s, model FLOPs utilisation, peak memory. Random
weights (no downloads); the shapes and the compiled programs are those of the real model.

    python benchmarks/gpu.py                      # on a GPU/TPU; writes --out (JSON) too
    python benchmarks/gpu.py --layout llama3.2-1b --sections "mini-batch 16,generate"
    python benchmarks/gpu.py --tiny               # a 2-layer, small-vocab smoke run (CPU)

MFU = model FLOPs (`layouts.train_flops` / `decode_flops`) / time / --peak-tflops (default
989, the H100/H200 SXM dense bf16 datasheet figure); for sampling also HBM % = bytes a
decode must read (`layouts.decode_bytes`) / time / --peak-tbps (default 4.8, H200). The
sections cover the plain and the hoisted sampler (`hoist_layers`) at --batch and 4 x
--batch rows, and the update with cuDNN flash attention (`attention="cudnn"`). Each
section is timed after a warm-up call; a failing section is reported and the rest still
run.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.static import generate_jit

import layouts
from tables import print_markdown


def _program_gib(compiled):
    """The compiled program's own footprint on the device: arguments + outputs - aliased +
    temporaries (the allocator's process-wide peak never resets, so it cannot tell
    sections apart)."""
    m = compiled.memory_analysis()
    if m is None:
        return float("nan")
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes) / 2**30


def _timed(fn, repeats):
    times = []
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def bench_train(config, setup, batch, mini, q, r, repeats, peak):
    ppo = jaxppo.Config.from_settings(batch_size=batch, mini_batch_size=mini, ppo_epochs=1)
    state = layouts.make_state(config, setup, abstract=False)
    rollout = layouts.random_rollout(batch, q, r, config.vocab_size)
    step = jax.jit(functools.partial(jaxppo.update.train_step_fn, config=ppo), donate_argnums=(0,))
    start = time.perf_counter()
    compiled = step.lower(state, rollout, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def run():
        holder["state"], metrics = compiled(holder["state"], rollout, jax.random.key(1))
        return metrics

    metrics = run()  # warm-up
    jax.block_until_ready(metrics)
    assert int(metrics["ppo/updates_applied"]) == ppo.batch.updates_per_step, metrics["ppo/updates_applied"]
    loss = float(metrics["loss/total_avg"])
    assert np.isfinite(loss), loss
    seconds, _ = _timed(run, repeats)
    flops = layouts.train_flops(config, batch, q, r)
    return {"compile_s": compile_s, "step_s": seconds, "tokens_per_s": batch * (q + r) / seconds,
            "mfu": flops / seconds / (peak * 1e12), "updates": ppo.batch.updates_per_step, "loss": loss,
            "program_gib": _program_gib(compiled)}


def bench_generate(config, setup, batch, q, r, repeats, peak, peak_bw=None):
    """`generate_jit` compiled once, then timed. With `peak_bw` (bytes/s) also the decode's
    HBM-bandwidth utilisation: `layouts.decode_bytes` (weights read once per step in the
    compute dtype, the KV cache of the attended slots) / generate time / peak (the prefill
    is counted in the time, not in the bytes: a lower bound)."""
    policy, _ = setup.models(config)
    params = jax.jit(lambda: policy.init(jax.random.key(0), seq_len=2))()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (batch, q)), jnp.int32)
    mask = jnp.ones_like(ids)
    sampling = Sampling(response_length=r, stop_token_ids=(), pad_token_id=0, early_stop=False).check(policy)
    start = time.perf_counter()
    compiled = generate_jit.lower(policy, params, ids, mask, jax.random.key(0), sampling).compile()
    first_s = time.perf_counter() - start
    call = lambda key: compiled(params, ids, mask, key, sampling).tokens
    seconds, _ = _timed(lambda: call(jax.random.key(1)), repeats)
    flops = layouts.decode_flops(config, batch, q, r)
    out = {"first_call_s": first_s, "generate_s": seconds, "tokens_per_s": batch * r / seconds,
           "mfu": flops / seconds / (peak * 1e12), "program_gib": _program_gib(compiled)}
    if peak_bw:
        size = jnp.dtype(setup.dtype).itemsize
        out["hbm_util"] = layouts.decode_bytes(config, batch, q, r, size, size) / seconds / peak_bw
    return out


def _even_token_reward(prompt_ids, prompt_mask, response_ids, response_mask):
    """A jittable token-level reward (the random policy samples ids no small tokenizer can
    decode): the share of even token ids in the response."""
    m = response_mask.astype(jnp.float32)
    return jnp.sum((response_ids % 2 == 0) * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def bench_trainer(config, setup, batch, mini, q, r, iterations, peak):
    """Whole PPOTrainer iterations (sample, score with reference and a reward function, update)
    with the recommended settings; the first iteration includes compilation."""
    import tempfile

    from jaxppo import demo

    tokenizer = demo.demo_tokenizer()
    policy = setup.models(config)[0]
    params = jax.jit(lambda: policy.init(jax.random.key(0), seq_len=2))()
    rng = np.random.default_rng(0)
    words = ["The", "model", "answers", "a", "question", "about", "rivers", "and", "mountains", "quickly"]
    prompts = [" ".join(rng.choice(words, size=int(rng.integers(2, max(3, q // 6))))) for _ in range(4 * batch)]
    ppo = jaxppo.Config.from_settings(batch_size=batch, mini_batch_size=mini, ppo_epochs=1)
    with tempfile.TemporaryDirectory() as out:
        tc = dict(iterations=iterations, query_length=q, response_length=r, output_dir=out, overlong_prompts="truncate",
                  progress=False, sample_every=0, report_to="jsonl", plot=False, export_final=False,
                  learning_rate=1e-6, dtype=setup.dtype, ref_dtype="bfloat16")
        trainer = jaxppo.Trainer(ppo.replace(**tc), policy=(policy, params), tokenizer=tokenizer, prompts=prompts,
                                 reward_fns=_even_token_reward, reward_fn_on="tokens")
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            metrics = trainer.step()
            times.append(time.perf_counter() - start)
    seconds = float(np.median(times[1:]))
    flops = layouts.train_flops(config, batch, q, r) + layouts.decode_flops(config, batch, q, r)
    return {"first_iteration_s": times[0], "iteration_s": seconds, "tokens_per_s": batch * (q + r) / seconds,
            "mfu": flops / seconds / (peak * 1e12), "generation_s": metrics.get("time/generation"),
            "update_s": metrics.get("time/update"), "updates": metrics["ppo/updates_applied"]}


def check_chunked_head_on_device():
    """The built-in log-prob head (chunked) equals full logits on this device (f32)."""
    config = jaxppo.models.ModelConfig(model_type="qwen2", vocab_size=4096, hidden_size=64, num_layers=2,
                                       num_heads=4, num_kv_heads=2, intermediate_size=128,
                                       max_position_embeddings=256, qkv_bias=True, activation="silu")
    model = jaxppo.models.Model(config, logits_chunk_size=16, scan_layers=True)
    params = model.init(jax.random.key(0))
    ro = layouts.random_rollout(4, 32, 40, config.vocab_size)
    lp, _, ent = model.response_outputs(params, ro.query_tokens, ro.query_mask, ro.response_tokens,
                                        ro.response_mask, 0.7)
    logits = model.apply(params, jnp.concatenate([ro.query_tokens, ro.response_tokens], 1),
                         jnp.concatenate([ro.query_mask, ro.response_mask], 1))[:, 31:71]
    want = jaxppo.update.losses.logprobs_from_logits(logits, ro.response_tokens, 0.7)
    return float(jnp.max(jnp.abs(lp - want)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="2 layers, vocab 1024, short sequences (a CPU smoke run)")
    p.add_argument("--layout", default="qwen2.5-0.5b", choices=sorted(layouts.LAYOUTS))
    p.add_argument("--sections", default=None,
                   help="comma-separated substrings: run only the sections whose names contain one of them")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--query", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8; H100 SXM: 3.35)")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the sections left once this much time passed")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    config = layouts.LAYOUTS[args.layout]()
    if args.tiny:
        config = layouts.LAYOUTS[args.layout](layers=2)
        config = type(config)(**{**config.__dict__, "vocab_size": 1024})
        args.batch, args.mini_batch, args.query, args.response, args.repeats = 8, 4, 16, 16, 1
    device = jax.devices()[0]
    env = {"jax": jax.__version__, "device": str(device.device_kind), "platform": device.platform,
           "layout": f"{args.layout} ({config.num_layers} layers, vocab {config.vocab_size})",
           "batch": args.batch, "mini_batch": args.mini_batch, "query": args.query, "response": args.response}
    print(json.dumps(env), flush=True)
    results = {"env": env, "sections": {}}

    sections = [
        ("head check", check_chunked_head_on_device),
        ("train bf16 scan remat chunk128", functools.partial(
            bench_train, config, layouts.Setup("bfloat16", True, True, 128), args.batch, args.mini_batch, args.query,
            args.response, args.repeats, args.peak_tflops)),
        ("generate bf16 scan", functools.partial(
            bench_generate, config, layouts.Setup("bfloat16", True), args.batch, args.query, args.response,
            args.repeats, args.peak_tflops, args.peak_tbps * 1e12)),
        ("generate bf16 scan hoisted", functools.partial(
            bench_generate, config, layouts.Setup("bfloat16", True, hoist_layers=True), args.batch, args.query,
            args.response, args.repeats, args.peak_tflops, args.peak_tbps * 1e12)),
        ("generate bf16 scan hoisted 256 rows", functools.partial(
            bench_generate, config, layouts.Setup("bfloat16", True, hoist_layers=True), 4 * args.batch, args.query,
            args.response, args.repeats, args.peak_tflops, args.peak_tbps * 1e12)),
        ("train bf16 scan remat chunk128 cudnn attention", functools.partial(
            bench_train, config, layouts.Setup("bfloat16", True, True, 128, attention="cudnn"), args.batch,
            args.mini_batch, args.query, args.response, args.repeats, args.peak_tflops)),
        ("trainer iteration bf16 scan remat chunk128", functools.partial(
            bench_trainer, config, layouts.Setup("bfloat16", True, True, 128), args.batch, args.mini_batch, args.query,
            args.response, 4 if not args.tiny else 2, args.peak_tflops)),
        ("train bf16 scan remat chunk128 mini-batch 32", functools.partial(
            bench_train, config, layouts.Setup("bfloat16", True, True, 128), args.batch, 2 * args.mini_batch,
            args.query, args.response, args.repeats, args.peak_tflops)),
        ("train bf16 scan no-remat chunk128", functools.partial(
            bench_train, config, layouts.Setup("bfloat16", True, False, 128), args.batch, args.mini_batch,
            args.query, args.response, args.repeats, args.peak_tflops)),
        ("train bf16 scan remat unchunked", functools.partial(
            bench_train, config, layouts.Setup("bfloat16", True, True, None), args.batch, args.mini_batch,
            args.query, args.response, args.repeats, args.peak_tflops)),
    ]
    if args.sections:
        wanted = [w.strip() for w in args.sections.split(",")]
        sections = [(n, f) for n, f in sections if any(w in n for w in wanted)]
    for name, fn in sections:
        if time.perf_counter() - t0 > args.budget_s:
            results["sections"][name] = {"skipped": "time budget"}
            continue
        if "cudnn" in name and jax.default_backend() != "gpu":
            results["sections"][name] = {"skipped": "cuDNN attention needs an NVIDIA GPU"}
            continue
        try:
            out = fn()
        except Exception as err:  # report and go on: one failing section must not lose the others
            traceback.print_exc()
            out = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        results["sections"][name] = out
        print(name, json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    rows = []
    for name, out in results["sections"].items():
        if isinstance(out, dict) and "tokens_per_s" in out:
            first = out.get("compile_s", out.get("first_call_s", out.get("first_iteration_s")))
            each = out.get("step_s", out.get("generate_s", out.get("iteration_s")))
            rows.append([name, f"{first:.1f}", f"{each:.3f}", f'{out["tokens_per_s"]:.0f}', f'{100 * out["mfu"]:.1f}',
                         f'{100 * out["hbm_util"]:.1f}' if "hbm_util" in out else "",
                         f'{out.get("program_gib", float("nan")):.1f}'])
    print_markdown(["section", "compile / first call (s)", "time per call (s)", "tokens/s", "MFU %", "HBM %",
                    "program GiB"], rows)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
