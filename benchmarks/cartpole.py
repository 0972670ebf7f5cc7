"""Benchmark: PureJaxRL-style CartPole PPO with jaxppo's engine as the update phase against
the same program with the update phase written out by hand, vmapped over seeds.

    pip install gymnax==0.0.9
    python benchmarks/cartpole.py                   # 4 and 16 seeds, 500k steps each
    python benchmarks/cartpole.py --seeds 4 --repeats 2

Both programs are `examples/cartpole.py`'s `train` (one `jit` of a `vmap` over seeds: the
train state created inside, 976 iterations of 4 environments x 128 steps, GAE, 4 epochs of
4 mini-batches), differing only in the update phase: `jaxppo.update.update_epochs_fn` (with its
non-finite check, the default, and with `BatchConfig(skip_nonfinite_updates=False)`), or nested
`lax.scan`s over epochs and mini-batches as PureJaxRL writes them. Each is compiled once,
then run `--repeats` times, the variants in turn, so that drift hits them alike. Reported:
compile seconds, median run seconds, the run time over the hand-written loop's, and the
mean return of the last 10 iterations (mean and lowest over the seeds).

The process is pinned to `--cores` cores (1 by default): with more than one, jaxlib
0.10.2's CPU runtime stalled on this program within a few runs on the 2-core machine
these figures come from (every thread idle, the result never ready; the hand-written
loop as well as the engine), and one core ran it as fast as two. jaxlib 0.12.0.1 (Python
3.12) ran `--cores 2` three times over without a stall.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timesteps", type=int, default=500_000)
    parser.add_argument("--cores", type=int, default=1)
    args = parser.parse_args()
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])  # before jax starts its CPU client
    import jax
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
    import cartpole
    from tables import print_markdown

    variants = {"hand-written loop (PureJaxRL's)": (cartpole.Config(total_timesteps=args.timesteps), "hand"),
                "jaxppo engine": (cartpole.Config(total_timesteps=args.timesteps), "jaxppo"),
                "jaxppo engine, skip_nonfinite_updates=False": (cartpole.Config(total_timesteps=args.timesteps,
                                                                        skip_nonfinite_updates=False), "jaxppo")}
    for seeds in args.seeds:
        keys = jax.random.split(jax.random.key(0), seeds)
        compiled, compile_s, runs, finals = {}, {}, {}, {}
        for name, (config, update) in variants.items():
            start = time.perf_counter()
            compiled[name] = jax.jit(jax.vmap(cartpole.make_train(config, update))).lower(keys).compile()
            compile_s[name], runs[name] = time.perf_counter() - start, []
        for _ in range(args.repeats):
            for name, program in compiled.items():
                start = time.perf_counter()
                state, returns = jax.block_until_ready(program(keys))
                runs[name].append(time.perf_counter() - start)
                finals[name] = np.nanmean(np.asarray(returns)[:, -10:], axis=1)
        base = statistics.median(runs["hand-written loop (PureJaxRL's)"])
        rows = [[name, f"{compile_s[name]:.1f}", f"{statistics.median(runs[name]):.2f}",
                 f"{base / statistics.median(runs[name]):.2f}x", f"{finals[name].mean():.0f}",
                 f"{finals[name].min():.0f}"] for name in variants]
        print(f"\n## {seeds} seeds vmapped, {args.timesteps} steps each, {args.cores} core(s), "
              f"{args.repeats} runs each\n")
        print_markdown(["update phase", "compile s", "run s (median)", "speed vs the hand-written loop",
                        "return, last 10 iterations (mean of seeds)", "lowest seed"], rows)


if __name__ == "__main__":
    main()
