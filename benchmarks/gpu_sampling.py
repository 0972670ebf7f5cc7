"""Decoding on one accelerator: the built-in samplers' step time against the memory-bandwidth
floor, and transformers' `generate` on the same GPU from the same weights (issue 57).

    python benchmarks/gpu_sampling.py --out $OUT/sampling.json             # jaxppo's sweep
    python benchmarks/gpu_sampling.py --side torch --out $OUT/torch.json   # transformers' generate
    python benchmarks/gpu_sampling.py --tiny [--side torch]                # 2-layer smoke run (CPU)

jaxppo's sweep runs each XLA flag set (`FLAG_SETS`: XLA's defaults, command buffers off,
loops and conditionals as command buffers too) in a process of its own (XLA reads its
flags once per process); in each, the cases of `CASES` (the defaults' process all of them,
the others the first --flag-cases), each a sampler (static, continuous with a slot per row),
a layout (Qwen2.5-0.5B, Qwen3-1.7B), rows (64, 256), top-p (off, 0.9) and the model's build
(scanned or unrolled layers, hoisted layer weights, the prefill's attention kernel). The
KV cache is the compute dtype's (bfloat16) in one layout, (batch, slots, kv heads, head
size) per layer: no switch exists for it yet.

Per case: random weights, float32 with bfloat16 compute as the trainer's sampler decodes
its master weights (or bfloat16 weights: `params`), --query-token prompts, --response new tokens at
temperature 1 with no stop token (every row decodes every step). Timed after a warm-up
call: the whole `generate` (R steps) and the prefill with one step (R = 1), whose
difference over R - 1 is the time per decode step; compile time of both. The floor of a
decode step is the bytes it must read (every weight once in bfloat16, the LM head
included, plus the KV cache of the slots attended so far; `layouts.decode_bytes`) over
--peak-tbps: `floor_ratio` = step time / floor. The torch side: transformers'
`generate` (its own model class for the layout, random bfloat16 weights) (sampling, top_k 0 so that nothing is filtered, min_new_tokens = R) with its
dynamic cache, then with its static cache (which transformers compiles with
`torch.compile` where it can), timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import layouts  # noqa: E402

FLAG_SETS = {
    "xla defaults": "",
    "command buffers off": "--xla_gpu_enable_command_buffer=",
    "loops as command buffers": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,"
                                "CONDITIONAL,WHILE --xla_gpu_graph_min_graph_size=1",
}
_DEFAULT = dict(sampler="static", layout="qwen2.5-0.5b", rows=64, top_p=None, scan=True, hoist=False,
                attention="einsum", params="float32")
CASES = [dict(_DEFAULT, **change) for change in (
    {}, dict(params="bfloat16"), dict(hoist=True), dict(scan=False), dict(sampler="continuous"), dict(top_p=0.9),
    dict(rows=256),
    dict(layout="qwen3-1.7b"), dict(layout="qwen3-1.7b", rows=256), dict(layout="qwen3-1.7b", hoist=True),
    dict(attention="xla"), dict(attention="cudnn"), dict(sampler="continuous", rows=256))]


def case_name(case: dict) -> str:
    parts = [case["sampler"], case["layout"], f'{case["rows"]} rows']
    parts += [f'top-p {case["top_p"]}'] if case["top_p"] else []
    parts += ["unrolled"] if not case["scan"] else []
    parts += ["hoisted"] if case["hoist"] else []
    parts += [f'{case["attention"]} prefill'] if case["attention"] != "einsum" else []
    parts += [f'{case["params"]} weights'] if case["params"] != "float32" else []
    return ", ".join(parts)


def layout_config(name: str, tiny: bool):
    config = layouts.LAYOUTS[name](layers=2) if tiny else layouts.LAYOUTS[name]()
    return type(config)(**{**config.__dict__, "vocab_size": 1024}) if tiny else config


def floor(config, rows: int, q: int, r: int, peak_tbps: float) -> float:
    """Seconds per decode step the HBM bandwidth allows at least (mean over the R steps)."""
    return layouts.decode_bytes(config, rows, q, r, 2, 2) / r / (peak_tbps * 1e12)


def _timed(fn, repeats: int) -> float:
    import jax

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def jax_case(case: dict, args) -> dict:
    import jax
    import jax.numpy as jnp

    import jaxppo
    from jaxppo.rollout.engines.continuous import continuous_jit
    from jaxppo.models.sampling import Sampling
    from jaxppo.rollout.engines.static import generate_jit

    if case["attention"] == "cudnn" and jax.default_backend() != "gpu":
        return {"skipped": "cuDNN attention needs an NVIDIA GPU"}
    config = layout_config(case["layout"], args.tiny)
    model = jaxppo.models.Model(config, dtype="bfloat16", param_dtype=case["params"], scan_layers=case["scan"],
                                hoist_layers=case["hoist"], attention=case["attention"])
    params = jax.jit(lambda key: model.init(key, seq_len=2))(jax.random.key(0))
    rows, q, r = case["rows"], args.query, args.response
    ids = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (rows, q)), jnp.int32)
    mask = jnp.ones_like(ids)
    sampling = {length: Sampling(response_length=length, top_p=case["top_p"], stop_token_ids=(), pad_token_id=0,
                                 early_stop=False).check(model) for length in (r, 1)}
    programs, compile_s = {}, 0.0
    for length in (r, 1):
        start = time.perf_counter()
        if case["sampler"] == "static":
            lowered = generate_jit.lower(model, params, ids, mask, jax.random.key(1), sampling[length])
        else:
            lowered = continuous_jit.lower(model, params, ids, mask, jax.random.key(1), sampling[length],
                                           num_slots=rows)
        programs[length] = lowered.compile()
        compile_s += time.perf_counter() - start
    whole = _timed(lambda: programs[r](params, ids, mask, jax.random.key(2), sampling[r]).tokens, args.repeats)
    prefill = _timed(lambda: programs[1](params, ids, mask, jax.random.key(2), sampling[1]).tokens, args.repeats)
    return _result(config, rows, q, r, whole, prefill, compile_s, args.peak_tbps)


def _result(config, rows, q, r, whole, prefill, compile_s, peak_tbps) -> dict:
    step = (whole - prefill) / max(r - 1, 1)
    least = floor(config, rows, q, r, peak_tbps)
    return {"compile_s": compile_s, "generate_s": whole, "prefill_and_one_step_s": prefill, "step_ms": 1e3 * step,
            "tokens_per_s": rows * r / whole, "decode_tokens_per_s": rows / step if step > 0 else float("nan"),
            "floor_step_ms": 1e3 * least, "floor_ratio": step / least}


def torch_case(layout: str, rows: int, cache: str, args) -> dict:
    """transformers' `generate` at the layout: its own model class from the layout's
    Hugging Face config, random bfloat16 weights made on the device."""
    import torch
    import transformers

    from jaxppo.models.family import family_of

    config = layout_config(layout, args.tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config.to_hf(family_of(config).architecture(config.model_type, "causal_lm")), dtype=torch.bfloat16)
    model.eval()
    q, r = args.query, args.response
    ids = torch.as_tensor(np.random.default_rng(0).integers(3, config.vocab_size, (rows, q)), device=device)
    mask = torch.ones_like(ids)

    def run(length):
        def call():
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=length, min_new_tokens=length, pad_token_id=0,
                                     eos_token_id=None, cache_implementation=cache)
            if device == "cuda":
                torch.cuda.synchronize()
            return out
        return call

    start = time.perf_counter()
    run(r)()  # the first call (compiles with the static cache)
    first_s = time.perf_counter() - start
    whole = _torch_timed(run(r), args.repeats)
    prefill = _torch_timed(run(1), args.repeats)
    out = _result(config, rows, q, r, whole, prefill, first_s, args.peak_tbps)
    out["first_call_s"] = out.pop("compile_s")
    return out


def _torch_timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def worker(args) -> dict:
    """This process's cases (its XLA flags set by the parent), within --budget-s."""
    import jax

    t0, results = time.perf_counter(), {}
    cases = [c for c in CASES if args.cases is None or any(w in case_name(c) for w in args.cases.split(","))]
    cases = cases if args.flag_set == "xla defaults" else cases[:args.flag_cases]
    for case in cases:
        name = case_name(case)
        if time.perf_counter() - t0 > args.budget_s:
            results[name] = {"skipped": "time budget"}
            continue
        try:
            results[name] = jax_case(case, args)
        except Exception as err:  # recorded; the other cases still run
            traceback.print_exc()
            results[name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        print(name, json.dumps(results[name]), flush=True)
    return {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "cases": results}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("jaxppo", "torch"), default="jaxppo")
    p.add_argument("--tiny", action="store_true", help="2 layers, vocab 1024, a quarter of the rows, 8 new tokens "
                   "after 16 (CPU)")
    p.add_argument("--query", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peak-tbps", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8; H100 SXM: 3.35)")
    p.add_argument("--flag-sets", default=",".join(FLAG_SETS))
    p.add_argument("--flag-cases", type=int, default=3, help="cases run under the flag sets other than XLA's defaults")
    p.add_argument("--budget-s", type=float, default=200.0, help="per flag set (jaxppo) or in all (torch)")
    p.add_argument("--cases", default=None, help="comma-separated substrings: only the cases whose names hold one")
    p.add_argument("--out", default=None)
    p.add_argument("--flag-set", default=None, help=argparse.SUPPRESS)  # a worker process's
    args = p.parse_args(argv)
    if args.side == "torch":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jaxppo's model config only; the GPU is torch's
    if args.tiny:
        args.query, args.response, args.repeats = 16, 8, 1
        for case in CASES:
            case["rows"] //= 4  # 16 and 64
    if args.flag_set is not None:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return 0
    results = {"side": args.side, "settings": {k: v for k, v in vars(args).items() if k != "flag_set"}, "runs": {}}
    if args.side == "torch":
        results["runs"]["transformers"] = _torch_runs(args)
    else:
        for flag_set in args.flag_sets.split(","):
            results["runs"][flag_set] = _flag_set_run(flag_set, argv)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    _table(results)
    return 0


