"""Benchmark: `jaxppo plan` for the runs users ask about. Each row's programs (the update,
the forward pass, the sampler) compiled on this CPU for a GPU or TPU target without the
hardware (`jaxppo.plan`), with abstract parameters: memory per device (the program's peak
plus the run's other state resident meanwhile), what the largest part of each peak is (the
plan's breakdown, read from the compiled program), the iteration's lower bound, kernels per
decode step.

    pip install 'jaxppo[plan-gpu,plan-tpu]'
    python benchmarks/plan_targets.py                          # every row (about 40 min on 2 cores)
    python benchmarks/plan_targets.py --only llama3.1-8b       # rows whose name contains the text
    python benchmarks/plan_targets.py --programs update        # the update alone (its before/after)
    python benchmarks/plan_targets.py --json out.json          # and the raw rows
    python benchmarks/plan_targets.py --timeout 600            # seconds a row may take (default 900)

Layouts (config.json only, written to a temporary directory from transformers' config
classes): Qwen2.5-0.5B, Qwen3-1.7B, Llama-3.1-8B, Qwen3-30B-A3B, Llama-3.1-70B, and
Qwen2.5-VL-7B and Qwen3-VL-8B with one 448 x 448 image per prompt (256 and 196 of their 512
prompt tokens), Gemma-3-4B with one 896 x 896 image (256 tokens); the vision encoder frozen,
as by default (`jaxppo plan --images 1x448x448`). Runs: PPO
with a critic and a reward model of the same layout (full fine-tuning), GRPO (G = 8) full
and with LoRA rank 16 on every linear layer; batch 64, 512 prompt + 512 response tokens,
mini-batch 16, 1 epoch, bf16 compute (float32 master weights where the weights train),
remat, the LM head 128 positions at a time, scanned layers. On targets of several chips
every chip is on the fsdp axis (for a mixture of experts also its expert-parallel axis).

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
from jaxppo.run.parts import Inputs  # noqa: E402

from tables import print_markdown  # noqa: E402


def _layouts(root: str) -> dict:
    """{name: (policy directory, reward-model directory)} holding config.json alone."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    llama3 = dict(vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False, rope_theta=500000.0,
                  rms_norm_eps=1e-5, num_key_value_heads=8)
    configs = {
        "qwen2.5-0.5b": (Qwen2Config, dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                            num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                            max_position_embeddings=32768, tie_word_embeddings=True,
                                            rope_theta=1000000.0, rms_norm_eps=1e-6), "Qwen2"),
        "qwen3-1.7b": (Qwen3Config, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                                          rope_theta=1000000.0, rms_norm_eps=1e-6), "Qwen3"),
        "llama3.1-8b": (LlamaConfig, dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           num_attention_heads=32, **llama3), "Llama"),
        "qwen3-30b-a3b": (Qwen3MoeConfig, dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                                moe_intermediate_size=768, num_hidden_layers=48,
                                                num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                                max_position_embeddings=40960, rope_theta=1000000.0,
                                                rms_norm_eps=1e-6, tie_word_embeddings=False), "Qwen3Moe"),
        "llama3.1-70b": (LlamaConfig, dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                            num_attention_heads=64, **llama3), "Llama"),
    }
    out = {}
    vl = os.path.join(root, "qwen2.5-vl-7b")  # a vision-language model: no sequence-classification sibling
    _qwen25_vl_7b().save_pretrained(vl)
    out["qwen2.5-vl-7b"] = (vl, None)
    vl3 = os.path.join(root, "qwen3-vl-8b")
    _qwen3_vl_8b().save_pretrained(vl3)
    out["qwen3-vl-8b"] = (vl3, None)
    gemma = os.path.join(root, "gemma-3-4b")
    _gemma3_4b().save_pretrained(gemma)
    out["gemma-3-4b"] = (gemma, None)
    for name, (cls, kw, arch) in configs.items():
        dirs = []
        for suffix in ("ForCausalLM", "ForSequenceClassification"):
            d = os.path.join(root, f"{name}-{suffix}")
            cls(**kw, architectures=[arch + suffix], num_labels=1, eos_token_id=2).save_pretrained(d)
            dirs.append(d)
        out[name] = tuple(dirs)
    return out


