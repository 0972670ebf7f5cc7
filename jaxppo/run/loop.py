"""The loop around a run's iterations: signals, progress, logging, the callbacks and the
checkpoint cadence. It is given the run in progress and its collaborators, not a trainer:

    session      the run's parts and the state it has reached (`jaxppo.run.session.Session`,
                 or the reward model's): it prepares and completes each iteration, installing
                 the new state (see `jaxppo.run.session` for what the loop asks of it)
    directory    RunDirectory    checkpoints (`save`)
    logger       Logger          the metrics lines and tables, to every tracker
    hooks        Hooks           the callbacks (`on_iteration_end` may stop the run or ask for a
                                 checkpoint)
    run_config   RunConfig       the cadences: log_every, checkpoint_every, progress

Each iteration's update and its metrics line land together (interrupts held); Ctrl-C or
SIGTERM saves a checkpoint and raises KeyboardInterrupt."""

from __future__ import annotations

import os

from jaxppo.rollout.prompts import PromptStreamEnded
from jaxppo.run.callbacks import Hooks
from jaxppo.run.interrupts import interrupts_held, interrupts_raise
from jaxppo.run.logger import Logger
from jaxppo.testing import failpoints

__all__ = ["run_loop", "finish_run", "Progress"]


def run_loop(session, *, directory, logger: Logger, hooks: Hooks, run_config):
    """Run iterations until `session.total` (or a callback's `Control(stop=True)`, or the
    end of a one-shot prompt stream: a checkpoint is saved and the loop ends), logging each
    line with `logger` (see the module's docstring for the collaborators); return the final
    run state. The logger is closed at the end."""
    total = session.total
    progress = None
    try:
        with interrupts_raise():
            # The SIGTERM handler is in place before the first line: a signal from here on
            # is a checkpoint and a clean exit, never the default kill.
            print(session.title, flush=True)
            progress = Progress(run_config, total, session.run.iteration, session.description)
            while session.run.iteration < total:
                failpoints.pause("iteration", at=session.run.iteration)
                try:
                    prepared = session.prepare()
                except PromptStreamEnded as ended:
                    with interrupts_held():
                        directory.save(session.run)
                    print(f"stopped after {session.run.iteration} iterations (of {total}): {ended}. The checkpoint "
                          "holds the stream's position: run again with the stream to continue", flush=True)
                    break
                with interrupts_held(what="this iteration's update"):  # the new state and its line land together
                    outcome = session.complete(prepared)
                    metrics = outcome.metrics
                    logged = session.tables(outcome)  # before the metrics: a step's metrics end what it logs
                    for name, columns, rows in logged:
                        logger.log_table(metrics["iteration"], name, columns, rows)
                    logger.log(metrics, echo=progress.bar is None and metrics["iteration"] % run_config.log_every == 0)
                run = session.run
                progress.update(metrics, run.iteration, next((t for t in logged if t[0] == "completions"), None))
                control = hooks.iteration_end(metrics["iteration"], metrics)
                with interrupts_held():  # e.g. a Hugging Face checkpoint every save_hf_every iterations
                    session.periodic(run)
                every = run_config.checkpoint_every
                if control.checkpoint or (every and run.iteration % every == 0):
                    with interrupts_held():  # a signal now would tear the save; it is served after
                        directory.save(run)
                if control.stop and run.iteration < total:
                    print(f"stopped by a callback after {run.iteration} iterations (of {total}); run the same "
                          "command again to continue", flush=True)
                    break
    except KeyboardInterrupt:
        # Held from the first line: a second Ctrl-C after the message below (a user presses
        # twice) must wait for the checkpoint, not abort it.
        with interrupts_held(reraise=False):  # a KeyboardInterrupt is on its way out already
            logger.close()
            progress and progress.close()
            print(f"\ninterrupted: saving a checkpoint at iteration {session.run.iteration} ...", flush=True)
            directory.save(session.run)
        print(f"checkpoint saved at iteration {session.run.iteration}; run the same command again to resume",
              flush=True)
        raise
    finally:
        logger.close()
        progress and progress.close()
    return session.run


class Progress:
    """The progress bar (tqdm, with `progress`) or plain lines, and the samples."""

    POSTFIX = (("objective/scores", "score"), ("objective/kl", "kl"), ("loss", "loss"), ("rewards/accuracy", "accuracy"))

    def __init__(self, run_config, total: int, initial: int, desc: str):
        self.bar = None
        if run_config.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, metrics: dict, iteration: int, table):
        if self.bar is not None:
            self.bar.update(1)
            shown = {name: f"{metrics[key]:.3f}" for key, name in self.POSTFIX if key in metrics}
            if shown:
                self.bar.set_postfix(**shown)
        for row in table[2] if table else ():
            text = f"  [{iteration}] {row[0]!r} -> {row[1]!r}"
            (self.bar.write if self.bar is not None else print)(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def finish_run(session, *, directory, logger: Logger, run_config) -> None:
    """At the end of a run: a checkpoint (a finished run is not redone), what the session
    writes at its end (`session.finish`: the final policy's evaluation and export, the
    reward model's export), the plot, the summary."""
    with interrupts_held():
        directory.save(session.run)  # at the end, whatever checkpoint_every says: a finished run is not redone
    session.finish(run_config)
    if run_config.plot:
        logger.plot(os.path.join(run_config.output_dir, "metrics.png"), session.panels)
    print(session.summary(logger.history))
