"""A run in progress (`Session`): the run's parts and the state it has reached, which is
what the loop (`jaxppo.run.loop.run_loop`) walks and what a `Trainer` shows.

What the loop asks of a session (the reward model's, `jaxppo.run.reward_model`, offers the
same):

    run                     the `RunState` now (what a checkpoint holds)
    total                   the iteration the run ends at
    title, description      the run's first line, the progress bar's label
    prepare()  -> Prepared  the next iteration up to its update; writes nothing
    complete(p) -> Outcome  its update and metrics line; the new state installed
    tables(outcome)         [(name, columns, rows)]: what an iteration logs besides its line
    periodic(run)           what is written every so many iterations besides checkpoints
    finish(run_config)      what the end of a run writes besides its last checkpoint
    summary(history)        the run's last words; panels: what its plot shows
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax

from jaxppo.run import iteration, report
from jaxppo.run.iteration import Outcome, Prepared
from jaxppo.run.logger import POLICY_PANELS
from jaxppo.run.parts import RunParts
from jaxppo.run.state import RunState

__all__ = ["Session", "FINAL_EVAL_FILE"]

FINAL_EVAL_FILE = "final_eval.json"  # the final policy's evaluation (with eval prompts)


@dataclasses.dataclass
class Session:
    """The policy's run in progress: `parts` (`RunParts`; its update's compile started by
    `precompile`), `run` (the `RunState` reached) and `last` (the last iteration's
    `Outcome`, or None)."""

    parts: RunParts
    run: RunState
    last: Optional[Outcome] = None
    panels = POLICY_PANELS  # what the run's plot shows (`Logger.plot`)

    @property
    def total(self) -> int:
        return self.parts.config.run.iterations

    @property
    def title(self) -> str:
        return headline(self.parts.config, self.parts.spec.common_prefix)

    @property
    def description(self) -> str:
        return self.parts.config.advantages.advantage_estimator

    def precompile(self) -> None:
        """Start the update's compile in the background (once; `RunParts.precompiled`)."""
        self.parts = self.parts.precompiled(self.run)

    def prepare(self) -> Prepared:
        """The next iteration up to its update (`jaxppo.run.iteration.prepare`): the session
        is as it was until `complete`."""
        self.precompile()  # where the run has not started it already
        return iteration.prepare(self.run, self.parts)

    def complete(self, prepared: Prepared) -> Outcome:
        """The prepared iteration's update (`jaxppo.run.iteration.complete`: the old train
        state's buffers are donated), its outcome installed."""
        self.last = iteration.complete(prepared, self.parts)
        self.run = self.last.run
        return self.last

    def step(self) -> Outcome:
        """One whole iteration."""
        return self.complete(self.prepare())

    def tables(self, outcome: Outcome) -> list:
        return self.parts.outputs.tables(self.parts.table.texts, outcome, self.run.iteration)

    def periodic(self, run: RunState) -> None:
        self.parts.outputs.hf.periodic(run.iteration, run.train.params)

    def evaluate(self) -> dict:
        """The `eval/...` metrics of the current policy (`jaxppo.run.evaluation`)."""
        if self.parts.evaluator is None:
            raise RuntimeError("this Trainer has no eval_prompts to evaluate on")
        return self.parts.evaluator.evaluate(self.run.train.params, self.run.key, self.run.iteration,
                                             self.parts.reward_params)[0]

    def finish(self, run_config) -> None:
        """The evaluation of the final policy (with eval prompts: `final_eval.json`) and its
        export (`export_final`)."""
        from jaxppo.files import atomic_write_text

        run = self.run
        if self.parts.evaluator is not None and jax.process_index() == 0:
            final = {"iteration": run.iteration, **self.evaluate()}
            atomic_write_text(os.path.join(run_config.output_dir, FINAL_EVAL_FILE), json.dumps(final, indent=1) + "\n")
            print(f"final policy, after {run.iteration} iterations: "
                  + "  ".join(f"{k[5:]} {v:.4g}" for k, v in final.items() if k.startswith("eval/") and k != "eval/time"),
                  flush=True)
        if run_config.export_final:
            self.parts.outputs.final(run.train.params, run_config.output_dir)

    def summary(self, history: list) -> str:
        p = self.parts
        return report.summary(history, p.config, self.run, p.models.policy_model,
                              p.spec.policy_params(self.run.train.params))


def headline(config, common_prefix: int = 0) -> str:
    """The run's first line: its length, its sizes and the update count they give."""
    b, g = config.batch, config.batch.num_generations
    groups = f" ({config.prompts_per_batch} prompts x {g} completions)" if g > 1 else ""
    prefix = (f"; the prompts' common prefix ({common_prefix} tokens) runs once (--no-common-prefix: every row)"
              if common_prefix else "")
    return (f"jaxppo: {config.run.iterations} iterations x {b.batch_size} episodes{groups}; optimizer updates per "
            f"iteration = ppo_epochs * batch_size / mini_batch_size = {b.ppo_epochs} * {b.batch_size} / "
            f"{b.mini_batch_size} = {b.updates_per_step}; advantages: {config.advantages.advantage_estimator}{prefix}")
