"""The trackers that write into the run directory: "jsonl" (metrics.jsonl, one object per
iteration, and one JSONL file per table) and "tensorboard" (tensorboardX event files). Both
rewrite their files on resume from the kept history, so they hold each iteration once."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Sequence

from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text
from jaxppo.testing import failpoints
from jaxppo.tracking.base import Tracker, TrackerRun

__all__ = ["JsonlTracker", "TensorBoardTracker", "read_metrics", "read_table", "kept_tables", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"
TABLE_SUFFIX = ".table.jsonl"  # a table's file: <output_dir>/<name>.table.jsonl


class JsonlTracker(Tracker):
    """`<output_dir>/metrics.jsonl` (the run's own record: always written) and
    `<output_dir>/<table name>.jsonl` (one object per row, with its "iteration").

    On start the metrics file is rewritten atomically to `history` (lines of later
    iterations, written after the checkpoint, are dropped) and each table file to its rows
    of iterations before `start_iteration` (`TrackerRun.tables`)."""

    name = "jsonl"
    tables = True
    needs_run_id = False

    def start(self, run: TrackerRun) -> None:
        self.dir, self.start_iteration = run.output_dir, run.start_iteration
        self.path = os.path.join(run.output_dir, METRICS_FILE)
        if os.path.isfile(self.path) or run.history:
            atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in run.history))
        kept = {}  # the rows the run's tables held before start_iteration (`run.tables`, read once by the caller)
        for step, name, columns, rows in run.tables:
            kept.setdefault(name, []).extend({"iteration": step, **dict(zip(columns, row))} for row in rows)
        for table in self._table_files():
            name = os.path.basename(table)[:-len(TABLE_SUFFIX)]
            atomic_write_text(table, "".join(json.dumps(row) + "\n" for row in kept.get(name, [])))
        self._file = open(self.path, "a")
        self._tables, self._write_failed = {}, False

    def _table_files(self):
        names = os.listdir(self.dir) if os.path.isdir(self.dir) else []
        return [os.path.join(self.dir, n) for n in sorted(names) if n.endswith(TABLE_SUFFIX)]

    def log(self, step: int, metrics: dict) -> None:
        text = json.dumps(metrics) + "\n"
        failpoints.hit("metrics_write", lambda: (self._file.write(text[: len(text) // 2]), self._file.flush()))
        self._append(self._file, text, f"iteration {step}", self.path)

    def _append(self, f, text: str, what: str, path: str):
        try:
            f.write(text)
            f.flush()
        except OSError as err:
            self._write_failed = True
            raise RunError(f"could not append {what} to {path}: {err}. The lines before it are intact; free disk "
                           "space or fix the directory, then run the same command again to resume from the last "
                           "checkpoint") from err

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        path = table_path(self.dir, name)
        if name not in self._tables:
            self._tables[name] = open(path, "a")
        text = "".join(json.dumps({"iteration": step, **dict(zip(columns, row))}) + "\n" for row in rows)
        self._append(self._tables[name], text, f"the {name!r} table of iteration {step}", path)

    def finish(self) -> None:
        for f in [getattr(self, "_file", None), *getattr(self, "_tables", {}).values()]:
            if f is None or f.closed:
                continue
            try:
                f.close()
            except OSError:
                if not self._write_failed:  # a failed write was already reported; its unflushed rest cannot be saved
                    raise


def table_path(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, name + TABLE_SUFFIX)


def kept_tables(output_dir: str, start_iteration: int) -> tuple:
    """The tables of `output_dir`'s table files logged before `start_iteration`:
    `(step, name, columns, rows)`, by step, then name."""
    suffix, found = TABLE_SUFFIX, []
    names = sorted(n for n in os.listdir(output_dir) if n.endswith(suffix)) if os.path.isdir(output_dir) else []
    for file in names:
        by_step = {}
        for row in read_table(os.path.join(output_dir, file)):
            if row["iteration"] < start_iteration:
                by_step.setdefault(row["iteration"], []).append(row)
        for step, rows in by_step.items():
            columns = [k for k in rows[0] if k != "iteration"]
            found.append((step, file[:-len(suffix)], columns, [[r.get(c) for c in columns] for r in rows]))
    return tuple(sorted(found, key=lambda t: (t[0], t[1])))


def _summary_writer_class():
    """tensorboardX's `SummaryWriter`. tensorboardX imports PyTorch at import time when it is
    installed, only to accept torch tensors in `add_embedding` (about 1.3 s on a 2-core CPU,
    on the way to the first metrics line); jaxppo writes scalars. So unless PyTorch is
    already imported, tensorboardX is imported with PyTorch hidden, and PyTorch stays
    importable afterwards as before."""
    import sys

    if "torch" in sys.modules or "tensorboardX" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # a None entry makes `import torch` raise ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class TensorBoardTracker(Tracker):
    """TensorBoard scalars in `<output_dir>/tensorboard` (step: the episode count). The
    events are rebuilt from `history` on every start, so they hold every kept iteration
    once, in order, and nothing past the checkpoint."""

    name = "tensorboard"
    requires = ("tensorboardX", "tensorboardX")
    needs_run_id = False

    def start(self, run: TrackerRun) -> None:
        SummaryWriter = _summary_writer_class()
        tb_dir = os.path.join(run.output_dir, "tensorboard")
        shutil.rmtree(tb_dir, ignore_errors=True)  # rebuilt below from the kept lines
        self._tb = SummaryWriter(tb_dir)
        for row in run.history:
            self.log(row["iteration"], row)

    def log(self, step: int, metrics: dict) -> None:
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(name, value, metrics["episode"])

    def finish(self) -> None:
        self._tb.close()


def _read_jsonl(path: str, ok, what: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    rows = []
    for k, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            good = ok(row)
        except ValueError:
            good = False
        if good:
            rows.append(row)
        elif k == len(numbered) - 1:
            warnings.warn(f"{path} line {n} is not a complete {what} ({line[:80]!r}), as a run killed while "
                          "writing it leaves; dropped (the lines before it are kept)", RuntimeWarning, stacklevel=3)
        else:
            raise RunError(f"{path} line {n} is not a {what} ({line[:80]!r}) and later lines follow it, so "
                           "it was not left by an interrupted write; repair or remove that line, or give this run "
                           "another output_dir")
    return rows


def _is_row(row) -> bool:
    return isinstance(row, dict) and isinstance(row.get("iteration"), int)


def read_metrics(path: str) -> list:
    """The rows of a metrics.jsonl file (a missing file has none).

    A last line that is not a JSON object with an integer "iteration" (torn by a kill in the
    middle of a write, or garbage) is dropped with a `RuntimeWarning` naming the file and
    line; such a line anywhere else is a `RunError` naming them."""
    return _read_jsonl(path, _is_row, "metrics record")


def read_table(path: str) -> list:
    """The rows of a table's JSONL file (`<name>.table.jsonl`), by the rule of `read_metrics`."""
    return _read_jsonl(path, _is_row, "table row")
