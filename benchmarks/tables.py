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
