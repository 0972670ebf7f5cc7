"""The fault table (README, "Faults"), one test per row, each injecting the fault for real:
SIGKILL, SIGINT and SIGTERM sent to a `jaxppo` process, torn files, truncated and deleted
checkpoint files, a file-size limit for a full disk, a second run on the same directory,
misbehaving reward functions and models. Monkeypatching only where a fault cannot be
produced otherwise (an interrupted rename)."""

import json
import os
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.errors import RewardError, RunError
from jaxppo.run import checkpoints as checkpoint
from jaxppo.run.directory import atomic_write_text
from jaxppo.run.logger import Logger, read_metrics

from xla_options import with_devices
from test_trackers import assert_trackers_hold
from trainer_setup import small_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One tiny run of the `jaxppo` command: the embedded demo, 6 iterations of 16 episodes,
# a checkpoint every 2 iterations, TensorBoard on.
CLI_ARGS = ["--iterations", "6", "--batch-size", "16", "--mini-batch-size", "8", "--ppo-epochs", "1",
            "--response-length", "6", "--checkpoint-every", "2", "--no-progress", "--sample-every", "0",
            "--no-plot", "--no-export-final"]


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in rows]


def metrics_of(out):
    return comparable(json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")))


def tensorboard_steps(out):
    """{tag: [steps in file order]} of the scalar events under out/tensorboard (TFRecord:
    length, crc, Event proto, crc)."""
    from tensorboardX.proto import event_pb2

    steps = {}
    directory = os.path.join(out, "tensorboard")
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
    return steps


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Environment of the `jaxppo` subprocesses: a shared persistent compilation cache (the
    runs after the first skip most compilation), no hub access."""
    cache = tmp_path_factory.mktemp("jax_cache")
    e = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    e.pop("JAXPPO_FAILPOINT", None)
    e["XLA_FLAGS"] = with_devices(os.environ.get("XLA_FLAGS", ""), 1)  # one device, as a user's run
    e.pop("TRANSFORMERS_VERBOSITY", None)  # (set by conftest) a user's console, warnings included
    return e


def start(out, env, *extra, **env_extra):
    # Ctrl-C as a user's shell delivers it: a process started with SIGINT ignored (as
    # pytest-xdist's workers are) keeps it ignored, so the child resets it first.
    return subprocess.Popen([sys.executable, "-m", "jaxppo", *CLI_ARGS, "--output-dir", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, **env_extra),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_line(proc, pattern, timeout=300):
    """Read proc's stdout until a line matches `pattern`; return the lines read."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process ended before {pattern!r}: {''.join(lines)}{proc.stderr.read()}")
        lines.append(line)
        if re.search(pattern, line):
            return lines
    raise AssertionError(f"no {pattern!r} within {timeout} s")


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def run(out, env, *extra, **env_extra):
    return finish(start(out, env, *extra, **env_extra))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, env):
    """An uninterrupted run of the command, with a second run started on the same directory
    while it works, and with PyTorch hidden from transformers (package metadata of a torch too
    old for it, found first), as on a machine without PyTorch."""
    root = tmp_path_factory.mktemp("reference")
    fake = root / "no_torch"
    (fake / "torch-2.0.0.dist-info").mkdir(parents=True)
    (fake / "torch-2.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.0.0\n")
    out = root / "run"
    first = start(out, env, PYTHONPATH=os.pathsep.join([str(fake), env["PYTHONPATH"]]))
    head = wait_for_line(first, r"^jaxppo: 6 iterations")
    second = run(out, env)  # same directory while the first one trains
    first_still_running = first.poll() is None
    rc, stdout, stderr = finish(first)
    assert rc == 0, stderr[-3000:]
    return {"out": out, "rows": metrics_of(out), "stdout": "".join(head) + stdout, "stderr": stderr,
            "second": second, "first_still_running": first_still_running}