def _qwen25_vl_7b():
    """Qwen2.5-VL-7B-Instruct's config."""
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
                eos_token_id=151645, rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                                      "rope_theta": 1000000.0})
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                  patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                  fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, tie_word_embeddings=False,
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


def _qwen3_vl_8b():
    """Qwen3-VL-8B-Instruct's config."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                rms_norm_eps=1e-6, eos_token_id=151645,
                rope_parameters={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True,
                                 "rope_theta": 5000000.0})
    vision = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                  patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24], hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=151655, tie_word_embeddings=False,
                         architectures=["Qwen3VLForConditionalGeneration"])


def _gemma3_4b():
    """Gemma-3-4b-it's config (the language model and its SigLIP tower)."""
    from transformers import Gemma3Config

    text = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                sliding_window=1024, query_pre_attn_scalar=256, eos_token_id=[1, 106],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                  image_size=896, patch_size=14, vision_use_head=False)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256, image_token_index=262144,
                        boi_token_index=255999, eoi_token_index=256000, architectures=["Gemma3ForConditionalGeneration"])


LAYOUT_NAMES = ("qwen2.5-0.5b", "qwen3-1.7b", "llama3.1-8b", "qwen3-30b-a3b", "llama3.1-70b",
                "qwen2.5-vl-7b", "qwen3-vl-8b", "gemma-3-4b")  # `_layouts`' keys
IMAGES = {"qwen2.5-vl-7b": (1, 448, 448), "qwen3-vl-8b": (1, 448, 448), "gemma-3-4b": (1, 896, 896)}  # a vision-language layout's images per prompt
RUNS = {  # name: (algorithm, reward model, LoRA rank)
    "ppo full": ("ppo", True, 0),
    "grpo full": ("grpo", False, 0),
    "grpo lora16": ("grpo", False, 16),
}
# The rows: {layout: ((run, (targets)), ...)}.
ROWS = {
    "qwen2.5-0.5b": (("grpo full", ("h200",)), ("ppo full", ("h200",))),
    "qwen3-1.7b": (("grpo full", ("h100", "h200", "v5e-16")), ("ppo full", ("h200",))),
    "llama3.1-8b": (("grpo full", ("h100x8", "h200x8", "v5p-8")), ("ppo full", ("h200x8",)),
                    ("grpo lora16", ("h200",))),
    "qwen3-30b-a3b": (("grpo full", ("h100x8", "h200x8", "v5p-16")), ("grpo lora16", ("h200x8",))),
    "llama3.1-70b": (("grpo lora16", ("h200x8",)),),
    "qwen2.5-vl-7b": (("grpo full", ("h200x8", "v5p-8")), ("grpo lora16", ("h200",))),
    "qwen3-vl-8b": (("grpo full", ("h200x8", "v5p-8")), ("grpo lora16", ("h200",))),
    "gemma-3-4b": (("grpo full", ("h200x8", "v5p-8")), ("grpo lora16", ("h200",))),
}
PROGRAMS = ("update", "score", "generate")


def _rows(layouts):
    for layout in layouts:
        for run, targets in ROWS[layout]:
            for target in targets:
                yield f"{layout} {run} {target}", layout, run, target


def _plan(layouts: dict, layout: str, run: str, target: str, programs=PROGRAMS):
    algorithm, reward, rank = RUNS[run]
    settings = dict(batch_size=64, mini_batch_size=16, ppo_epochs=1, query_length=512, response_length=512,
                    dtype="bfloat16", remat=True, logits_chunk_size=128, scan_layers=True)
    if algorithm == "grpo":
        settings["num_generations"] = 8
    if rank:
        settings.update(lora_rank=rank, lora_alpha=2.0 * rank, lora_targets=("all-linear",))
    config = jaxppo.Config.for_algorithm(algorithm, **settings)
    policy, reward_dir = layouts[layout]
    inputs = Inputs(policy=policy, tokenizer=None, prompts=None, reward_model=reward_dir if reward else None)
    return plan_run(config, inputs, resolve_target(target), programs=programs, images=IMAGES.get(layout))


