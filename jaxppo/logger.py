"""Metric logging: console, a JSONL file (one object per iteration), TensorBoard, and a PNG plot."""

from __future__ import annotations

import json
import os
import warnings

__all__ = ["Logger"]

_CONSOLE_KEYS = ("objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl_avg",
                 "policy/clipfrac_avg", "loss/value_avg", "ppo/updates_applied")


class Logger:
    """Appends each iteration's metrics to `<output_dir>/metrics.jsonl` and TensorBoard.

    Resuming at `start_iteration` keeps the file's lines of earlier iterations and drops
    any later ones (written after the checkpoint), so the file never holds an iteration
    twice."""

    def __init__(self, output_dir: str, start_iteration: int = 0, tensorboard: bool = True):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.history = []
        if os.path.isfile(self.path):
            with open(self.path) as f:
                for line in f:
                    if line.strip():
                        row = json.loads(line)
                        if row["iteration"] < start_iteration:
                            self.history.append(row)
        with open(self.path, "w") as f:
            for row in self.history:
                f.write(json.dumps(row) + "\n")
        self._file = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:
                warnings.warn("tensorboardX is not installed: TensorBoard logging is off", RuntimeWarning)

    def log(self, metrics: dict, echo: bool = True):
        self.history.append(metrics)
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = metrics["episode"]
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(name, value, step)
        if echo:
            parts = [f"iter {metrics['iteration']:4d}"] + [
                f"{k.split('/')[-1]} {metrics[k]:.4g}" for k in _CONSOLE_KEYS if k in metrics
            ]
            print("  ".join(parts), flush=True)

    def close(self):
        self._file.close()
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
            ax.plot(its, [m[key] for m in self.history])
            ax.set_title(title)
            ax.set_xlabel("iteration")
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