# ---------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("seed", [14, 5])  # kills after lines -1 (start-up) and 3 (the tracker test below: after 2)
def test_sigkill_at_a_random_point_then_the_same_command_finishes_like_an_uninterrupted_run(
        reference, env, tmp_path, seed):
    out = tmp_path / "run"
    rng = random.Random(seed)
    after = rng.randrange(-1, 6)  # -1: during start-up and compilation; k: while iteration k + 1 runs or saves
    proc = start(out, env)
    wait_for_line(proc, r"^jaxppo: 6 iterations" if after < 0 else rf"^iter\s+{after} ")
    time.sleep(rng.uniform(0.0, 2.0 if after < 0 else 0.5))
    proc.kill()
    proc.communicate()
    logged = len(read_metrics(str(out / "metrics.jsonl"))) if (out / "metrics.jsonl").exists() else 0
    print(f"seed {seed} (after line {after}): killed with {logged} iterations logged, checkpoints {checkpoint.steps(str(out / 'checkpoints'))}")
    rc, _, err = run(out, env)
    assert rc == 0, err[-3000:]
    assert metrics_of(out) == reference["rows"]
    steps = tensorboard_steps(out)
    episodes = [r["episode"] for r in reference["rows"]]
    assert steps["objective/scores"] == episodes  # each iteration once, in order, after the resume


@pytest.mark.slow
def test_sigkill_then_the_same_command_leaves_every_iteration_once_in_each_tracker(reference, env, tmp_path):
    """Killed after iteration 2 reached every tracker (the checkpoint is at 2, so the resume
    computes iteration 2 again): wandb, MLflow, trackio and TensorBoard, read back from their
    own stores, hold iterations 0-5 once each, with the uninterrupted run's values, and one
    completions table per iteration."""
    out = tmp_path / "run"
    trackers = ["--report-to", "tensorboard,wandb,mlflow,trackio", "--sample-every", "1"]
    proc = start(out, env, *trackers, TRACKIO_PROJECT="sigkill")
    wait_for_line(proc, r"^iter\s+2 ")
    time.sleep(0.2)
    proc.kill()
    proc.communicate()
    assert len(read_metrics(str(out / "metrics.jsonl"))) >= 3
    rc, _, err = run(out, env, *trackers, TRACKIO_PROJECT="sigkill")
    assert rc == 0, err[-3000:]
    assert metrics_of(out) == reference["rows"]
    assert_trackers_hold(str(out), "sigkill", table_steps=list(range(6)))
    assert tensorboard_steps(out)["objective/scores"] == [r["episode"] for r in reference["rows"]]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory, env):
    """An uninterrupted run of the command with pipelined iterations (--max-staleness 1)."""
    out = tmp_path_factory.mktemp("pipelined") / "run"
    rc, _, err = run(out, env, "--max-staleness", "1")
    assert rc == 0, err[-3000:]
    return metrics_of(out)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [10])  # kills after line 3: with the producer a step ahead
def test_pipelined_run_killed_at_a_random_point_resumes_to_the_uninterrupted_metrics(pipelined, reference, env,
                                                                                     tmp_path, seed):
    """Killed while the producer samples ahead (its batch is lost), the same command
    resumes from the checkpoint, whose snapshots give the lost batch again: the metrics
    of the uninterrupted pipelined run."""
    assert [r["rollout/staleness_max"] for r in pipelined] == [0, 1, 1, 1, 1, 1]
    assert pipelined[1]["objective/scores"] != reference["rows"][1]["objective/scores"] or \
        pipelined[1]["loss/total_avg"] != reference["rows"][1]["loss/total_avg"]  # not the synchronous run
    out = tmp_path / "run"
    rng = random.Random(seed)
    after = rng.randrange(-1, 6)
    proc = start(out, env, "--max-staleness", "1")
    wait_for_line(proc, rf"^iter\s+{after} ")
    time.sleep(rng.uniform(0.0, 0.5))
    proc.kill()
    proc.communicate()
    rc, _, err = run(out, env, "--max-staleness", "1")
    assert rc == 0, err[-3000:]
    assert metrics_of(out) == pipelined