def _flag_set_run(flag_set: str, argv) -> dict:
    """One worker process under `flag_set`'s XLA flags: its result, or why it has none."""
    env = dict(os.environ, XLA_FLAGS=f'{os.environ.get("XLA_FLAGS", "")} {FLAG_SETS[flag_set]}'.strip())
    command = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]),
               "--flag-set", flag_set]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    print(done.stdout[-3000:], done.stderr[-1500:] if done.returncode else "", flush=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"xla_flags": FLAG_SETS[flag_set], "error": f"exit {done.returncode}: {done.stderr[-600:]}"}
    return {"xla_flags": FLAG_SETS[flag_set], **json.loads(lines[-1][len("RESULT "):])}


def _torch_runs(args) -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "cases": {}}
    t0 = time.perf_counter()
    for layout, rows in (("qwen2.5-0.5b", 64), ("qwen2.5-0.5b", 256), ("qwen3-1.7b", 64)):
        rows = rows // 4 if args.tiny else rows
        for cache in ("dynamic", "static"):
            name = f"generate, {layout}, {rows} rows, {cache} cache"
            if time.perf_counter() - t0 > args.budget_s:
                out["cases"][name] = {"skipped": "time budget"}
                continue
            try:
                out["cases"][name] = torch_case(layout, rows, cache, args)
            except Exception as err:  # recorded; the other cases still run
                traceback.print_exc()
                out["cases"][name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            print(name, json.dumps(out["cases"][name]), flush=True)
    return out


def _table(results: dict) -> None:
    from tables import print_markdown

    rows = []
    for run, out in results["runs"].items():
        for name, r in out.get("cases", {"(no result)": out}).items():
            if "step_ms" in r:
                rows.append([run, name, f'{r.get("compile_s", r.get("first_call_s")):.1f}', f'{r["step_ms"]:.2f}',
                             f'{r["floor_step_ms"]:.3f}', f'{r["floor_ratio"]:.1f}', f'{r["tokens_per_s"]:.0f}'])
            else:
                rows.append([run, name, str(r)[:70], "", "", "", ""])
    print_markdown(["run", "case", "compile / first call (s)", "ms per decode step", "floor (ms)",
                    "x floor", "tokens/s (whole generate)"], rows)


if __name__ == "__main__":
    sys.exit(main())
