"""Markdown tables and timing for the benchmark scripts (imported as `tables` when a script
runs from this folder)."""

import time

import numpy as np


def median_time(fn, repeats: int):
    """(median seconds of `repeats` calls of `fn`, seconds of one call before them: with
    whatever compiling or start-up the first call does). `fn` must wait for its results."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), first


def print_markdown(headers, rows, numeric_from: int = 1):
    """Print a Markdown table: `headers` (strings), `rows` (lists of already formatted
    cells); columns from `numeric_from` on are right-aligned."""
    print("| " + " | ".join(headers) + " |")
    print("| " + " | ".join("---" if i < numeric_from else "---:" for i in range(len(headers))) + " |")
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def side_by_side_args(description: str, add=None, fixture_command: str = "jaxppo-fixture"):
    """(args, the arguments after `--` for the `jaxppo` command) of a real-model side by side
    with TRL: `--side jaxppo|trl`, `--model` (default: the prepared fixture, else an exit
    naming `fixture_command`), `--iterations`, and what `add(parser)` adds."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--side", choices=["jaxppo", "trl"], required=True)
    parser.add_argument("--model", default=None, help="the policy's directory (default: jaxppo-fixture's)")
    parser.add_argument("--iterations", type=int, default=10)
    if add is not None:
        add(parser)
    args, extra = parser.parse_known_args()
    if args.model is None:
        from jaxppo.models.fixtures import fixture_dir, is_prepared

        args.model = fixture_dir()
        if not is_prepared(args.model):
            raise SystemExit(f"no prepared model in {args.model}: run `{fixture_command}` first")
    return args, [a for a in extra if a != "--"]
