"""The experiment trackers jaxppo does not install: Weights & Biases ("wandb"), MLflow
("mlflow") and trackio ("trackio"), extras `jaxppo[wandb]`, `jaxppo[mlflow]`,
`jaxppo[trackio]`. Each continues one run per run directory (`TrackerRun.run_id`) and reads
back the last step its store holds, so a killed and resumed run leaves every iteration in it
once (`jaxppo.tracking.base`). The step is the iteration.

Where each writes (the backends' own settings, read from the environment as their own
libraries do):
- wandb: `WANDB_PROJECT` (default "jaxppo"), `WANDB_ENTITY`, `WANDB_MODE` ("offline" keeps
  the run in `<output_dir>/wandb` until `wandb sync`); the run's id is `run_id`, its name the
  run directory's.
- mlflow: `MLFLOW_TRACKING_URI` (default: `sqlite:///<output_dir>/mlflow.db`, a store inside
  the run directory, with its artifacts in `<output_dir>/mlflow`), `MLFLOW_EXPERIMENT_NAME` (default "jaxppo"); the run is tagged
  `jaxppo.run_id` and found by that tag on resume; tables are JSON artifacts.
- trackio: `TRACKIO_DIR` (its local database), `TRACKIO_PROJECT` (default "jaxppo"); the run
  is named `<run directory name>-<run_id[:8]>`.
"""

from __future__ import annotations

import glob
import os
import struct
import time
from typing import Iterator, Optional, Sequence

from jaxppo.errors import RunError
from jaxppo.tracking.base import AppendOnlyTracker, TrackerRun

__all__ = ["WandbTracker", "MlflowTracker", "TrackioTracker", "wandb_history", "wandb_files", "mlflow_history"]


def _scalars(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class _RunLogTracker(AppendOnlyTracker):
    """What wandb and trackio share: `open` sets `self._run`, an object with `log(dict,
    step=)` and `finish()`; `table(columns, data)` makes the backend's table."""

    def table(self, columns: list, data: list):
        raise NotImplementedError

    def write(self, step: int, metrics: dict) -> None:
        self._run.log(_scalars(metrics), step=step)

    def write_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        self._run.log({name: self.table(list(columns), [list(r) for r in rows])}, step=step)

    def finish(self) -> None:
        self._run.finish()


class WandbTracker(_RunLogTracker):
    """Weights & Biases: `wandb.init(id=run_id, resume="allow", dir=output_dir)`; the steps
    held are read from the run's local transaction files (`<output_dir>/wandb/*-<run_id>/`),
    online and offline alike. Tables are `wandb.Table`s."""

    name = "wandb"
    requires = ("wandb", "jaxppo[wandb]")
    tables = True

    def open(self, run: TrackerRun) -> Optional[int]:
        import wandb

        held = max((_wandb_last_step(p) for p in wandb_files(run.output_dir, run.run_id)), default=None)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxppo"), name=run.name, id=run.run_id,
                               resume="allow", dir=run.output_dir, config=run.config)
        if self._run.resumed and self._run.step:  # online: the server's record, where the local files are gone
            held = max(held if held is not None else -1, self._run.step - 1)
        return held

    def table(self, columns: list, data: list):
        import wandb

        return wandb.Table(columns=columns, data=data)


def wandb_files(output_dir: str, run_id: str) -> list:
    """The transaction files of wandb run `run_id` under `<output_dir>/wandb` (one per
    process that ran it, online or offline), oldest first."""
    return sorted(glob.glob(os.path.join(output_dir, "wandb", f"*run-*-{run_id}", f"run-{run_id}.wandb")))


def _wandb_records(path: str) -> Iterator[bytes]:
    """The records of a wandb transaction file: a 7-byte header (":W&B", an ident, a
    version), then LevelDB's log format (32 KiB blocks; each record a 7-byte header of
    checksum, length and kind, split over blocks as FIRST/MIDDLE/LAST). A torn end, which a
    killed process leaves, ends the scan."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's trailer: too short for a header
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        if pos + 7 + length > len(data):
            return
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = [chunk]
        elif kind == 3:
            parts.append(chunk)
        elif kind == 4:
            yield b"".join(parts + [chunk])
            parts = []


def wandb_history(path: str) -> list:
    """The history rows (`{metric: value}`, with "_step") of a wandb transaction file
    (`run-<id>.wandb`), read with wandb's own record type."""
    import json

    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        try:
            record.ParseFromString(raw)
        except Exception:  # a torn record
            break
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def _wandb_last_step(path: str) -> Optional[int]:
    steps = [int(row["_step"]) for row in wandb_history(path) if "_step" in row]
    return max(steps, default=None)


