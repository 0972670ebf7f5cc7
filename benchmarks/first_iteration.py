"""Benchmark: time to the first iteration of the `jaxppo` command, with an empty and then a
filled persistent compilation cache (two runs back to back in fresh processes).

    python benchmarks/first_iteration.py                 # the demo, 1 iteration
    python benchmarks/first_iteration.py -- --batch-size 16   # extra jaxppo flags after --
    python benchmarks/first_iteration.py --programs      # where the compile time goes, by program

Times are read from the command's own output: start-up (process start to the header line,
after models and prompts are loaded), the first iteration (header to its metrics line:
compilation plus one iteration), and the whole command.

With --programs, the command runs once in this process with no compilation cache, and a
table lists every program XLA compiled: its name, its compile time (jax's own
backend-compile event), and the size of its StableHLO text (jax's IR dump), largest
compile time first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from tables import print_markdown


def run(cache: str, out: str, extra: list) -> tuple:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "jaxppo", "--iterations", "1", "--no-progress", "--output-dir", out,
                             "--compilation-cache", cache, *extra], stdout=subprocess.PIPE, text=True, env=env)
    header = first = None
    for line in proc.stdout:
        if header is None and line.startswith("jaxppo:"):
            header = time.time()
        if first is None and line.startswith("iter    0"):
            first = time.time()
    if proc.wait() != 0 or header is None or first is None:
        raise SystemExit(f"the jaxppo command failed (exit {proc.returncode})")
    return header - start, first - header, time.time() - start


def programs(extra: list):
    """Compile time and StableHLO size of every program the command's first iteration
    compiles (in this process, no compilation cache)."""
    import collections

    import jax

    from jaxppo import cli

    compiles = collections.defaultdict(list)

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[kwargs.get("fun_name", "?")].append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    with tempfile.TemporaryDirectory() as d:
        dump = os.path.join(d, "ir")
        jax.config.update("jax_dump_ir_to", dump)
        jax.config.update("jax_dump_ir_modes", "stablehlo")
        start = time.time()
        cli.main(["--iterations", "1", "--no-progress", "--output-dir", os.path.join(d, "run"), "--compilation-cache",
                  "none", *extra])
        total = time.time() - start
        sizes = collections.defaultdict(int)
        for name in os.listdir(dump):  # jax_ir<n>_<program: "jit(f)" written "jit_f">_compile.mlir
            if name.startswith("jax_ir") and name.endswith("_compile.mlir"):
                sizes[name.split("_", 2)[2][: -len("_compile.mlir")]] += os.path.getsize(os.path.join(dump, name))
    rows = sorted(((n, len(t), sum(t)) for n, t in compiles.items()), key=lambda r: -r[2])
    sizes = {n: sizes[n.replace("(", "_").replace(")", "")] for n, _, _ in rows
             if n.replace("(", "_").replace(")", "") in sizes}
    print(f"\n## programs compiled by `jaxppo --iterations 1 {' '.join(extra) or '(demo)'}` in one process, no cache: "
          f"{sum(r[1] for r in rows)} compiles taking {sum(r[2] for r in rows):.1f} s (some at once, on other "
          f"threads), the whole command {total:.1f} s\n")
    table = [[name, str(count), f"{seconds:.2f} s", f"{sizes.get(name, 0) / 1024:.0f} KiB" if name in sizes else "-"]
             for name, count, seconds in rows]
    print_markdown(["program", "compiles", "compile time", "StableHLO text"], table)


def main():
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    if "--programs" in sys.argv[1:sys.argv.index("--") if "--" in sys.argv else None]:
        return programs(extra)
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "xla")
        rows = []
        for name in ("first (cache empty)", "second (cache filled)"):
            startup, first, total = run(cache, os.path.join(d, name.split()[0]), extra)
            rows.append([name, f"{startup:.1f} s", f"{first:.1f} s", f"{total:.1f} s"])
        entries = len(os.listdir(cache))
    print(f"\n## first iteration of `jaxppo {' '.join(extra) or '(demo)'}`, {entries} programs cached\n")
    print_markdown(["run", "start-up to first iteration", "first iteration", "whole command"], rows)


if __name__ == "__main__":
    main()