@pytest.mark.slow
def test_sigkill_in_the_middle_of_a_metrics_line(reference, env, tmp_path):
    out = tmp_path / "run"
    rc, _, _ = run(out, env, JAXPPO_FAILPOINT="metrics_write:3")
    assert rc == -signal.SIGKILL
    lines = open(out / "metrics.jsonl").read().split("\n")
    assert len(lines) == 3 and lines[2] and not lines[2].endswith("}")  # two whole lines and a torn third
    rc, _, err = run(out, env)
    assert rc == 0, err[-3000:]
    assert re.search(r"metrics.jsonl line 3 is not a complete metrics record", err)
    assert metrics_of(out) == reference["rows"]


@pytest.mark.slow
def test_sigkill_while_a_checkpoint_is_written(reference, env, tmp_path):
    out = tmp_path / "run"
    rc, _, _ = run(out, env, JAXPPO_FAILPOINT="checkpoint_save:2")  # the save of iteration 4
    assert rc == -signal.SIGKILL
    assert checkpoint.steps(str(out / "checkpoints")) == [2]
    assert any(".orbax-checkpoint-tmp" in name for name in os.listdir(out / "checkpoints"))
    rc, stdout, err = run(out, env)
    assert rc == 0, err[-3000:]
    assert "resumed from iteration 2" in stdout
    assert metrics_of(out) == reference["rows"]
    assert sorted(os.listdir(out / "checkpoints")) == ["4", "6"]  # the torn save is gone, nothing else


# ---------------------------------------------------------------------------- signals


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGXCPU", "SIGUSR1", "SIGUSR2"])
def test_the_signals_that_end_a_job_stop_a_run_and_are_held_like_ctrl_c(name):
    """Each raises KeyboardInterrupt in the training loop (the checkpoint-and-exit path of
    Ctrl-C) and is held while a checkpoint or an iteration's line is committed; the handlers
    before the block are back after it."""
    from jaxppo.run.interrupts import TERMINATING, interrupts_held, interrupts_raise

    sig = getattr(signal, name)
    assert sig in TERMINATING
    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt, match=name), interrupts_raise():
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler interrupts this
    assert signal.getsignal(sig) == before
    finished = False
    with pytest.raises(KeyboardInterrupt, match=name), interrupts_held(what="this test's block"):
        os.kill(os.getpid(), sig)
        time.sleep(0.05)
        finished = True  # held: the block runs to its end, then the interrupt is raised
    assert finished and signal.getsignal(sig) == before


@pytest.mark.slow
def test_sigterm_during_compilation_exits_cleanly_and_resumes(reference, env, tmp_path_factory):
    out = tmp_path_factory.mktemp("sigterm") / "run"
    cold = dict(env, JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("cold_cache")))
    proc = start(out, cold)
    wait_for_line(proc, r"^jaxppo: 6 iterations")  # compilation of the first iteration starts now
    proc.send_signal(signal.SIGTERM)
    rc, stdout, err = finish(proc)
    assert rc == 130, err[-3000:]
    assert "checkpoint saved at iteration 0" in stdout and "Traceback" not in err
    assert checkpoint.steps(str(out / "checkpoints")) == [0]
    rc, stdout, err = run(out, env)
    assert rc == 0, err[-3000:]
    assert "resumed from iteration 0" in stdout
    assert metrics_of(out) == reference["rows"]


