"""Experiment trackers (`jaxppo.tracking`, `TrainerConfig.report_to`): each backend's own
store, read back with its own reader (MLflow's client, trackio's storage, wandb's record
type over its offline transaction files, TensorBoard's event protos), holds every iteration
once and the values of metrics.jsonl after a crash and a resume; completion tables; a
tracker registered from outside the package; bad input refused before any work."""

import importlib.util
import json
import os
import time

import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.errors import RewardError
from jaxppo.tracking import Tracker, base, parse_report_to, read_metrics, read_table, register_tracker
from jaxppo.tracking.backends import mlflow_history, wandb_files, wandb_history

from trainer_setup import small_trainer

BACKENDS = ("wandb", "mlflow", "trackio")


def tracker_rows(out, project="jaxppo"):
    """{backend: [(step, {metric: value}), ...] in the store's order} for wandb, MLflow and
    trackio, read back with each one's own reader (MLflow's client, wandb's record type,
    trackio's storage); and {backend: [table steps]}."""
    from trackio.sqlite_storage import SQLiteStorage

    uid = json.load(open(os.path.join(out, "trackers.json")))["run_id"]
    rows, tables = {}, {}
    history = [row for path in wandb_files(str(out), uid) for row in wandb_history(path)]
    rows["wandb"] = [(int(r["_step"]), {k: v for k, v in r.items() if not k.startswith("_") and k != "completions"})
                     for r in history if "iteration" in r]
    tables["wandb"] = [int(r["_step"]) for r in history if "completions/_type" in r or "completions" in r]
    client, run_id, by_step = mlflow_history(str(out))
    rows["mlflow"] = [(step, dict(items)) for step, items in sorted(by_step.items())]
    assert all(len(items) == len(dict(items)) for items in by_step.values()), "a metric held twice at one step"
    tables["mlflow"] = sorted(int(a.path.split("_")[-1].split(".")[0]) for a in client.list_artifacts(run_id, "tables"))
    name = f"{os.path.basename(out)}-{uid[:8]}"
    logs = SQLiteStorage.get_logs(project, name)
    rows["trackio"] = [(int(r["step"]), r) for r in logs if "iteration" in r and r.get("iteration") is not None]
    tables["trackio"] = [int(r["step"]) for r in logs if r.get("completions") is not None]
    return rows, tables


def assert_trackers_hold(out, project="jaxppo", table_steps=None):
    """Each backend holds every iteration of metrics.jsonl once, in order, with its values
    (timings aside)."""
    expected = read_metrics(os.path.join(out, "metrics.jsonl"))
    rows, tables = tracker_rows(out, project)
    for backend in BACKENDS:
        assert [step for step, _ in rows[backend]] == [r["iteration"] for r in expected], backend
        for (step, got), want in zip(rows[backend], expected):
            for key, value in want.items():
                timing = key.startswith("time/") or key == "eps"  # wall-clock: the one thing a resume cannot repeat
                if isinstance(value, (int, float)) and not isinstance(value, bool) and not timing:
                    assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), (backend, step, key)
        if table_steps is not None:
            assert tables[backend] == table_steps, backend


def test_each_tracker_holds_every_iteration_once_after_a_crash_and_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_PROJECT", "crash-and-resume")
    calls = []

    def crashing(prompts, completions):  # the 4th iteration's scoring raises: a crash after iteration 2 was logged
        calls.append(1)
        if len(calls) == 4:
            raise ValueError("the judge went away")
        return demo.lowercase_reward(prompts, completions)

    out = tmp_path / "run"
    settings = dict(iterations=4, checkpoint_every=2, report_to="tensorboard,wandb,mlflow,trackio", sample_every=1,
                    num_samples=2, export_final=False)
    with pytest.raises(RewardError, match="the judge went away"):
        small_trainer(out, reward_fns=crashing, **settings).train()
    rows, _ = tracker_rows(str(out), "crash-and-resume")
    for backend in BACKENDS:  # iteration 2 is held, and the checkpoint is at 2: the resume recomputes it
        assert [step for step, _ in rows[backend]] == [0, 1, 2], backend
    trainer = small_trainer(out, reward_fns=crashing, **settings)  # the same command again (the judge is back)
    history = trainer.train()
    assert [r["iteration"] for r in history] == [0, 1, 2, 3]
    assert_trackers_hold(str(out), "crash-and-resume", table_steps=[0, 1, 2, 3])
    artifacts = sorted(f for _, _, files in os.walk(out / "mlflow") for f in files)  # inside the run directory
    assert artifacts == [f"completions_{i:06d}.json" for i in range(4)]
    table = read_table(str(out / "completions.table.jsonl"))
    assert [r["iteration"] for r in table] == [0, 0, 1, 1, 2, 2, 3, 3]
    # The last table's rows are the last iteration's completions, scored again here by the reward function.
    columns, last = trainer.completion_table(2)
    assert columns == ["prompt", "completion", "reward", "crashing", "advantage", "length", "stopped"]
    for row, kept in zip(last, table[-2:]):
        assert dict(zip(columns, row)) == {k: v for k, v in kept.items() if k != "iteration"}
        assert kept["reward"] == kept["crashing"] == pytest.approx(
            float(demo.lowercase_reward([kept["prompt"]], [kept["completion"]])[0]), abs=1e-6)
        assert 0 <= kept["length"] <= 6


