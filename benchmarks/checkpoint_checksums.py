"""Benchmark: what verifying checkpoints costs (`jaxppo.run.checkpoints`: the SHA-256 of
every file, written after each save, checked before each restore), on a checkpoint the
size of a SmolLM2-135M-Instruct run's: the policy's float32 parameters and Adam's two
moments (3 x 134.5M float32, 1.6 GB), random values.

    python benchmarks/checkpoint_checksums.py [--params 134515008] [--repeats 3]

Prints a table: the whole save (orbax's write and the checksums), the checksums alone, the
verification before a restore, and orbax's restore, in seconds (medians over the repeats).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tables import print_markdown  # noqa: E402

from jaxppo.run import checkpoints  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=134_515_008, help="parameters (SmolLM2-135M's by default)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 3)
    tree = {name: jax.random.normal(k, (args.params,), jnp.float32) for name, k in zip(("params", "mu", "nu"), keys)}
    gigabytes = 3 * args.params * 4 / 1e9
    times = {"save (orbax + checksums)": [], "checksums alone": [], "verify before restore": [], "orbax restore": []}
    root = tempfile.mkdtemp(prefix="jaxppo-checksums-")
    try:
        for r in range(args.repeats):
            directory = os.path.join(root, str(r))
            t = time.perf_counter()
            checkpoints.save(directory, 1, tree)
            times["save (orbax + checksums)"].append(time.perf_counter() - t)
            folder = os.path.join(directory, "1")
            t = time.perf_counter()
            checkpoints.checksums(folder)
            times["checksums alone"].append(time.perf_counter() - t)
            t = time.perf_counter()
            checkpoints.verify(folder)
            times["verify before restore"].append(time.perf_counter() - t)
            t = time.perf_counter()
            step, restored = checkpoints.restore_latest(directory, tree)
            jax.block_until_ready(restored)
            times["orbax restore"].append(time.perf_counter() - t - times["verify before restore"][-1])
            shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n## Checkpoint checksums: {gigabytes:.2f} GB ({args.params:,} parameters x 3, float32), "
          f"medians of {args.repeats}\n")
    print_markdown(["", "seconds", "GB/s"],
                   [[name, f"{statistics.median(v):.2f}", f"{gigabytes / statistics.median(v):.2f}"]
                    for name, v in times.items()])


if __name__ == "__main__":
    main()
