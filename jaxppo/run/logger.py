"""Metric logging: console, a JSONL file (one object per iteration), TensorBoard, and a PNG plot."""

from __future__ import annotations

import json
import os
import shutil
import warnings

from jaxppo.errors import RunError
from jaxppo.run.directory import atomic_write_text
from jaxppo.testing import failpoints

__all__ = ["Logger", "read_metrics"]

_CONSOLE_KEYS = ("objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "loss/value_avg", "ppo/updates_applied")


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


class Logger:
    """Appends each iteration's metrics to `<output_dir>/metrics.jsonl` and TensorBoard.

    Resuming at `start_iteration` keeps the file's lines of earlier iterations and drops
    any later ones (written after the checkpoint), so the file never holds an iteration
    twice. The file is rewritten atomically (temporary file + rename). A torn or garbage
    last line, which a kill in the middle of a write leaves, is dropped with a warning
    naming the file and line; a bad line elsewhere is an error (something other than a
    kill damaged the file). TensorBoard events are rebuilt from the kept lines, so they
    hold every kept iteration once, in order, and nothing past the checkpoint."""

    def __init__(self, output_dir: str, start_iteration: int = 0, tensorboard: bool = True):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.history = [row for row in read_metrics(self.path) if row["iteration"] < start_iteration]
        if os.path.isfile(self.path) or self.history:
            atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in self.history))
        self._file = open(self.path, "a")
        self._write_failed = False
        self._tb = None
        if tensorboard:
            try:
                SummaryWriter = _summary_writer_class()
            except ImportError:
                warnings.warn("tensorboardX is not installed: TensorBoard logging is off", RuntimeWarning)
            else:
                tb_dir = os.path.join(output_dir, "tensorboard")
                shutil.rmtree(tb_dir, ignore_errors=True)  # rebuilt below from the kept lines
                self._tb = SummaryWriter(tb_dir)
                for row in self.history:
                    self._tb_write(row)

    def _tb_write(self, metrics: dict):
        step = metrics["episode"]
        for name, value in metrics.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(name, value, step)

    def log(self, metrics: dict, echo: bool = True):
        text = json.dumps(metrics) + "\n"
        failpoints.hit("metrics_write", lambda: (self._file.write(text[: len(text) // 2]), self._file.flush()))
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as err:
            self._write_failed = True
            raise RunError(f"could not append iteration {metrics.get('iteration')} to {self.path}: {err}. The lines "
                           "before it are intact; free disk space or fix the directory, then run the same command "
                           "again to resume from the last checkpoint") from err
        self.history.append(metrics)
        if self._tb is not None:
            self._tb_write(metrics)
        if echo:
            parts = [f"iter {metrics['iteration']:4d}"] + [
                f"{k.split('/')[-1]} {metrics[k]:.4g}" for k in _CONSOLE_KEYS if k in metrics
            ]
            print("  ".join(parts), flush=True)

    def close(self):
        if self._file.closed:
            return
        try:
            self._file.close()
        except OSError:
            if not self._write_failed:  # a failed write was already reported; its unflushed rest cannot be saved
                raise
        if self._tb is not None:
            self._tb.close()

    def plot(self, path: str):
        """PNG of score, KL and RLHF reward per iteration."""
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        its = [m["iteration"] for m in self.history]
        fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
        for ax, (key, title) in zip(axes, [("objective/scores", "score"), ("objective/kl", "KL(policy || ref)"),
                                           ("objective/rlhf_reward", "RLHF reward")]):
            ax.plot(its, [m.get(key, float("nan")) for m in self.history])
            ax.set_title(title)
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
        plt.close(fig)
        return path


def read_metrics(path: str) -> list:
    """The rows of a metrics.jsonl file (a missing file has none).

    A last line that is not a JSON object with an integer "iteration" (torn by a kill in the
    middle of a write, or garbage) is dropped with a `RuntimeWarning` naming the file and
    line; such a line anywhere else is a `RunError` naming them."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = f.read().decode("utf-8", errors="replace").split("\n")
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    rows = []
    for k, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            ok = isinstance(row, dict) and isinstance(row.get("iteration"), int)
        except ValueError:
            ok = False
        if ok:
            rows.append(row)
        elif k == len(numbered) - 1:
            warnings.warn(f"{path} line {n} is not a complete metrics record ({line[:80]!r}), as a run killed while "
                          "writing it leaves; dropped (the lines before it are kept)", RuntimeWarning, stacklevel=2)
        else:
            raise RunError(f"{path} line {n} is not a metrics record ({line[:80]!r}) and later lines follow it, so "
                           "it was not left by an interrupted write; repair or remove that line, or give this run "
                           "another output_dir")
    return rows