@pytest.mark.slow
def test_ctrl_c_twice_finishes_the_checkpoint_then_exits(reference, env, tmp_path):
    out = tmp_path / "run"
    # Iteration 3 waits at its start until the first Ctrl-C ends the wait (however late this
    # process reads the line before it), and every checkpoint save lasts at least 2 s, so the
    # second Ctrl-C surely lands inside one.
    proc = start(out, env, JAXPPO_PAUSE="iteration@3:300,checkpoint_save:2")
    wait_for_line(proc, r"^iter\s+2 ")  # iteration 3 is next; its checkpoint is the interrupt's
    proc.send_signal(signal.SIGINT)
    wait_for_line(proc, r"^interrupted: saving a checkpoint")
    proc.send_signal(signal.SIGINT)  # while the checkpoint is being written
    rc, stdout, err = finish(proc)
    assert rc == 130, err[-3000:]
    assert "SIGINT received: finishing the checkpoint first" in err
    saved = int(re.search(r"checkpoint saved at iteration (\d+)", stdout).group(1))
    assert saved % 2 == 1 and checkpoint.steps(str(out / "checkpoints"))[-1] == saved  # not a periodic one
    rc, stdout, err = run(out, env)
    assert rc == 0, err[-3000:]
    assert f"resumed from iteration {saved}" in stdout
    assert metrics_of(out) == reference["rows"]


# ---------------------------------------------------------------------------- one run per directory, console


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_is_refused_and_the_first_is_untouched(reference):
    rc, _, err = reference["second"]
    assert reference["first_still_running"]
    assert rc == 1
    assert re.search(r"another jaxppo run \(process \d+\) is using the output directory", err)
    assert len(reference["rows"]) == 6 and [r["iteration"] for r in reference["rows"]] == list(range(6))


@pytest.mark.slow
def test_console_has_no_pytorch_advice_or_other_noise(reference):
    stderr = reference["stderr"]
    assert "Disabling PyTorch because PyTorch >= 2.6 is required" in stderr  # transformers saw no usable torch
    assert "PyTorch was not found" not in stderr + reference["stdout"]
    noise = [line for line in stderr.splitlines() if line.strip() and "Disabling PyTorch" not in line]
    assert noise == []


# ---------------------------------------------------------------------------- metrics and TensorBoard files


def test_torn_or_garbage_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    rows = [{"iteration": i, "episode": 16 * (i + 1), "objective/scores": float(i)} for i in range(3)]
    for tail in ('{"iteration": 3, "episode": 64, "objective/sc', "\x00\x00garbage", "[1, 2]"):
        path = tmp_path / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
        with pytest.warns(RuntimeWarning, match=r"metrics.jsonl line 4 is not a complete metrics record"):
            logger = Logger(str(tmp_path), start_iteration=3, report_to=("jsonl",))
        logger.close()
        assert logger.history == rows
        assert [json.loads(line) for line in open(path)] == rows  # rewritten without the torn line


def test_garbage_before_the_last_metrics_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = '{"iteration": 0, "episode": 16}\nnot json\n{"iteration": 1, "episode": 32}\n'
    path.write_text(text)
    with pytest.raises(RunError, match=r"metrics.jsonl line 2 is not a metrics record .* later lines follow"):
        Logger(str(tmp_path), start_iteration=2, report_to=("jsonl",))
    assert path.read_text() == text  # left for the user to look at


def test_metrics_rewrite_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"iteration": i, "episode": i}) + "\n" for i in range(4))
    path.write_text(text)

    def interrupted(*args):  # the rewrite is stopped where a kill would stop it: before the rename
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Logger(str(tmp_path), start_iteration=2, report_to=("jsonl",))
    monkeypatch.undo()
    assert path.read_text() == text
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # no temporary file left behind
    atomic_write_text(str(path), "x\n")
    assert path.read_text() == "x\n" and oct(os.stat(path).st_mode & 0o777) == "0o644"


def test_tensorboard_after_resume_holds_each_iteration_once_in_order(tmp_path):
    straight = small_trainer(tmp_path / "a", iterations=4, checkpoint_every=2, export_final=False).train()
    out = tmp_path / "b"
    small_trainer(out, iterations=4, checkpoint_every=2, export_final=False, report_to="jsonl,tensorboard").train()
    shutil.rmtree(out / "checkpoints" / "4")  # as if killed after iteration 3 was logged, before its checkpoint
    history = small_trainer(out, iterations=4, checkpoint_every=2, export_final=False, report_to="jsonl,tensorboard").train()
    assert comparable(history) == comparable(straight)
    steps = tensorboard_steps(out)
    assert steps["objective/scores"] == [16, 32, 48, 64]
    assert all(s == sorted(set(s)) for s in steps.values())


