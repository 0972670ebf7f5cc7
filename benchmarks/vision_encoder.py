"""Qwen2.5-VL-7B's vision encoder compiled ahead of time for one image row: what the compiler
allocates (arguments, outputs: the gradients where it trains, temporaries) and its arithmetic, for the encoder alone (frozen:
forward), trained (forward and backward) and with LoRA adapters of rank 16 (the adapters'
gradient), at several image sizes, for the host's CPU or a `jaxppo plan` target (`--target h200`: compiled for an NVIDIA H200 without one; needs
`pip install 'jaxppo[plan-gpu]'`). Nothing runs and no weights are read: the parameters are
shapes. "Full-block scores" is what one full-attention block's float32 scores take
(frames x heads x frame patches^2, counted by hand; the windowed blocks' are (windows x
heads x 64^2)); TFLOP is XLA's cost analysis where the compiler gives one
(XLA:CPU does, the device-less GPU compile does not: n/a).

    python benchmarks/vision_encoder.py [--target h200] [--dtype bfloat16]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # noqa: E402

from jaxppo.models.vision import QwenVisionConfig, QwenVisionEncoder, image_input  # noqa: E402

# Qwen2.5-VL-7B-Instruct's vision_config.
QWEN25_VL_7B = QwenVisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                                patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                                fullatt_block_indexes=(7, 15, 23, 31))
SIZES = [(448, 448, 1), (896, 896, 1), (448, 448, 4), (1344, 1344, 1)]
MIB = 2 ** 20


def _row(config, height, width, images):
    grid = (1, height // config.patch_size, width // config.patch_size)
    n = grid[1] * grid[2]
    return image_input([np.zeros((n * images, config.patch_values), np.float32)], [[grid] * images], config)


# The programs: the frozen tower's forward, the trained tower's forward and backward (every
# weight's gradient), and LoRA adapters of rank 16 on its linear layers (the adapters'
# gradient alone; `AdapterConfig.train_vision_encoder` with a `lora_rank`).
PROGRAMS = ("forward", "forward + backward", "LoRA r16: forward + backward")


def compiled_row(config, dtype, height, width, images, device, program: str):
    row = _row(config, height, width, images)
    lora = (16, 2.0, True) if program.startswith("LoRA") else None
    encoder = QwenVisionEncoder(config, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype), lora=lora)
    layout = jax.tree.map(lambda a: a[0], row.layout)
    pixels = jax.ShapeDtypeStruct(row.pixels.shape[1:], jnp.dtype(dtype))
    variables = jax.eval_shape(lambda: encoder.init(jax.random.key(0), np.zeros(pixels.shape, np.float32), layout))
    sharding = jax.sharding.SingleDeviceSharding(device)
    place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)  # noqa: E731

    def forward(v, x):
        return encoder.apply(v, x, layout)

    def loss(v, x):
        return jnp.sum(forward(v, x).astype(jnp.float32))

    if program == PROGRAMS[0]:
        fn = forward
    elif lora is None:
        fn = jax.grad(loss)
    else:  # the adapters' gradient, the base held fixed
        fn = lambda v, x: jax.grad(lambda a: loss({**v, "lora": a}, x))(v["lora"])  # noqa: E731
    compiled = jax.jit(fn).lower(jax.tree.map(place, variables), place(pixels)).compile()
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    frames, width = row.layout.frame_slots.shape[1:]
    scores = frames * config.num_heads * width * width * 4
    return pixels.shape[0], memory, None if not cost else float(cost.get("flops", 0.0)), scores


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=None, help="a `jaxppo plan` target (default: this host's CPU)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    if args.target:
        from jaxppo.plan.targets import resolve_target, target_devices

        device = target_devices(resolve_target(args.target))[0]
    else:
        device = jax.devices()[0]
    print(f"Qwen2.5-VL-7B vision encoder, {args.dtype}, one row, compiled for {device.device_kind}\n")
    rows = []
    for height, width, images in SIZES:
        for program in PROGRAMS:
            patches, memory, flops, scores = compiled_row(QWEN25_VL_7B, args.dtype, height, width, images, device,
                                                          program)
            rows.append([f"{images} x {height}x{width}", program, patches,
                         patches // QWEN25_VL_7B.merge_unit, f"{memory.argument_size_in_bytes / MIB:.0f}",
                         f"{memory.output_size_in_bytes / MIB:.0f}", f"{memory.temp_size_in_bytes / MIB:.0f}",
                         f"{scores / MIB:.0f}",
                         "n/a" if flops is None else f"{flops / 1e12:.2f}"])
    tables.print_markdown(["images", "program", "patches", "image tokens", "arguments MiB", "outputs MiB",
                           "temporaries MiB",
                           "full-block scores MiB", "TFLOP"], rows, numeric_from=2)


if __name__ == "__main__":
    main()
