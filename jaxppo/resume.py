"""A run's directory and its checkpoints: the settings a resume must match, claiming the
directory before anything compiles, and saving / restoring the `RunState`."""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import numpy as np

from jaxppo import checkpoint
from jaxppo.config import ALGORITHM_FIELDS, PPOConfig
from jaxppo.logger import read_metrics
from jaxppo.run_state import RunState
from jaxppo.rundir import RunError, RunLock, check_settings
from jaxppo.trainer_config import TrainerConfig

__all__ = ["checkpoint_dir", "log_dir", "run_settings", "save", "restore", "open_run"]

_PPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PPOConfig)}
# PPOConfig fields that change how the update computes, not what: they may differ on resume.
_PPO_FREE = ("pack_sequences", "pack_streams", "pack_length")
# TrainerConfig fields that only change output, never results: they may differ on resume.
_FREE = {"output_dir", "resume", "progress", "log_every", "sample_every", "num_samples", "tensorboard", "plot",
         "export_final", "keep_checkpoints", "checkpoint_every", "iterations", "total_episodes",
         "num_slots",  # the sampler's engine: the same tokens either way
         "attention", "hoist_layers",  # how attention and decoding compute: the same results up to rounding
         "environment_workers"}  # threads stepping environments: the same episodes either way
# Recorded only when a run differs from their defaults, so runs saved before they existed
# still resume.
_TRAINER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainerConfig)
                     if f.name in ("max_turns", "turn_length", "environment_timeout", "environment_errors",
                                   "dynamic_sampling", "dynamic_sampling_rounds", "rollout_engine")}


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
    trainer = {k: v for k, v in dataclasses.asdict(tc).items()
               if k not in _FREE and not (k in _TRAINER_DEFAULTS and v == _TRAINER_DEFAULTS[k])}
    if tc.lr_schedule != "constant":
        trainer["iterations"] = iterations
    ppo = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PPO_FREE}
    for name in ALGORITHM_FIELDS:  # recorded only when set: runs saved before they existed still resume
        if ppo[name] == _PPO_DEFAULTS[name]:
            del ppo[name]
    return {"checkpoint_layout": checkpoint.LAYOUT, "ppo": ppo, "trainer": trainer, **description}


def save(run: RunState, tc: TrainerConfig):
    """Save the run state at its iteration (orbax; see `jaxppo.checkpoint`). A write error
    is a `RunError`; the checkpoints saved before stay intact."""
    checkpoint.save(checkpoint_dir(tc), run.iteration, run.checkpoint_tree(), keep=tc.keep_checkpoints)


def restore(run: RunState, tc: TrainerConfig):
    """The run state from the newest readable checkpoint in output_dir, or None if there is
    none. Unreadable ones are warned about and set aside (`jaxppo.checkpoint`)."""
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
        saved_metrics = os.path.join(log_dir(tc), "metrics.jsonl")
        existing = os.path.isfile(saved_metrics) or bool(checkpoint.steps(checkpoint_dir(tc)))
        if not tc.resume and existing:
            raise RunError(f"the output directory {tc.output_dir!r} already holds a run (metrics.jsonl or "
                           "checkpoints) and resume is off; give this run another output_dir, delete the old "
                           "run, or resume it")
        check_settings(tc.output_dir, settings, write=jax.process_index() == 0)
        restored = restore(run, tc) if tc.resume else None
        if restored is not None:
            run = restored
            print(f"resumed from iteration {run.iteration} ({checkpoint_dir(tc)})")
        elif existing and read_metrics(saved_metrics):
            warnings.warn(f"{tc.output_dir!r} holds logged iterations but no checkpoint (none was saved before the "
                          "run stopped): starting again from iteration 0 with the same settings; the logged "
                          "iterations are recomputed", RuntimeWarning, stacklevel=4)
    except BaseException:
        lock.release()
        raise
    return lock, run