# ---------------------------------------------------------------------------- checkpoints


def _largest_file(directory):
    files = [os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_unreadable_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, damage):
    straight = small_trainer(tmp_path / "a", iterations=3, export_final=False).train()
    out = tmp_path / "b"
    small_trainer(out, iterations=2, export_final=False).train()
    victim = _largest_file(out / "checkpoints" / "2")
    if damage == "truncate":
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    else:
        os.remove(victim)
    resumed = small_trainer(out, iterations=3, export_final=False)
    with pytest.warns(RuntimeWarning, match=r"checkpoints/2 cannot be read .* moved to .*checkpoints.corrupt/2-"):
        history = resumed.train()
    assert comparable(history) == comparable(straight)
    assert checkpoint.steps(str(out / "checkpoints")) == [2, 3]  # iteration 2 saved again, whole
    assert len(os.listdir(out / "checkpoints.corrupt")) == 1


def test_no_readable_checkpoint_is_an_error_and_the_logs_stay(tmp_path):
    out = tmp_path / "run"
    small_trainer(out, iterations=2, keep_checkpoints=1, export_final=False).train()
    os.remove(_largest_file(out / "checkpoints" / "2"))
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(RunError, match=r"no checkpoint in .*checkpoints can be read"):
        small_trainer(out, iterations=3, export_final=False).train()
    assert (out / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("layout, written_by", [(99, "0.9.0"), (None, None)])
def test_checkpoint_of_another_layout_is_an_error_naming_the_versions(tmp_path, layout, written_by):
    out = tmp_path / "run"
    small_trainer(out, iterations=1, export_final=False).train()
    meta_file = out / "checkpoints" / "1" / "_CHECKPOINT_METADATA"
    meta = json.loads(meta_file.read_text())
    if layout is None:  # as jaxppo 0.1.0 wrote them: no custom metadata
        meta["custom_metadata"] = {}
    else:
        meta["custom_metadata"] = {"jaxppo_checkpoint_layout": layout, "jaxppo_version": written_by}
    meta_file.write_text(json.dumps(meta))
    os.remove(out / "checkpoints" / "1" / checkpoint.CHECKSUMS)  # as those versions wrote them: no checksums
    this = re.escape(jaxppo.__version__)  # the running version is named
    expected = (rf"layout 99 \(written by jaxppo 0.9.0\); this jaxppo {this} reads layout 2" if layout else
                rf"layout 1 \(written by jaxppo 0.1.0\); this jaxppo {this} reads layout 2")
    with pytest.raises(RunError, match=expected):
        small_trainer(out, iterations=2, export_final=False).train()


def _limit_file_size(limit):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.parametrize("target", ["checkpoint", "metrics"])
def test_write_error_while_checkpointing_or_logging_keeps_the_previous_checkpoint(tmp_path, target):
    """A real write error: a file-size limit (RLIMIT_FSIZE; Python ignores SIGXFSZ, so writes
    past it fail with EFBIG), set from a callback in the middle of the run."""
    out = tmp_path / "run"
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def full_disk(iteration, metrics):
        if target == "checkpoint" and iteration == 1:  # the checkpoint of iteration 2 is next
            _limit_file_size(4096)
        if target == "metrics" and iteration == 2:  # the line of iteration 3 is next; no checkpoint at 3
            _limit_file_size(os.path.getsize(out / "metrics.jsonl") + 100)

    trainer = small_trainer(out, iterations=4, checkpoint_every=2, export_final=False, callbacks=[full_disk])
    try:
        if target == "checkpoint":
            match = r"could not save the checkpoint of iteration 2 .*File too large.*\(no earlier checkpoint exists\)"
        else:
            match = r"could not append iteration 3 to .*metrics.jsonl: \[Errno 27\] File too large"
        with pytest.raises(RunError, match=match):
            trainer.train()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, hard)
    expected_steps = [] if target == "checkpoint" else [2]
    assert checkpoint.steps(str(out / "checkpoints")) == expected_steps
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["iteration"] for r in rows] == ([0, 1] if target == "checkpoint" else [0, 1, 2])
    # The same run again (disk freed) resumes and completes.
    history = small_trainer(out, iterations=4, checkpoint_every=2, export_final=False).train()
    assert [r["iteration"] for r in history] == [0, 1, 2, 3]