def test_the_completions_table_holds_each_rows_advantage_as_the_update_computes_it(tmp_path):
    """GRPO: the "advantage" column equals (score - group mean) / (group std + eps), Bessel's
    std, computed here in numpy from the table's own "reward" column."""
    ppo = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=1, advantage_estimator="grpo",
                           num_generations=4, kl_coef=0.0)
    trainer = small_trainer(tmp_path / "run", iterations=1, ppo=ppo, sample_every=1, num_samples=16,
                            export_final=False, reward_fns=lambda p, c: [float(len(x) % 3) for x in c])
    trainer.train()
    table = read_table(str(tmp_path / "run" / "completions.table.jsonl"))
    rewards = np.asarray([r["reward"] for r in table]).reshape(4, 4)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    expected = ((rewards - rewards.mean(axis=1, keepdims=True)) / (std + ppo.advantages.grpo_eps)).ravel()
    assert np.ptp(rewards) > 0  # the rewards differ, so the advantages say something
    np.testing.assert_allclose([r["advantage"] for r in table], expected, rtol=1e-5, atol=1e-5)


class MemoryTracker(Tracker):
    """A tracker from outside the package: keeps everything it is given."""

    runs = []
    tables = True

    def start(self, run):
        self.record = {"run": run, "steps": [], "tables": [], "finished": False}
        MemoryTracker.runs.append(self.record)

    def log(self, step, metrics):
        self.record["steps"].append((step, metrics))

    def log_table(self, step, name, columns, rows):
        self.record["tables"].append((step, name, list(columns), [list(r) for r in rows]))

    def finish(self):
        self.record["finished"] = True


def test_a_tracker_registered_from_outside_the_package_gets_every_iteration_tables_and_the_resume(tmp_path):
    register_tracker("memory", MemoryTracker)
    try:
        out = tmp_path / "run"
        first = small_trainer(out, iterations=2, report_to="memory", sample_every=2, num_samples=3).train()
        second = small_trainer(out, iterations=3, report_to=["memory"], sample_every=2, num_samples=3).train()
    finally:
        del base._TRACKERS["memory"]
    a, b = MemoryTracker.runs
    assert a["run"].start_iteration == 0 and a["run"].history == () and a["finished"]
    assert [s for s, _ in a["steps"]] == [0, 1] and [m for _, m in a["steps"]] == first
    assert [(s, name, len(rows)) for s, name, _, rows in a["tables"]] == [(1, "completions", 3)]
    assert a["run"].config["batch_size"] == 16 and a["run"].config["report_to"] == "jsonl,memory"
    assert b["run"].start_iteration == 2 and list(b["run"].history) == first  # the resume rule's inputs
    assert b["run"].tables == (a["tables"][0][:3] + (a["tables"][0][3],),)
    assert b["run"].run_id == a["run"].run_id and len(a["run"].run_id) == 16
    assert [s for s, _ in b["steps"]] == [2] and [m for _, m in b["steps"]] == second[2:]
    assert b["tables"] == []  # iteration 2 is the 3rd: sample_every=2 logs after the 2nd and 4th


def test_report_to_names_are_checked_before_any_work(monkeypatch):
    import jaxppo

    assert parse_report_to("none") == ("jsonl",)
    assert parse_report_to(" wandb , mlflow") == ("jsonl", "wandb", "mlflow")
    assert set(parse_report_to("all")) == {"jsonl", "tensorboard", "wandb", "mlflow", "trackio"}
    assert jaxppo.RunConfig(report_to=["mlflow"]).report_to == "jsonl,mlflow"
    assert jaxppo.RunConfig(report_to="jsonl").trackers == ("jsonl",)
    with pytest.warns(DeprecationWarning, match=r"tensorboard -> report_to without 'tensorboard'"):
        assert jaxppo.Config.from_settings(tensorboard=False).run.trackers == ("jsonl",)
    with pytest.raises(ValueError, match=r"report_to='wandb,comet' names unknown trackers \['comet'\]; valid: jsonl, "
                                         r"tensorboard, wandb, mlflow, trackio"):
        jaxppo.Config.from_settings(report_to="wandb,comet")
    with pytest.raises(ValueError, match=r"report_to=3 is invalid: give tracker names"):
        jaxppo.Config.from_settings(report_to=3)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "trackio") else
                        real(name, *a))
    with pytest.raises(ValueError, match=r"names wandb, trackio, whose package is not installed \(wandb, trackio\): "
                                         r"pip install jaxppo\[trackio\] jaxppo\[wandb\]"):
        jaxppo.Config.from_settings(report_to="wandb,mlflow,trackio")
    assert "wandb" not in parse_report_to("all")  # "all": the installed ones
    for bad in ("none", "a,b", ""):
        with pytest.raises(ValueError, match="tracker name"):
            register_tracker(bad, MemoryTracker)
    with pytest.raises(ValueError, match="a tracker named 'mlflow' is registered already"):
        register_tracker("mlflow", MemoryTracker)


