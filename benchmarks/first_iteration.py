"""Benchmark: time to the first iteration of the `jaxppo` command, with an empty and then a
filled persistent compilation cache (two runs back to back in fresh processes).

    python benchmarks/first_iteration.py                 # the demo, 1 iteration
    python benchmarks/first_iteration.py -- --batch-size 16   # extra jaxppo flags after --

Times are read from the command's own output: start-up (process start to the header line,
after models and prompts are loaded), the first iteration (header to its metrics line:
compilation plus one iteration), and the whole command.
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


def main():
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
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
