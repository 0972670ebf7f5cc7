"""Benchmark: `jaxppo plan` at real sizes. Each row's programs (the update, the scoring pass,
the sampler) compiled on this CPU for a GPU or TPU target without the hardware
(`jaxppo.plan`), with abstract parameters: memory per device (the program's peak plus the
run's other state resident meanwhile), the iteration's lower bound, kernels per decode step.

    pip install 'jaxppo[plan-gpu,plan-tpu]'
    python benchmarks/plan_targets.py                      # every row (about 20 min on 2 cores)
    python benchmarks/plan_targets.py --only qwen2.5-0.5b  # rows whose name contains the text
    python benchmarks/plan_targets.py --json out.json      # and the raw rows
    python benchmarks/plan_targets.py --timeout 600        # seconds a row may take (default 900)

Layouts (config.json only, written to a temporary directory from transformers' config
classes): Qwen2.5-0.5B, Qwen3-1.7B, Llama-3.1-8B. Runs: PPO with a critic and a reward
model of the same layout (full fine-tuning), GRPO (G = 8) full and with LoRA rank 16 on
every linear layer; batch 64, 256 prompt + 256 response tokens, mini-batch 16, 1 epoch,
bf16 compute (float32 master weights where the weights train), remat, the LM head 128
positions at a time, scanned layers. On targets of several chips every chip is on the fsdp
axis.

What it predicts: what the target's compiler allocates per device for these programs, as
of a compile without the device (no autotuning: kernel choices and temporaries can differ
on the device), and a floor on the iteration's time (FLOPs at the chip's peak, bytes at its
bandwidth). What it does not: the time itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxppo  # noqa: E402
from jaxppo.plan import plan_run, resolve_target  # noqa: E402
from jaxppo.plan.targets import GIB  # noqa: E402
from jaxppo.models.lora import LoraConfig  # noqa: E402
from jaxppo.run.parts import Inputs  # noqa: E402

from tables import print_markdown  # noqa: E402


def _layouts(root: str) -> dict:
    """{name: (policy directory, reward-model directory)} holding config.json alone."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    configs = {
        "qwen2.5-0.5b": (Qwen2Config, dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                            max_position_embeddings=32768, tie_word_embeddings=True,
                                            rope_theta=1000000.0, rms_norm_eps=1e-6), "Qwen2"),
        "qwen3-1.7b": (Qwen3Config, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                                          rope_theta=1000000.0, rms_norm_eps=1e-6), "Qwen3"),
        "llama3.1-8b": (LlamaConfig, dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           max_position_embeddings=131072, tie_word_embeddings=False,
                                           rope_theta=500000.0, rms_norm_eps=1e-5), "Llama"),
    }
    out = {}
    for name, (cls, kw, arch) in configs.items():
        dirs = []
        for suffix in ("ForCausalLM", "ForSequenceClassification"):
            d = os.path.join(root, f"{name}-{suffix}")
            cls(**kw, architectures=[arch + suffix], num_labels=1, eos_token_id=2).save_pretrained(d)
            dirs.append(d)
        out[name] = tuple(dirs)
    return out


LAYOUT_NAMES = ("qwen2.5-0.5b", "qwen3-1.7b", "llama3.1-8b")  # the keys of `_layouts`
RUNS = {  # name: (algorithm, reward model, LoRA rank)
    "ppo full": ("ppo", True, 0),
    "grpo full": ("grpo", False, 0),
    "grpo lora16": ("grpo", False, 16),
}
TARGET_NAMES = ("h200", "h200x8", "v5e-8", "v5p-8")


def _rows(layouts: dict):
    for layout in layouts:
        for run in RUNS:
            for target in TARGET_NAMES:
                yield f"{layout} {run} {target}", layout, run, target


def _plan(layouts: dict, layout: str, run: str, target: str):
    algorithm, reward, rank = RUNS[run]
    settings = dict(batch_size=64, mini_batch_size=16, ppo_epochs=1, query_length=256, response_length=256,
                    dtype="bfloat16", remat=True, logits_chunk_size=128, scan_layers=True)
    if algorithm == "grpo":
        settings["num_generations"] = 8
    config = jaxppo.Config.for_algorithm(algorithm, **settings)
    policy, reward_dir = layouts[layout]
    lora = LoraConfig(rank=rank, alpha=2.0 * rank, targets=("all-linear",)) if rank else None
    inputs = Inputs(policy=policy, tokenizer=None, prompts=None, reward_model=reward_dir if reward else None,
                    lora=lora)
    return plan_run(config, inputs, resolve_target(target))


def _raw(name: str, plan) -> dict:
    p = {x.name: x for x in plan.programs}
    return {"row": name, "fits": plan.fits, "usable_bytes": plan.target.usable_bytes, "mesh": plan.mesh_axes,
            "floor_s": plan.lower_bound_s,
            "programs": {k: {"compile_s": v.compile_s, "refused": v.refused,
                             **(dataclasses.asdict(v.memory) if v.memory is not None else {}),
                             "peak": v.memory.peak if v.memory is not None else None,
                             "resident_besides": v.resident_besides, "total": v.total if v.memory else None,
                             "flops": v.work.flops, "bytes_per_chip": v.work.bytes_per_chip,
                             "floor_s": v.lower_bound_s, "decode_kernels": v.decode_kernels}
                         for k, v in p.items()}}


def _cells(row: dict) -> list:
    layout, rest = row["row"].split(" ", 1)
    run, target = rest.rsplit(" ", 1)
    if "failed" in row:
        return [layout, run, target, row["failed"]] + [""] * 6
    p = row["programs"]
    cells = [f"{p[k]['total'] / GIB:.2f}" if p[k]["total"] is not None else "refused"
             for k in ("update", "score", "generate")]
    return [layout, run, target, "yes" if row["fits"] else "no", *cells, f"{row['usable_bytes'] / GIB:.1f}",
            f"{row['floor_s']:.3f}", p["generate"]["decode_kernels"]]


def _one_row(name: str, out: str):
    """Plan row `name` (in a process of its own) and write its raw figures to `out`."""
    with tempfile.TemporaryDirectory() as root:
        layouts = _layouts(root)
        for row, layout, run, target in _rows(layouts):
            if row == name:
                try:
                    raw = _raw(name, _plan(layouts, layout, run, target))
                except Exception as err:  # report the row and go on
                    raw = {"row": name, "failed": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:160]}"}
                with open(out, "w") as f:
                    json.dump(raw, f)
                return
    raise SystemExit(f"no row named {name!r}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name contains any of these")
    parser.add_argument("--json", default=None, help="write the raw rows to this file")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a row may take (its own process)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # the child process: one row
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        return _one_row(args.row, args.out)
    names = [name for name, *_ in _rows(LAYOUT_NAMES)]
    raw = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            if args.only is not None and not any(s in name for s in args.only):
                continue
            out = os.path.join(scratch, "row.json")
            try:
                subprocess.run([sys.executable, __file__, "--row", name, "--out", out], timeout=args.timeout,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(out) as f:
                    raw.append(json.load(f))
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
                raw.append({"row": name, "failed": f"{type(err).__name__}"})
            print(" | ".join(str(c) for c in _cells(raw[-1])), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(raw, f, indent=1)
    print()
    print_markdown(["layout", "run", "target", "fits", "update GiB/device", "score GiB/device", "sampler GiB/device",
                    "usable GiB", "iteration floor (s)", "kernels per decode step"], [_cells(r) for r in raw],
                   numeric_from=4)


if __name__ == "__main__":
    main()