def test_a_tracking_store_mlflow_refuses_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    """`MLFLOW_TRACKING_URI` naming a store MLflow refuses: a `RunError` of one line naming
    the variable, the URI and what is valid (the command prints it as `jaxppo: error: ...`,
    no traceback), not MLflow's exception from deep in its registry."""
    from jaxppo.tracking.backends import MlflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://nowhere")
    run = base.TrackerRun(output_dir=str(tmp_path), run_id="0" * 16, name="run", config={}, start_iteration=0,
                          history=(), tables=())
    with pytest.raises(jaxppo.RunError) as raised:
        MlflowTracker().start(run)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("report_to 'mlflow': MLflow refuses the tracking store 'bogus://nowhere' "
                              "(MLFLOW_TRACKING_URI): ")
    assert "Set MLFLOW_TRACKING_URI to a store MLflow supports" in message


def test_wandb_transaction_files_cut_anywhere_read_as_a_prefix(tmp_path):
    """A killed process leaves a transaction file cut anywhere: the reader returns the
    complete records before the cut and no error."""
    import wandb

    run = wandb.init(mode="offline", dir=str(tmp_path), project="jaxppo", id="cutfile", config={})
    for step in range(40):
        run.log({"iteration": step, "x": step * 0.5, "text": "y" * 2000}, step=step)  # records span blocks
    run.finish()
    (path,) = wandb_files(str(tmp_path), "cutfile")
    # wandb's service process writes the file; on a loaded machine `finish()` has returned
    # with the last records still on their way (seen once: 37 of 40), so wait for them.
    deadline = time.monotonic() + 60
    while len(whole := [r["_step"] for r in wandb_history(path)]) < 40 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert whole == list(range(40)) and os.path.getsize(path) > 2 * 32768
    data = open(path, "rb").read()
    for cut in range(0, len(data), 997):
        with open(path, "wb") as f:
            f.write(data[:cut])
        steps = [r["_step"] for r in wandb_history(path)]
        assert steps == whole[:len(steps)]


def test_trackio_resume_writes_the_metrics_of_a_step_whose_table_alone_was_held(tmp_path, monkeypatch):
    """A process killed between a step's table and its metrics leaves trackio the table
    row alone (seen in CI: the store then held iterations 0, 1, 3, 4, 5): the resume writes
    the step's metrics and not its table a second time."""
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    from jaxppo.tracking.backends import TrackioTracker

    monkeypatch.setenv("TRACKIO_PROJECT", "table-alone")
    table = ("completions", ["prompt", "completion"], [["a", "b"]])
    old = trackio.init(project="table-alone", name="run-abcdefgh", embed=False, auto_log_cpu=False, auto_log_gpu=False)
    for step in range(3):  # the killed process: iterations 0 and 1 whole, iteration 2's table only
        old.log({"completions": trackio.Table(columns=table[1], data=table[2])}, step=step)
        if step < 2:
            old.log({"iteration": step, "x": float(step)}, step=step)
    old.finish()
    history = tuple({"iteration": step, "x": float(step)} for step in range(3))
    tables = tuple((step, *table) for step in range(3))
    tracker = TrackioTracker()
    tracker.start(base.TrackerRun(str(tmp_path), "run", "abcdefgh-id", {}, 3, history, tables))
    assert tracker.holds(1) and not tracker.holds(2)
    tracker.log_table(3, *table)
    tracker.log(3, {"iteration": 3, "x": 3.0})
    tracker.finish()
    logs = SQLiteStorage.get_logs("table-alone", "run-abcdefgh")
    assert [(r["step"], r["x"]) for r in logs if r.get("iteration") is not None] == [(s, float(s)) for s in range(4)]
    assert [r["step"] for r in logs if r.get("completions") is not None] == [0, 1, 2, 3]