class MlflowTracker(AppendOnlyTracker):
    """MLflow through its client (`MlflowClient`): one run per run directory, tagged
    `jaxppo.run_id`; the settings as parameters on its first start; the last step held read
    back from the "iteration" metric's history; tables as JSON artifacts
    (`tables/<name>_<step>.json`, MLflow's `log_table`)."""

    name = "mlflow"
    requires = ("mlflow", "jaxppo[mlflow]")
    tables = True

    def open(self, run: TrackerRun) -> Optional[int]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
        if not uri:  # a store inside the run directory, its artifacts beside it (not in the working directory)
            here = os.path.abspath(run.output_dir)
            uri, artifacts = "sqlite:///" + os.path.join(here, "mlflow.db"), "file://" + os.path.join(here, "mlflow")
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "jaxppo")
        try:
            self._client = client = MlflowClient(uri)
            experiment = client.get_experiment_by_name(name)
        except Exception as err:  # noqa: BLE001 - MLflow raises its own type per store; one line names the cause
            given = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the run's own store"
            message = " ".join(str(err).split())[:300]
            raise RunError(f"report_to 'mlflow': MLflow refuses the tracking store {uri!r} ({given}): "
                           f"{type(err).__name__}: {message}. Set MLFLOW_TRACKING_URI to a store MLflow supports "
                           "(sqlite:///path/mlflow.db, file:///path, http(s)://server), or unset it for a store in the "
                           "run directory") from None
        experiment_id = (experiment.experiment_id if experiment is not None else
                         client.create_experiment(name, artifact_location=artifacts))
        found = client.search_runs([experiment_id], filter_string=f"tags.`jaxppo.run_id` = '{run.run_id}'")
        if found:
            self._run_id = found[0].info.run_id
            client.update_run(self._run_id, status="RUNNING")
            history = client.get_metric_history(self._run_id, "iteration")
            return max((int(m.step) for m in history), default=None)
        self._run_id = client.create_run(experiment_id, run_name=run.name, tags={"jaxppo.run_id": run.run_id}).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in sorted(run.config.items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            client.log_batch(self._run_id, params=params[i:i + 100])
        return None

    def write(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # "iteration" last: the store holds a step's other metrics before the one read back on resume
        items = sorted(_scalars(metrics).items(), key=lambda kv: kv[0] == "iteration")
        batch = [Metric(_mlflow_name(k), v, now, step) for k, v in items]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self._run_id, metrics=batch[i:i + 1000])

    def write_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self._client.log_table(self._run_id, data=data, artifact_file=f"tables/{name}_{step:06d}.json")

    def finish(self) -> None:
        self._client.set_terminated(self._run_id)


def mlflow_history(output_dir: str, experiment: str = "jaxppo") -> tuple:
    """(MLflow's client, the run's id, {step: [(metric, value), ...] in the store}) of the run
    that the default store of `output_dir` (`<output_dir>/mlflow.db`) holds, read with MLflow's
    own client: a metric held twice at a step appears twice."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient("sqlite:///" + os.path.join(os.path.abspath(output_dir), "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    by_step = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            by_step.setdefault(m.step, []).append((key, m.value))
    return client, run.info.run_id, by_step


def _mlflow_name(name: str) -> str:
    """MLflow's metric names allow letters, digits, `_-. /`: anything else becomes "_"."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in name)


class TrackioTracker(_RunLogTracker):
    """trackio (local by default: its SQLite database under `TRACKIO_DIR`): the run named
    `<run directory name>-<run_id[:8]>`, resumed by that name; the steps held read back
    row by row from trackio's storage (a step's table and its metrics are rows apart, and a
    killed process can leave the one without the other). Tables are `trackio.Table`s."""

    name = "trackio"
    requires = ("trackio", "jaxppo[trackio]")
    tables = True

    def open(self, run: TrackerRun) -> Optional[frozenset]:
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        project = os.environ.get("TRACKIO_PROJECT", "jaxppo")
        name = f"{run.name}-{run.run_id[:8]}"
        held = None
        if name in SQLiteStorage.get_runs(project):
            logs = SQLiteStorage.get_logs(project, name)
            held = frozenset(int(row["step"]) for row in logs if row.get("iteration") is not None)
            self.held_tables = frozenset((int(row["step"]), key) for row in logs for key, value in row.items()
                                         if isinstance(value, dict) and value.get("_type") == trackio.Table.TYPE)
        self._run = trackio.init(project=project, name=name, resume="allow", config=run.config, embed=False,
                                 auto_log_cpu=False, auto_log_gpu=False)
        return held

    def table(self, columns: list, data: list):
        import trackio

        return trackio.Table(columns=columns, data=data)
