"""Checkpoints and the run directory of a `PPOTrainer`: what a checkpoint holds, saving
and restoring it, the settings a resume must match, and claiming the directory before
anything compiles. A mixin: the trainer's loop calls these; they read and set its state."""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import checkpoint
from jaxppo import math as ppo_math
from jaxppo.config import ALGORITHM_FIELDS, PPOConfig
from jaxppo.logger import read_metrics
from jaxppo.rundir import RunError, RunLock, check_settings

__all__ = ["CheckpointedRun"]

_PPO_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PPOConfig)}


class CheckpointedRun:
    """Checkpoint and run-directory methods of `PPOTrainer` (it provides state, kl_state,
    score_moments, iteration, skipped_iterations, tc, config, iterations, _base_key and
    _describe)."""

    def _checkpoint_tree(self):
        return {
            # The trained params only: with LoRA, the adapters (and critic), not the frozen
            # base, which the run loads again from its checkpoint path.
            "params": self.state.trained_params(),
            "opt_state": self.state.opt_state,
            "step": self.state.step,
            "skipped_nonfinite": self.state.skipped_nonfinite,
            # Small host values as numpy: every process holds them whole (orbax cannot save
            # process-local jax arrays in multi-host runs).
            "kl": tuple(np.asarray(x) for x in self.kl_state),
            "score_moments": tuple(np.asarray(x) for x in self.score_moments),
            "iteration": np.asarray(self.iteration, np.int32),
            "skipped_iterations": np.asarray(self.skipped_iterations, np.int32),
            "key": np.asarray(jax.random.key_data(self._base_key)),
        }

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(os.path.join(self.tc.output_dir, "checkpoints"))

    def save_checkpoint(self):
        """Save params, optimizer state, KL controller, score statistics, data position and
        key at the current iteration (orbax; see `jaxppo.checkpoint`). A write error is a
        `RunError`; the checkpoints saved before stay intact."""
        checkpoint.save(self.checkpoint_dir, self.iteration, self._checkpoint_tree(), keep=self.tc.keep_checkpoints)

    def restore_checkpoint(self) -> bool:
        """Restore the newest readable checkpoint in output_dir, if any; True if one was
        restored. Unreadable ones are warned about and set aside (`jaxppo.checkpoint`)."""
        template = self._checkpoint_tree()
        found = checkpoint.restore_latest(self.checkpoint_dir, template)
        if found is None:
            return False
        _, restored = found
        if not np.array_equal(np.asarray(restored["key"]), np.asarray(template["key"])):
            raise RunError(f"the checkpoint in {self.tc.output_dir!r} was written with another seed; "
                           "use the same seed to resume, or another output_dir")
        self.state = self.state.with_trained(restored["params"]).replace(
            opt_state=restored["opt_state"], step=restored["step"], skipped_nonfinite=restored["skipped_nonfinite"])
        self.kl_state = ppo_math.KLControllerState(*(jnp.asarray(x, jnp.float32) for x in restored["kl"]))
        self.score_moments = ppo_math.RunningMoments(*(jnp.asarray(x, jnp.float32) for x in restored["score_moments"]))
        self.iteration = int(restored["iteration"])
        self.skipped_iterations = int(restored["skipped_iterations"])
        return True

    def settings(self) -> dict:
        """What must stay the same for a resumed run to continue this one: the checkpoint
        layout, every `PPOConfig` field, the `TrainerConfig` fields that shape the run, the
        models, reward, tokenizer and prompts. Output-only fields (logging, plots, checkpoint
        cadence, output_dir) may change; so may `iterations`/`total_episodes` under a
        constant learning rate (extending a run), since only decaying schedules depend on it."""
        free = {"output_dir", "resume", "progress", "log_every", "sample_every", "num_samples", "tensorboard", "plot",
                "export_final", "keep_checkpoints", "checkpoint_every", "iterations", "total_episodes"}
        trainer = {k: v for k, v in dataclasses.asdict(self.tc).items() if k not in free}
        if self.tc.lr_schedule != "constant":
            trainer["iterations"] = self.iterations
        ppo = dataclasses.asdict(self.config)
        for name in ALGORITHM_FIELDS:  # recorded only when set: runs saved before they existed still resume
            if ppo[name] == _PPO_DEFAULTS[name]:
                del ppo[name]
        return {"checkpoint_layout": checkpoint.LAYOUT, "ppo": ppo, "trainer": trainer, **self._describe}

    # ------------------------------------------------------------------ the loop

    def _open_run(self) -> int:
        """Claim output_dir (lock), check the saved settings, and restore the newest
        checkpoint: all before any compilation. Returns the first iteration to run."""
        tc = self.tc
        log_dir = self._log_dir()
        self._lock = RunLock(log_dir).acquire()
        try:
            saved_metrics = os.path.join(log_dir, "metrics.jsonl")
            existing = os.path.isfile(saved_metrics) or bool(checkpoint.steps(self.checkpoint_dir))
            if not tc.resume and existing:
                raise RunError(f"the output directory {tc.output_dir!r} already holds a run (metrics.jsonl or "
                               "checkpoints) and resume is off; give this run another output_dir, delete the old "
                               "run, or resume it")
            check_settings(tc.output_dir, self.settings(), write=jax.process_index() == 0)
            if tc.resume and self.restore_checkpoint():
                print(f"resumed from iteration {self.iteration} ({self.checkpoint_dir})")
            elif existing and read_metrics(saved_metrics):
                warnings.warn(f"{tc.output_dir!r} holds logged iterations but no checkpoint (none was saved before the "
                              "run stopped): starting again from iteration 0 with the same settings; the logged "
                              "iterations are recomputed", RuntimeWarning, stacklevel=3)
        except BaseException:
            self._lock.release()
            raise
        return self.iteration

    def _log_dir(self) -> str:
        # In multi-host runs process 0 logs to output_dir, the others to their own subfolder.
        if jax.process_index() == 0:
            return self.tc.output_dir
        return os.path.join(self.tc.output_dir, f"process_{jax.process_index()}")