def test_a_full_disk_during_a_checkpoint_is_one_clear_line_from_the_command(tmp_path, env):
    """The command under a file-size limit its checkpoint outgrows (a full disk as a write
    sees it): it stops with the save's error once, on stderr, and none of the cascade of
    orbax's background threads (before: about a thousand lines of "Event loop is closed"
    tracebacks from the writes still in flight, and absl's ERROR record of the same error)."""
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def limited():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 << 10, hard))

    proc = subprocess.run([sys.executable, "-m", "jaxppo", *CLI_ARGS, "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, preexec_fn=limited, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(re.findall(r"jaxppo: error: could not save the checkpoint of iteration \d+ in .*File too large",
                          proc.stderr)) == 1, proc.stderr[-3000:]
    for noise in ("Traceback", "Event loop is closed", "raised an exception"):
        assert noise not in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------------------- settings, reward faults


def test_resume_with_other_settings_lists_every_difference_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "run"
    small_trainer(out, iterations=1, export_final=False).train()
    assert json.loads((out / "run_settings.json").read_text())["batch"]["batch_size"] == 16
    trainer = small_trainer(out, iterations=2, export_final=False, learning_rate=3e-4, seed=7,
                            ppo=jaxppo.Config.from_settings(batch_size=32, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1),
                            reward_fns=lambda p, r: [0.0] * len(r))
    monkeypatch.setattr(trainer, "step", lambda: pytest.fail("an iteration ran"))
    with pytest.raises(RunError) as err:
        trainer.train()
    message = str(err.value)
    for line in ["BatchConfig.batch_size: was 16, now 32", "OptimizerConfig.learning_rate: was 0.001, now 0.0003",
                 "RunConfig.seed: was 0 (the default), now 7",
                 "reward.function: was 'jaxppo.demo.lowercase_reward', now 'test_faults.test_resume_with_other_"]:
        assert line in message, message
    # Extending a constant-learning-rate run is allowed; resume=False on a used directory is refused.
    assert len(small_trainer(out, iterations=2, export_final=False).train()) == 2
    with pytest.raises(RunError, match="already holds a run .* resume is off"):
        small_trainer(out, iterations=2, export_final=False, resume=False).train()


def test_reward_function_that_raises_keeps_checkpoint_and_metrics(tmp_path):
    calls = []

    def flaky(prompts, responses):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("division by zero")
        return demo.lowercase_reward(prompts, responses)

    out = tmp_path / "run"
    with pytest.raises(RewardError, match=r"iteration 2: reward function '.*flaky' raised ZeroDivisionError: "
                                          r"division by zero .*nothing was updated"):
        small_trainer(out, iterations=4, reward_fns=flaky, export_final=False).train()
    assert [r["iteration"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1]
    resumed = small_trainer(out, iterations=4, reward_fns=flaky, export_final=False)
    assert resumed.directory.open(resumed.run, resumed.settings()).iteration == 2  # the checkpoint of the last complete iteration loads
    resumed.directory.close()


def test_a_run_that_finished_no_iteration_does_not_block_the_corrected_command(tmp_path, capsys):
    def broken(prompts, responses):
        raise KeyError("answer")

    out = tmp_path / "run"
    with pytest.raises(RewardError, match=r"iteration 0: reward function '.*broken' raised KeyError"):
        small_trainer(out, reward_fns=broken, export_final=False).train()
    assert read_metrics(str(out / "metrics.jsonl")) == [] and (out / "run_settings.json").is_file()
    corrected = small_trainer(out, learning_rate=2e-3, export_final=False, resume=False)
    assert corrected.directory.open(corrected.run, corrected.settings()).iteration == 0
    corrected.directory.close()
    said = capsys.readouterr().out
    assert "holds the settings of a run that finished no iteration; this run's replace them" in said
    assert re.search(r"learning_rate: was 0.001, now 0.002", said)
    assert json.loads((out / "run_settings.json").read_text())["optimizer"]["learning_rate"] == 2e-3
    with pytest.raises(RunError, match="holds a run with other settings"):  # once an iteration is logged, it does
        (out / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "episode": 16}) + "\n")
        other = small_trainer(out, learning_rate=3e-3, export_final=False)
        other.directory.open(other.run, other.settings())


