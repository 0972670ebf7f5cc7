"""The suite's time per test file, from pytest's `--durations=0` report: one log, or two
side by side (before / after).

    python -m pytest -q --durations=0 > after.log
    python benchmarks/test_durations.py after.log                 # one column
    python benchmarks/test_durations.py before.log after.log      # before, after, ratio

Each file's time is the sum of its tests' setup, call and teardown times as pytest reports
them (under pytest-xdist: the time in the worker that ran it; the wall time of the whole
run is shorter, the workers run side by side). Files in only one log show "-" in the other.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

from tables import print_markdown

LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(tests/[^:\s]+)")
SUMMARY = re.compile(r"(\d+) passed.* in ([0-9.]+)s")


def per_file(path: str):
    """({file: seconds}, wall seconds of the run or None) from a pytest log."""
    files, wall = defaultdict(float), None
    with open(path, errors="replace") as f:
        for line in f:
            match = LINE.match(line)
            if match:
                files[match.group(3)] += float(match.group(1))
            summary = SUMMARY.search(line)
            if summary:
                wall = float(summary.group(2))
    return dict(files), wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="one or two pytest logs with --durations=0")
    parser.add_argument("--labels", nargs="+", default=None, help="column names (default: the log paths)")
    args = parser.parse_args()
    runs = [per_file(p) for p in args.logs[:2]]
    names = sorted(set().union(*(r[0] for r in runs)), key=lambda n: -max(r[0].get(n, 0.0) for r in runs))
    rows = []
    for name in names:
        cells = [f"{r[0][name]:.0f} s" if name in r[0] else "-" for r in runs]
        if len(runs) == 2 and name in runs[0][0] and name in runs[1][0] and runs[1][0][name] > 0:
            cells.append(f"{runs[0][0][name] / runs[1][0][name]:.1f}x")
        elif len(runs) == 2:
            cells.append("-")
        rows.append([name.removeprefix("tests/"), *cells])
    totals = [f"{sum(r[0].values()):.0f} s" for r in runs]
    walls = [f"{r[1]:.0f} s" if r[1] is not None else "-" for r in runs]
    extra = [""] if len(runs) == 2 else []
    rows.append(["sum over files", *totals, *extra])
    rows.append(["wall time of the run", *walls, *extra])
    headers = ["file", *(args.labels or args.logs)[:2]] + (["before / after"] if len(runs) == 2 else [])
    print_markdown(headers, rows)


if __name__ == "__main__":
    main()
