"""The vision demo's learning curve (`jaxppo --demo vision`): the same GRPO run with the
pictures and with them blanked (grey), the score per window of iterations and the time,
and the share of an iteration that the vision encoder takes.

    python benchmarks/vision_demo.py [--iterations 80] [--out benchmarks/results/vision_demo_cpu.json]

Prints a markdown table; the raw rows (every iteration's score and time) go to --out.
The encoder's share: one forward pass over a batch's rows with their images against the
same rows' text alone (the image tokens' own embeddings), compiled and timed back to back.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import numpy as np

import jaxppo
from jaxppo import demo_vision as dv


def run(checkpoint: str, iterations: int, blank: bool, out: str):
    config = jaxppo.Config.for_algorithm("grpo", **dv.DEMO_VISION_GRPO).replace(
        **{**dv.DEMO_VISION_TRAINER, "iterations": iterations, "output_dir": out, "progress": False,
           "sample_every": 0, "export_final": False, "plot": False, "report_to": "jsonl"})
    start = time.perf_counter()
    trainer = jaxppo.Trainer(config, policy=checkpoint, tokenizer=dv.vision_tokenizer(),
                             prompts=dv.vision_prompts(blank=blank), reward_fns=dv.colour_reward)
    rows = trainer.train()
    return trainer, [float(r["objective/scores"]) for r in rows], time.perf_counter() - start


def encoder_share(trainer, repeats: int = 20):
    """(seconds with images, seconds without) of the policy's forward over one batch of the
    run's prompts plus 2 response tokens, each compiled once and timed over `repeats`."""
    from jaxppo.rollout.prompts import prompt_batch

    model, params = trainer.parts.spec.policy, trainer.policy_params()
    table = trainer.parts.table
    rows = np.repeat(np.arange(16), 8)
    batch = prompt_batch(table, rows)
    response = np.full((len(rows), 2), 10, np.int32)
    mask = np.ones_like(response)
    with_images = jax.jit(lambda p, q: model.response_outputs(p, q, batch.mask, response, mask)[0])
    text_only = jax.jit(lambda p, ids: model.response_outputs(p, ids, batch.mask, response, mask)[0])
    out = []
    for fn, arg in ((with_images, batch.queries), (text_only, batch.ids)):
        fn(params, arg).block_until_ready()
        start = time.perf_counter()
        for _ in range(repeats):
            fn(params, arg).block_until_ready()
        out.append((time.perf_counter() - start) / repeats)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=dv.DEMO_VISION_TRAINER["iterations"])
    parser.add_argument("--out", default="benchmarks/results/vision_demo_cpu.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = dv.vision_checkpoint(os.path.join(tmp, "policy"))
        results = {}
        for blank in (False, True):
            trainer, scores, seconds = run(checkpoint, args.iterations, blank, os.path.join(tmp, f"run_{blank}"))
            results["blank" if blank else "images"] = {"scores": scores, "seconds": seconds}
        images, text = encoder_share(trainer)
    window = 10
    print("| iterations | with the pictures | pictures blanked (grey) |\n| --- | ---: | ---: |")
    for start in range(0, args.iterations, window):
        means = [np.mean(results[k]["scores"][start:start + window]) for k in ("images", "blank")]
        print(f"| {start}-{start + window - 1} | {means[0]:.3f} | {means[1]:.3f} |")
    print(f"\nwhole run (compile included): {results['images']['seconds']:.1f} s with the pictures, "
          f"{results['blank']['seconds']:.1f} s blanked")
    print(f"forward over a batch (128 rows): {images * 1e3:.2f} ms with the images' encoder, {text * 1e3:.2f} ms "
          f"text alone: the encoder's share {1 - text / images:.0%}")
    record = {"host": platform.node(), "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "jax": jax.__version__, "backend": jax.default_backend(), "iterations": args.iterations, **results,
              "forward_seconds": {"with_images": images, "text_only": text}}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
