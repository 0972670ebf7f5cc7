"""Benchmark: `jaxppo plan` for reasoning-length rows, with and without the context axis.
The update program of GRPO (full fine-tuning) on 8B layouts with 16k- and 32k-token
responses, compiled on this CPU for 8 x H200 and a v5p-16 slice (8 chips) without the
hardware, with abstract parameters: memory per device (the program's peak plus the frozen
state resident meanwhile), its largest part, the update's floor.

    pip install 'jaxppo[plan-gpu,plan-tpu]'
    python benchmarks/plan_long_rows.py                        # every row
    python benchmarks/plan_long_rows.py --only 32768 --json out.json
    python benchmarks/plan_long_rows.py --timeout 900          # seconds a row may take

Runs: batch 8 rows (one group of G = 8) of 512 prompt + R response tokens, one mini-batch
of 8, one epoch, bf16 compute with float32 master weights and Adam, remat, the LM head 128
positions at a time, scanned layers. Layouts: every chip on fsdp, one row per chip per
micro-batch (the most a row-per-device layout can split); or fsdp x context 1 x 8, each
row's positions over the 8 chips, one row per micro-batch (gradient accumulation 8), with
ring or Ulysses attention; or fsdp 2 x context 4, two rows per micro-batch. Attention:
jaxppo's einsum kernel. (cuDNN's flash kernel is not planned: a plan refuses
`--attention cudnn` on a machine without an NVIDIA GPU.)

What it predicts: what the target's compiler allocates per device for the update as of a
compile without the device (no autotuning); the floor is FLOPs at the chip's peak. What it
does not: the time, or the sampler (the built-in sampler does not split rows' positions:
long answers are vLLM's job, or a sampler on devices of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxppo  # noqa: E402
from jaxppo.plan import plan_run, resolve_target  # noqa: E402
from jaxppo.plan.targets import GIB  # noqa: E402
from jaxppo.run.parts import Inputs  # noqa: E402

from plan_targets import _largest, write_planned  # noqa: E402
from tables import print_markdown  # noqa: E402

LAYOUTS = ("llama3.1-8b", "qwen3-8b")
# name: (mesh axes, gradient accumulation, attention, context attention)
SPLITS = {
    "fsdp 8": (dict(mesh_fsdp=8, mesh_context=1), 1, "einsum", None),
    "context 8, ring": (dict(mesh_fsdp=1, mesh_context=8), 8, "einsum", "ring"),
    "fsdp 2 x context 4, ring": (dict(mesh_fsdp=2, mesh_context=4), 4, "einsum", "ring"),
    "context 8, ulysses": (dict(mesh_fsdp=1, mesh_context=8), 8, "einsum", "ulysses"),
}
ROWS = [(layout, response, split, target)
        for layout in LAYOUTS for response in (16384, 32768)
        for target in ("h200x8", "v5p-16")
        for split in SPLITS
        if split in ("fsdp 8", "context 8, ring") or (response == 32768 and target == "h200x8")]


def _layout(root: str, name: str) -> str:
    """A directory holding `name`'s config.json alone."""
    from transformers import LlamaConfig, Qwen3Config

    path = os.path.join(root, name)
    if name == "llama3.1-8b":
        LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5, eos_token_id=2,
                    architectures=["LlamaForCausalLM"]).save_pretrained(path)
    else:
        Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                    tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6, eos_token_id=2,
                    architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return path


def _name(layout, response, split, target) -> str:
    return f"{layout} | {response} | {split} | {target}"


def _plan(root: str, layout: str, response: int, split: str, target: str):
    axes, accumulation, attention, context = SPLITS[split]
    settings = dict(batch_size=8, mini_batch_size=8, gradient_accumulation_steps=accumulation, ppo_epochs=1,
                    num_generations=8, query_length=512, response_length=response, dtype="bfloat16", remat=True,
                    logits_chunk_size=128, scan_layers=True, attention=attention, context_attention=context, **axes)
    config = jaxppo.Config.for_algorithm("grpo", **settings)
    inputs = Inputs(policy=_layout(root, layout), tokenizer=None, prompts=None)
    return plan_run(config, inputs, resolve_target(target), programs=("update",))


def _one_row(name: str, out: str):
    for row in ROWS:
        if _name(*row) == name:
            with tempfile.TemporaryDirectory() as root:
                return write_planned(name, out, lambda: _plan(root, *row))
    raise SystemExit(f"no row named {name!r}")


def _cells(raw: dict) -> list:
    layout, response, split, target = raw["row"].split(" | ")
    update = raw.get("programs", {}).get("update")
    if "failed" in raw or update is None:
        return [layout, response, target, split, raw.get("failed", "")] + [""] * 5
    total = f"{update['total'] / GIB:.2f}" if update["total"] is not None else "refused"
    temporaries = f"{update['temporaries'] / GIB:.2f}" if update.get("temporaries") is not None else ""
    return [layout, response, target, split, "yes" if raw["fits"] else "no", total, temporaries, _largest(update),
            f"{raw['usable_bytes'] / GIB:.1f}", f"{update['floor_s']:.2f}"]


HEADERS = ["layout", "response tokens", "target", "split", "fits", "update GiB/device", "temporaries GiB",
           "largest part (GiB)", "usable GiB", "update floor (s)"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name contains all of these")
    parser.add_argument("--json", default=None, help="write the raw rows to this file")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a row may take (its own process)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # one row, in a process of its own
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        return _one_row(args.row, args.out)
    raws = []
    for row in ROWS:
        name = _name(*row)
        if args.only and not all(text in name for text in args.only):
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            try:
                subprocess.run([sys.executable, __file__, "--row", name, "--out", out.name], check=True,
                               timeout=args.timeout)
                with open(out.name) as f:
                    raws.append(json.load(f))
            except subprocess.TimeoutExpired:
                raws.append({"row": name, "failed": f"over {args.timeout:.0f} s"})
            except subprocess.CalledProcessError as err:
                raws.append({"row": name, "failed": f"exit {err.returncode}"})
        print(f"  planned {name}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raws, f, indent=1)
    print_markdown(HEADERS, [_cells(raw) for raw in raws])


if __name__ == "__main__":
    main()