def _raw(name: str, plan) -> dict:
    p = {x.name: x for x in plan.programs}

    def breakdown(v):
        b = getattr(v, "breakdown", None)  # (a plan of code without the breakdown: None)
        return None if b is None else {"arguments": dict(b.arguments), "temporaries": dict(b.temporaries),
                                       "arena": b.arena}

    return {"row": name, "fits": plan.fits, "usable_bytes": plan.target.usable_bytes, "mesh": plan.mesh_axes,
            "floor_s": plan.lower_bound_s, "advice": [] if plan.fits else plan.advice(),
            "programs": {k: {"compile_s": v.compile_s, "refused": v.refused,
                             **(dataclasses.asdict(v.memory) if v.memory is not None else {}),
                             "peak": v.memory.peak if v.memory is not None else None,
                             "resident_besides": v.resident_besides, "total": v.total if v.memory else None,
                             "flops": v.work.flops, "bytes_per_chip": v.work.bytes_per_chip,
                             "floor_s": v.lower_bound_s, "decode_kernels": v.decode_kernels,
                             "decode_gathered_bytes": getattr(v, "decode_gathered", None),
                             "decode_unknown_loops": getattr(v, "decode_unknown_loops", None),
                             "breakdown": breakdown(v)}
                         for k, v in p.items()}}


def _largest(program: dict) -> str:
    """The largest part of a program's peak (the plan's breakdown), with its GiB."""
    b = program.get("breakdown")
    if not b:
        return ""
    part, size = max({**b["arguments"], **b["temporaries"]}.items(), key=lambda kv: kv[1])
    return f"{part} {size / GIB:.1f}"


def _cells(row: dict) -> list:
    layout, rest = row["row"].split(" ", 1)
    run, target = rest.rsplit(" ", 1)
    p = row.get("programs", {})
    if "failed" in row or not p:
        return [layout, run, target, row.get("failed", "")] + [""] * 8
    gib = lambda k: (f"{p[k]['total'] / GIB:.2f}" if p[k]["total"] is not None else "refused") if k in p else ""
    update = p.get("update", {})
    temporaries = f"{update['temporaries'] / GIB:.2f}" if update.get("temporaries") is not None else ""
    return [layout, run, target, "yes" if row["fits"] else "no", gib("update"), temporaries,
            _largest(update) if update else "", gib("score"), gib("generate"), f"{row['usable_bytes'] / GIB:.1f}",
            f"{row['floor_s']:.3f}", p["generate"]["decode_kernels"] if "generate" in p else ""]


HEADERS = ["layout", "run", "target", "fits", "update GiB/device", "update temporaries GiB",
           "update's largest part (GiB)", "score GiB/device", "sampler GiB/device", "usable GiB",
           "iteration floor (s)", "kernels per decode step"]


def _one_row(name: str, out: str, programs):
    """Plan row `name` (in a process of its own) and write its raw figures to `out`."""
    with tempfile.TemporaryDirectory() as root:
        layouts = _layouts(root)
        for row, layout, run, target in _rows(layouts):
            if row == name:
                return write_planned(name, out, lambda: _plan(layouts, layout, run, target, programs))
    raise SystemExit(f"no row named {name!r}")


def write_planned(name: str, out: str, plan):
    """Row `name`'s raw figures from `plan()` (its `Plan`), or why it failed, written to
    `out` as JSON."""
    try:
        raw = _raw(name, plan())
    except Exception as err:  # report the row and go on
        raw = {"row": name, "failed": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    with open(out, "w") as f:
        json.dump(raw, f)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name contains any of these")
    parser.add_argument("--programs", nargs="*", default=list(PROGRAMS), choices=PROGRAMS,
                        help="the programs to plan (default all three)")
    parser.add_argument("--json", default=None, help="write the raw rows to this file")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a row may take (its own process)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # the child process: one row
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    programs = tuple(args.programs)
    if args.row is not None:
        return _one_row(args.row, args.out, programs)
    names = [name for name, *_ in _rows(LAYOUT_NAMES)]
    raw = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            if args.only is not None and not any(s in name for s in args.only):
                continue
            out = os.path.join(scratch, "row.json")
            try:
                subprocess.run([sys.executable, __file__, "--row", name, "--out", out, "--programs", *programs],
                               timeout=args.timeout, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                with open(out) as f:
                    raw.append(json.load(f))
            except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
                raw.append({"row": name, "failed": f"{type(err).__name__}"})
            print(" | ".join(str(c) for c in _cells(raw[-1])), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(raw, f, indent=1)
    print()
    print_markdown(HEADERS, [_cells(r) for r in raw], numeric_from=4)


if __name__ == "__main__":
    main()
