"""The static sampler's program compiled for an NVIDIA H200 on this CPU, without the GPU
(`jaxppo.plan`'s device-less target), with abstract weights: kernels one decode step
launches and the program's temporaries, by layer layout and weight dtype (issue 57).

    pip install 'jaxppo[plan-gpu]'
    python benchmarks/decode_programs.py                 # both layouts; writes --out (JSON)
    python benchmarks/decode_programs.py --layouts qwen2.5-0.5b
    python benchmarks/decode_programs.py --layouts qwen3-30b-a3b --weights bfloat16 --builds scanned [--experts grouped]

Cases: 64 rows, 256 prompt + 256 new tokens, bfloat16 compute; weights float32 (the
trainer's master weights, which its sampler decodes from) or bfloat16; layers scanned,
scanned and hoisted (`hoist_layers`), or unrolled. What it predicts: how many kernels a
decode step launches on the GPU as XLA compiles it without the device (no autotuning),
which bounds the step's time from below where launches dominate (each costs some
microseconds: the 2026-11-30 H200 run decoded the 0.5B layout at about 4 ms a step); what
it does not: the time itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxppo  # noqa: E402
import layouts  # noqa: E402
from jaxppo.plan import costs  # noqa: E402
from jaxppo.plan.targets import resolve_target, target_devices  # noqa: E402
from jaxppo.models.sampling import Sampling  # noqa: E402
from jaxppo.rollout.engines.static import generate_jit  # noqa: E402
from tables import print_markdown  # noqa: E402

BUILDS = {"scanned": dict(scan_layers=True), "scanned, hoisted": dict(scan_layers=True, hoist_layers=True),
          "unrolled": dict(scan_layers=False)}


def compile_case(config, device, weights: str, build: dict, rows: int, q: int, r: int) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(device)
    model = jaxppo.models.Model(config, dtype="bfloat16", param_dtype=weights, **build)
    params = jax.eval_shape(lambda key: model.init(key, seq_len=2), jax.random.key(0))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params)
    ids = jax.ShapeDtypeStruct((rows, q), jnp.int32, sharding=sharding)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=sharding)
    sampling = Sampling(response_length=r, stop_token_ids=(), pad_token_id=0, early_stop=False).check(model)
    start = time.perf_counter()
    compiled = generate_jit.lower(model, params, ids, ids, key, sampling).compile()
    memory = costs.memory_figures(compiled)
    step = costs.decode_step(compiled.as_text(), r)
    return {"kernels_per_decode_step": step.kernels, "unknown_trip_loops": step.unknown_trip_loops,
            "temporaries_gib": memory.temporaries / 2**30, "compile_s": time.perf_counter() - start}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="h200")
    p.add_argument("--layouts", default="qwen2.5-0.5b,qwen3-1.7b")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--query", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--weights", default="float32,bfloat16")
    p.add_argument("--builds", default=",".join(BUILDS))
    p.add_argument("--experts", choices=("auto", "grouped"), default="auto",
                   help="a mixture's decode step: auto (every expert at once for few tokens) or the grouped path")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.experts == "grouped":
        from jaxppo.models import moe

        moe.DENSE_TOKENS = 0
    device = target_devices(resolve_target(args.target))[0]
    results = {"target": args.target, "jax": jax.__version__, "settings": vars(args), "cases": {}}
    table = []
    for layout in args.layouts.split(","):
        config = layouts.LAYOUTS[layout]()
        for weights in args.weights.split(","):
            for build_name, build in ((b, BUILDS[b]) for b in args.builds.split(",")):
                name = f"{layout}, {weights} weights, {build_name}"
                out = compile_case(config, device, weights, build, args.rows, args.query, args.response)
                results["cases"][name] = out
                print(name, json.dumps(out), flush=True)
                kernels = ("at least " if out["unknown_trip_loops"] else "") + str(out["kernels_per_decode_step"])
                table.append([layout, weights, build_name, kernels, str(out["unknown_trip_loops"]),
                              f'{out["temporaries_gib"]:.2f}', f'{out["compile_s"]:.0f}'])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print_markdown(["layout", "weights", "layers", "kernels per decode step", "loops of unknown trips",
                    "temporaries (GiB)", "compile (s)"],
                   table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
