"""Experiment trackers behind one interface (`Tracker`: start, log a step's metrics, log a
table, finish; and the resume rule in `jaxppo.tracking.base`), chosen by name with
`RunConfig.report_to` / `--report-to`:

- "jsonl": `<output_dir>/metrics.jsonl` and `<output_dir>/<table>.table.jsonl` (always on);
- "tensorboard": tensorboardX event files in `<output_dir>/tensorboard`;
- "wandb", "mlflow", "trackio": Weights & Biases, MLflow and trackio (extras
  `jaxppo[wandb]`, `jaxppo[mlflow]`, `jaxppo[trackio]`; `jaxppo.tracking.backends`).

A tracker of your own: subclass `Tracker` (or `AppendOnlyTracker`) and `register_tracker`.
"""

from jaxppo.tracking.backends import MlflowTracker, TrackioTracker, WandbTracker
from jaxppo.tracking.base import (ALWAYS, AppendOnlyTracker, Tracker, TrackerRun, check_installed, parse_report_to,
                                  register_tracker, tracker_class, tracker_names)
from jaxppo.tracking.local import JsonlTracker, TensorBoardTracker, read_metrics, read_table

__all__ = ["Tracker", "AppendOnlyTracker", "TrackerRun", "register_tracker", "tracker_class", "tracker_names",
           "parse_report_to", "check_installed", "JsonlTracker", "TensorBoardTracker", "WandbTracker",
           "MlflowTracker", "TrackioTracker", "read_metrics", "read_table", "ALWAYS"]

for _cls in (JsonlTracker, TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker):
    register_tracker(_cls.name, _cls)
