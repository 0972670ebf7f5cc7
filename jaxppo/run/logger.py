"""The run's metrics and tables, sent to its trackers (`jaxppo.tracking`, chosen by
`RunConfig.report_to`), echoed on the console, and plotted at the end."""

from __future__ import annotations

import json
import os
import uuid
import warnings
from typing import Optional, Sequence

from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text
from jaxppo.tracking import TrackerRun, parse_report_to, read_metrics, tracker_class
from jaxppo.tracking.local import METRICS_FILE, kept_tables

__all__ = ["Logger", "read_metrics", "run_id", "tracked_settings", "TRACKERS_FILE"]

TRACKERS_FILE = "trackers.json"
_CONSOLE_KEYS = ("objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "loss/value_avg", "ppo/updates_applied")


def run_id(output_dir: str) -> str:
    """The run directory's tracker id (`trackers.json`), made once, before any tracker starts,
    so that every resume continues the same tracker runs."""
    path = os.path.join(output_dir, TRACKERS_FILE)
    if os.path.isfile(path):
        try:
            with open(path) as f:
                found = json.load(f)["run_id"]
            if isinstance(found, str) and found.isalnum():
                return found
        except (ValueError, KeyError, TypeError):
            pass
        raise RunError(f"{path} is not a trackers file of jaxppo (a JSON object with an alphanumeric \"run_id\"); "
                       "restore it, or delete it to start new tracker runs for this directory")
    new = uuid.uuid4().hex[:16]
    atomic_write_text(path, json.dumps({"run_id": new}) + "\n")
    return new


def tracked_settings(config) -> dict:
    """The run's settings as the trackers record them: every setting of the `jaxppo.Config`,
    by name (JSON values; others as text)."""
    return {k: v if isinstance(v, (bool, int, float, str, type(None))) else json.dumps(v, default=str)
            for k, v in config.settings().items()}


def checked_history(rows: list, start_iteration: int, path: str) -> list:
    """The lines of `path` (metrics.jsonl) before `start_iteration`, the checkpoint's
    iteration, checked against it: one line per iteration, in order, the last of them
    `start_iteration - 1`. A line repeated word for word (a file copied onto itself) is
    dropped with a warning; a log that starts late (moved aside or deleted) continues with a
    warning; two different lines for one iteration, a missing iteration, or lines out of
    order are a `RunError` naming them, as nothing can say which record is the run's."""
    before = [row for row in rows if row["iteration"] < start_iteration]
    kept, first, repeated, conflicting = [], {}, [], []
    for row in before:
        if row["iteration"] in first:
            (repeated if row == first[row["iteration"]] else conflicting).append(row["iteration"])
            continue
        first[row["iteration"]] = row
        kept.append(row)
    iterations = [row["iteration"] for row in kept]
    expected = list(range(start_iteration - len(kept), start_iteration))
    advice = (f"restore those lines, or move {path} aside (the run then starts a new log at iteration "
              f"{start_iteration}, the old one kept where you moved it)")
    if conflicting:
        raise RunError(f"{path} holds two different lines for iteration(s) {sorted(set(conflicting))}; the checkpoint "
                       f"says the run finished {start_iteration} iterations, one line each; {advice}")
    if iterations != expected:
        missing = sorted(set(range(min(iterations), start_iteration)) - set(iterations))
        what = f"lacks the lines of iteration(s) {missing}" if missing else "holds its lines out of order"
        raise RunError(f"{path} {what} (the checkpoint is at iteration {start_iteration}); {advice}")
    if repeated:
        warnings.warn(f"{path} repeated the lines of iteration(s) {sorted(set(repeated))} word for word; the copies "
                      "are dropped", RuntimeWarning, stacklevel=3)
    if start_iteration and len(kept) < start_iteration:
        warnings.warn(f"{path} holds no lines of iterations 0 to {start_iteration - len(kept) - 1} (moved aside or "
                      f"deleted); the log continues from the checkpoint at iteration {start_iteration}",
                      RuntimeWarning, stacklevel=3)
    return kept


# What a policy's run plots (`Logger.plot`).
POLICY_PANELS = (("objective/scores", "score"), ("objective/kl", "KL(policy || ref)"),
                 ("objective/rlhf_reward", "RLHF reward"), ("eval/reward_mean", "eval reward (held-out prompts)"))


class Logger:
    """Sends each iteration's metrics to the run's trackers (`report_to`: names of
    `jaxppo.tracking`; "jsonl", `<output_dir>/metrics.jsonl`, always) and holds them in
    `history`.

    Resuming at `start_iteration` keeps metrics.jsonl's lines of earlier iterations (the
    `history`) and starts every tracker with them (`jaxppo.tracking.base`'s resume rule), so
    no tracker holds an iteration twice. A torn or garbage last line, which a kill in the
    middle of a write leaves, is dropped with a warning naming the file and line; a bad line
    elsewhere is an error (something other than a kill damaged the file)."""

    def __init__(self, output_dir: str, start_iteration: int = 0, report_to: Sequence[str] = ("jsonl", "tensorboard"),
                 config: Optional[dict] = None):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, METRICS_FILE)
        self.history = checked_history(read_metrics(self.path), start_iteration, self.path)
        classes = [tracker_class(name) for name in parse_report_to(list(report_to))]
        uid = run_id(output_dir) if any(getattr(c, "needs_run_id", True) for c in classes) else ""
        run = TrackerRun(output_dir, os.path.basename(os.path.abspath(output_dir)), uid, dict(config or {}),
                         start_iteration, tuple(self.history), kept_tables(output_dir, start_iteration))
        self.trackers = []
        try:
            for cls in classes:
                tracker = cls()
                tracker.start(run)
                self.trackers.append(tracker)
        except BaseException:
            self.close()
            raise

    def log(self, metrics: dict, echo: bool = True):
        for tracker in self.trackers:
            tracker.log(metrics["iteration"], metrics)
        self.history.append(metrics)
        if echo:
            parts = [f"iter {metrics['iteration']:4d}"] + [
                f"{k.split('/')[-1]} {metrics[k]:.4g}" for k in _CONSOLE_KEYS if k in metrics
            ]
            print("  ".join(parts), flush=True)

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]):
        """A table at iteration `step` to every tracker that records tables."""
        for tracker in self.trackers:
            if tracker.tables:
                tracker.log_table(step, name, columns, rows)

    def close(self):
        """Finish every tracker (idempotent); the first error is raised after all are tried."""
        trackers, self.trackers, error = self.trackers, [], None
        for tracker in trackers:
            try:
                tracker.finish()
            except Exception as err:  # the others still finish
                error = error or err
        if error is not None:
            raise error

    def plot(self, path: str, panels=POLICY_PANELS):
        """PNG of the metrics in `panels` ((metric, title) pairs) per iteration; an `eval/...`
        metric only where it was evaluated, and only where it was (default: score, KL and
        RLHF reward, and the eval reward)."""
        if not self.history:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [(key, title) for key, title in panels
                  if not key.startswith("eval/") or any(key in m for m in self.history)]
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
        for ax, (key, title) in zip(axes, panels):
            rows = [m for m in self.history if key in m] if key.startswith("eval/") else self.history
            ax.plot([m["iteration"] for m in rows], [m.get(key, float("nan")) for m in rows],
                    marker="o" if key.startswith("eval/") else None)
            ax.set_title(title)
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        tmp = path + ".tmp.png"
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
        plt.close(fig)
        return path