def _rows(iterations):
    return [{"iteration": i, "episode": 16 * (i + 1), "objective/scores": float(i)} for i in iterations]


def _log(tmp_path, rows, start):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    logger = Logger(str(tmp_path), start_iteration=start, report_to=("jsonl",))
    logger.close()
    return logger.history, [json.loads(line)["iteration"] for line in open(tmp_path / "metrics.jsonl")]


def test_the_metrics_log_is_checked_against_the_checkpoint_on_resume(tmp_path):
    """One line per iteration before the checkpoint's: a word-for-word repeat is dropped, a
    late start continues with a warning; a second, different line, a missing iteration or
    lines out of order are refused, naming them, before the run starts."""
    with pytest.warns(RuntimeWarning, match=r"repeated the lines of iteration\(s\) \[1\] word for word"):
        history, lines = _log(tmp_path, _rows([0, 1, 2, 1, 3]), 3)
    assert history == _rows([0, 1, 2]) and lines == [0, 1, 2]
    with pytest.warns(RuntimeWarning, match=r"holds no lines of iterations 0 to 1 .* continues from the checkpoint"):
        history, lines = _log(tmp_path, _rows([2, 3]), 4)
    assert history == _rows([2, 3]) and lines == [2, 3]
    refused = [(_rows([0, 1]) + [{**_rows([1])[0], "objective/scores": 9.0}], 2,
                r"two different lines for iteration\(s\) \[1\]"),
               (_rows([0, 2, 3]), 4, r"lacks the lines of iteration\(s\) \[1\] \(the checkpoint is at iteration 4\)"),
               (_rows([0, 1, 2]), 4, r"lacks the lines of iteration\(s\) \[3\]"),
               (_rows([1, 0, 2]), 3, r"holds its lines out of order")]
    for rows, start, message in refused:
        with pytest.raises(RunError, match=message + r".*move .*metrics.jsonl aside"):
            _log(tmp_path, rows, start)


@pytest.mark.parametrize("bad, message", [
    (lambda n: [None] * n, r"returned None at row 0 \(prompt .*, response .*\): every response needs a score"),
    (lambda n: [1.0] * (n - 1) + [float("nan")], r"gave non-finite scores \[nan\] at rows \[15\]"),
    (lambda n: [float("-inf")] + [1.0] * (n - 1), r"gave non-finite scores \[-inf\] at rows \[0\]"),
    (lambda n: ["good"] * n, r"returned 'good' \(str\) at row 0"),
    (lambda n: [1.0] * (n + 1), r"returned 17 scores for 16 responses"),
])
def test_reward_function_returning_garbage_names_function_row_and_value(tmp_path, bad, message):
    def reward(prompts, responses):
        return bad(len(responses))

    trainer = small_trainer(tmp_path, reward_fns=reward)
    before = jax.tree.map(np.asarray, trainer.state.params)
    with pytest.raises(RewardError, match=r"iteration 0: .*'.*reward'.*" + message):
        trainer.step()
    assert trainer.iteration == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_reward_model_nan_scores_are_an_error_naming_iteration_and_rows(tmp_path):
    tokenizer = demo.demo_tokenizer()
    model, params = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)
    rm = jaxppo.models.Model(model.config, kind="reward")
    rm_params = rm.init(jax.random.key(1))
    rm_params["params"]["score"]["kernel"] = jnp.full_like(rm_params["params"]["score"]["kernel"], jnp.nan)
    tc = dict(iterations=1, query_length=32, response_length=6, output_dir=str(tmp_path),
              progress=False, report_to="jsonl", plot=False, export_final=False)
    trainer = jaxppo.Trainer(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8).replace(**tc), policy=(model, params),
                                reward_model=(rm, rm_params), tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS)
    with pytest.raises(RewardError, match=r"iteration 0: the reward model gave non-finite scores \[nan, nan, nan, "
                                          r"nan, nan\] at rows \[0, 1, 2, 3, 4\] \(and 11 more\)"):
        trainer.step()
    assert int(trainer.state.step) == 0


