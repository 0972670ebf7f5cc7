"""Compare the metrics of two runs line by line, the timings (`time/...`, `eps`) left out: are they identical?

    python benchmarks/compare_metrics.py BEFORE_DIR AFTER_DIR [BEFORE_DIR2 AFTER_DIR2 ...]

Each directory is a run's output directory (its `metrics.jsonl`). A restructure that must not
change behaviour runs the demos with the code before and after it (for instance
`PYTHONPATH=<a checkout of the commit before> python -m jaxppo --iterations 12 --output-dir
BEFORE_DIR`) and compares them here: every metric but `time/...` equal, line for line.
"""

from __future__ import annotations

import json
import os
import sys


TIMINGS = ("eps",)  # episodes per second, TRL's name: a timing like time/...


def metrics(directory: str) -> list:
    with open(os.path.join(directory, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/") and k not in TIMINGS}
                for line in f]


def compare(before: str, after: str) -> tuple:
    """(lines, metrics per line, the differing (line, metric) pairs)."""
    a, b = metrics(before), metrics(after)
    diffs = [(i, k) for i, (x, y) in enumerate(zip(a, b)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
    if len(a) != len(b):
        diffs.append(("lines", f"{len(a)} != {len(b)}"))
    return len(a), len(a[0]) if a else 0, diffs


def main(argv):
    if not argv or len(argv) % 2:
        raise SystemExit(__doc__)
    print("| before | after | lines | metrics per line | differences |")
    print("| --- | --- | ---: | ---: | --- |")
    for before, after in zip(argv[::2], argv[1::2]):
        lines, width, diffs = compare(before, after)
        print(f"| {before} | {after} | {lines} | {width} | {'none: identical' if not diffs else diffs[:5]} |")


if __name__ == "__main__":
    main(sys.argv[1:])
