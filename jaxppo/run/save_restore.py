"""A run's directory and its checkpoints: the settings a resume must match, claiming the
directory before anything compiles, and saving / restoring the `RunState`."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import warnings
from typing import Optional

import jax
import numpy as np

from jaxppo.config import PPOConfig
from jaxppo.errors import RunError
from jaxppo.run import checkpoints as checkpoint
from jaxppo.files import atomic_write_text
from jaxppo.run.directory import SETTINGS_FILE, RunLock, check_settings, named_checkpoint
from jaxppo.run.logger import read_metrics
from jaxppo.tracking.local import METRICS_FILE, TABLE_SUFFIX, read_table
from jaxppo.run.state import RunState
from jaxppo.trainer_config import TrainerConfig

__all__ = ["checkpoint_dir", "log_dir", "run_settings", "save", "restore", "open_run", "Resumable", "adopt"]

def _recorded(config) -> dict:
    """The fields of a config a resumed run must match (`jaxppo.config.setting`): every
    field but the "free" ones, and a "same_if_set" one only when it is not its default."""
    out = {}
    for field in dataclasses.fields(config):
        rule, value = field.metadata.get("on_resume", "same"), getattr(config, field.name)
        if rule == "same" or (rule == "same_if_set" and value != field.default):
            out[field.name] = value
    return out


def checkpoint_dir(tc: TrainerConfig) -> str:
    return os.path.abspath(os.path.join(tc.output_dir, "checkpoints"))


def log_dir(tc: TrainerConfig) -> str:
    """Process 0 logs to output_dir; in multi-host runs the others to their own subfolder."""
    if jax.process_index() == 0:
        return tc.output_dir
    return os.path.join(tc.output_dir, f"process_{jax.process_index()}")


def run_settings(config: PPOConfig, tc: TrainerConfig, iterations: int, description: dict) -> dict:
    """What must stay the same for a resumed run to continue this one: the checkpoint
    layout, every `PPOConfig` field, the `TrainerConfig` fields that shape the run, and
    `description` (models, reward, tokenizer, prompts). Output-only fields may change; so
    may `iterations`/`total_episodes` under a constant learning rate (extending a run)."""
    trainer = _recorded(tc)
    if tc.lr_schedule != "constant" or tc.warmup_ratio:  # the schedule's length: extending the run would change it
        trainer["iterations"] = iterations
    ppo = _recorded(config)
    return {"checkpoint_layout": checkpoint.LAYOUT, "ppo": ppo, "trainer": trainer, **description}


def save(run: RunState, tc: TrainerConfig):
    """Save the run state at its iteration (orbax; see `jaxppo.run.checkpoints`). A write error
    is a `RunError`; the checkpoints saved before stay intact."""
    checkpoint.save(checkpoint_dir(tc), run.iteration, run.checkpoint_tree(), keep=tc.keep_checkpoints)


def restore(run: RunState, tc: TrainerConfig):
    """The run state from the newest readable checkpoint in output_dir, or None if there is
    none. Unreadable ones are warned about and set aside (`jaxppo.run.checkpoints`)."""
    template = run.checkpoint_tree()
    found = checkpoint.restore_latest(checkpoint_dir(tc), template)
    if found is None:
        return None
    _, tree = found
    if not np.array_equal(np.asarray(tree["key"]), np.asarray(template["key"])):
        raise RunError(f"the checkpoint in {tc.output_dir!r} was written with another seed; "
                       "use the same seed to resume, or another output_dir")
    return run.restored(tree)


def open_run(run: RunState, tc: TrainerConfig, settings: dict):
    """Claim output_dir (a lock: a second run on it is refused), check the saved settings,
    and restore the newest checkpoint when resuming: all before any compilation. Returns
    (the lock, to release when the run ends; the run state to start from)."""
    lock = RunLock(log_dir(tc)).acquire()
    try:
        if tc.resume_from is not None and tc.resume and jax.process_index() == 0:
            adopt(tc.resume_from, tc.output_dir, settings)
        saved_metrics = os.path.join(log_dir(tc), "metrics.jsonl")
        with warnings.catch_warnings():  # a torn last line: the logger warns once, when it rewrites the file
            warnings.simplefilter("ignore", RuntimeWarning)
            logged = bool(read_metrics(saved_metrics))
        # A run that finished no iteration (its first failed or was stopped) left nothing a
        # new run could be mixed with: it neither blocks a corrected command nor needs resume.
        existing = logged or bool(checkpoint.steps(checkpoint_dir(tc)))
        if not tc.resume and existing:
            raise RunError(f"the output directory {tc.output_dir!r} already holds a run (metrics.jsonl or "
                           "checkpoints) and resume is off; give this run another output_dir, delete the old "
                           "run, or resume it")
        check_settings(tc.output_dir, settings, write=jax.process_index() == 0, replace=not existing)
        restored = restore(run, tc) if tc.resume else None
        if restored is not None:
            run = restored
            print(f"resumed from iteration {run.iteration} ({checkpoint_dir(tc)})")
        elif logged:
            warnings.warn(f"{tc.output_dir!r} holds logged iterations but no checkpoint (none was saved before the "
                          "run stopped): starting again from iteration 0 with the same settings; the logged "
                          "iterations are recomputed", RuntimeWarning, stacklevel=4)
    except BaseException:
        lock.release()
        raise
    return lock, run


class Resumable:
    """The run-directory side of a trainer (`jaxppo.Trainer` is one): the settings a resumed
    run must match, claiming the directory, saving and restoring the run state. Reads the
    trainer's `run` (`RunState`), `config`, `tc`, `iterations` and `description` (models,
    reward, tokenizer, prompts); `open_run` and `restore_checkpoint` replace `run`."""

    def settings(self) -> dict:
        """What a resumed run must match (see `run_settings`)."""
        return run_settings(self.config, self.tc, self.iterations, self.description)

    @property
    def checkpoint_dir(self) -> str:
        return checkpoint_dir(self.tc)

    def open_run(self) -> int:
        """Claim output_dir, check the saved settings and restore the newest checkpoint (the
        module's `open_run`); return the first iteration to run. `close_run` releases the
        directory."""
        self._lock, self.run = open_run(self.run, self.tc, self.settings())
        return self.iteration

    def close_run(self):
        """Release the directory `open_run` claimed."""
        self._lock.release()

    def save_checkpoint(self):
        """Save the run state at the current iteration (the module's `save`)."""
        save(self.run, self.tc)

    def restore_checkpoint(self) -> bool:
        """Restore the newest readable checkpoint, if any; True if one was restored."""
        restored = restore(self.run, self.tc)
        self.run = self.run if restored is None else restored
        return restored is not None


def adopt(source: str, output_dir: str, settings: dict) -> Optional[int]:
    """`TrainerConfig.resume_from`: start `output_dir` from another run's checkpoint. `source`
    is a run directory (its newest checkpoint whose checksums verify) or one of its
    checkpoints (`<run>/checkpoints/<step>`). When `output_dir` holds no checkpoint yet, the
    checkpoint, the run's saved settings and its metrics and table lines before the
    checkpoint are copied in (the source is only read), so the automatic resume continues
    from it; settings that differ from the source run's (`settings`, as `check_settings`
    compares them) are refused before anything is copied. Once `output_dir` has checkpoints
    of its own, it resumes from them and `source` is not read. Returns the step adopted, or
    None."""
    own = os.path.join(output_dir, "checkpoints")
    if checkpoint.steps(own):
        return None
    run_dir, step = _adopted_checkpoint(source)
    try:
        check_settings(run_dir, settings, write=False)
    except RunError as err:
        raise RunError(f"resume_from={source!r}: {err}") from None
    os.makedirs(own, exist_ok=True)
    settings = os.path.join(run_dir, SETTINGS_FILE)
    if os.path.isfile(settings) and not os.path.isfile(os.path.join(output_dir, SETTINGS_FILE)):
        shutil.copyfile(settings, os.path.join(output_dir, SETTINGS_FILE))
    for name in sorted(os.listdir(run_dir)):
        if name == METRICS_FILE or name.endswith(TABLE_SUFFIX):
            rows = [r for r in read_table(os.path.join(run_dir, name)) if r["iteration"] < step]
            if not os.path.isfile(os.path.join(output_dir, name)):
                atomic_write_text(os.path.join(output_dir, name), "".join(json.dumps(r) + "\n" for r in rows))
    tmp = tempfile.mkdtemp(dir=own, prefix=f".adopt-{step}-")
    shutil.copytree(os.path.join(run_dir, "checkpoints", str(step)), os.path.join(tmp, str(step)))
    os.replace(os.path.join(tmp, str(step)), os.path.join(own, str(step)))  # the checkpoint lands last, whole
    os.rmdir(tmp)
    print(f"starting from {os.path.join(run_dir, 'checkpoints', str(step))} (copied into {own})", flush=True)
    return step


def _adopted_checkpoint(source: str):
    """(run directory, step) that `resume_from=source` names; a `RunError` saying what a
    valid value is otherwise."""
    source = os.path.abspath(os.fspath(source))
    run_dir, step = named_checkpoint(source)
    if step is not None:
        parent = os.path.dirname(source)
        try:
            checkpoint.verify(source, expected=True)
        except (checkpoint.ChecksumError, OSError) as err:
            raise RunError(f"resume_from={source!r}: the checkpoint does not verify ({err}); give another of "
                           f"{parent}'s checkpoints, or the run directory (its newest that verifies)") from None
        return run_dir, step
    folder = os.path.join(source, "checkpoints")
    steps = sorted((int(n) for n in os.listdir(folder) if n.isdigit()), reverse=True) if os.path.isdir(folder) else []
    for step in steps:
        try:
            checkpoint.verify(os.path.join(folder, str(step)), expected=True)
            return source, step
        except (checkpoint.ChecksumError, OSError) as err:
            warnings.warn(f"resume_from: checkpoint {os.path.join(folder, str(step))} does not verify ({err}); trying "
                          "the one before", RuntimeWarning, stacklevel=4)
    raise RunError(f"resume_from={source!r} is neither a run directory with a readable checkpoint "
                   "(<run>/checkpoints/<step>) nor one of its checkpoints; give the output_dir of a run that saved a "
                   "checkpoint, or its checkpoints/<step> folder")