def test_skip_nonfinite_scores_skips_and_counts_the_iteration(tmp_path):
    calls = []

    def sometimes_nan(prompts, responses):
        calls.append(1)
        scores = demo.lowercase_reward(prompts, responses)
        return [float("nan")] + scores[1:] if len(calls) == 2 else scores

    trainer = small_trainer(tmp_path / "run", iterations=4, reward_fns=sometimes_nan, skip_nonfinite_scores=True,
                            export_final=False)
    with pytest.warns(RuntimeWarning, match=r"iteration 1 skipped: reward function .* non-finite scores at rows \[0\]"):
        history = trainer.train()  # ends with the summary, whose first-iterations window holds the skipped one
    assert [r["ppo/updates_applied"] for r in history] == [4, 0, 4, 4]
    assert [r["objective/skipped_nonfinite_scores"] for r in history] == [0, 1, 1, 1]
    assert history[1]["objective/nonfinite_score_rows"] == 1 and "objective/scores" not in history[1]
    assert int(trainer.state.step) == 12 and trainer.run.skipped_iterations == 1
    summary = trainer.summary()
    assert "iterations skipped for non-finite scores: 1" in summary
    # Scored iterations 0, 2, 3: the first-iterations mean is iteration 0's score alone.
    assert f"first 1 iterations {history[0]['objective/scores']:.4f}," in summary


# ---------------------------------------------------------------------------- model directories


def _pickle_bomb(sentinel):
    """Bytes of a pickle that creates `sentinel` when unpickled."""
    import pickle

    class Bomb:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    return pickle.dumps(Bomb())


def test_model_directories_with_pickles_or_remote_code_are_refused_without_running_anything(tmp_path):
    import jaxppo.models as jm
    from jaxppo.cli import main

    config = {"model_type": "gpt2", "vocab_size": 384, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}
    sentinel = tmp_path / "code_ran"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(_pickle_bomb(sentinel))
    with pytest.raises(ValueError, match=r"never unpickles \['pytorch_model.bin'\]"):
        jm.from_pretrained(str(pickled))

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps(dict(config, model_type="evil",
                                                        auto_map={"AutoModelForCausalLM": "modeling_evil.Evil"})))
    (remote / "modeling_evil.py").write_text(f"open({str(sentinel)!r}, 'w')\n")
    (remote / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok_evil.T", None]}}))
    (remote / "tok_evil.py").write_text(f"open({str(sentinel)!r}, 'w')\n")
    with pytest.raises(ValueError, match=r"asks for code shipped with the checkpoint .*never runs code"):
        jm.from_pretrained(str(remote))
    with pytest.raises(ValueError, match=r"tokenizer code shipped with the checkpoint"):
        jm.load_tokenizer(str(remote))
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    for directory in (pickled, remote):
        with pytest.raises(SystemExit, match=r"--model: .*(never unpickles|never runs code)"):
            main(["--model", str(directory), "--prompts", str(prompts), "--output-dir", str(tmp_path / "out")])
    assert not sentinel.exists()
