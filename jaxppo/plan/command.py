"""`jaxppo plan`'s own command line: its usage, and the flags that are the plan's rather than
the run's (`--target`, `--images`); the command itself is `jaxppo.cli.plan_main`."""

from __future__ import annotations

__all__ = ["PLAN_USAGE", "plan_arguments", "plan_images"]

PLAN_USAGE = """jaxppo plan --target NAME|FILE [--target ...] --model DIR [the run's flags]

Compiles the run's programs (update, scoring, sampler) for a GPU or TPU target on this
machine, with abstract parameters (only the checkpoints' config.json is read, no weight),
and prints whether each fits per device with its headroom, the iteration's lower bound, what
each program's peak holds (parameters, optimizer state, gradients, activations, logits,
gathered weights, KV cache: read from the compiled program) and, when it does not fit, the
settings that lower its largest parts. Known targets: {targets}; or a TOML/JSON
target file (platform, chips, memory_gib, peak_tflops, bandwidth_gbs, a TPU's topology).
GPU targets need `pip install 'jaxppo[plan-gpu]'`, TPU targets `pip install 'jaxppo[plan-tpu]'`.
On a target of several chips the mesh spans them all (--mesh-* axes as given, the rest on fsdp).
A vision-language policy is planned on text prompts unless --images COUNTxHEIGHTxWIDTH gives
each prompt's images (in pixels, as its image processor resizes them; --query-length must
hold their image tokens)."""


def plan_arguments(args: list) -> tuple:
    """({"target": the --target values, "images": the --images values}, the other
    arguments) of `jaxppo plan`'s command line."""
    own, rest, i = {"target": [], "images": []}, [], 0
    while i < len(args):
        name = args[i][2:].split("=", 1)[0] if args[i].startswith("--") else None
        if name in own and "=" in args[i]:
            own[name].append(args[i].split("=", 1)[1])
            i += 1
        elif name in own and i + 1 < len(args):
            own[name].append(args[i + 1])
            i += 2
        else:
            rest.append(args[i])
            i += 1
    return own, rest


def plan_images(values: list):
    """(count, height, width) of `--images COUNTxHEIGHTxWIDTH`, or None."""
    if not values:
        return None
    parts = values[-1].lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"jaxppo plan: --images {values[-1]!r} is invalid: give COUNTxHEIGHTxWIDTH, the images per "
                         "prompt and their size in pixels as the image processor resizes them (e.g. 1x448x448)")
    return tuple(int(p) for p in parts)
