"""The loop around a run's iterations: signals, progress, logging, the callbacks and the
checkpoint cadence. It is given its collaborators, not the trainer:

    prepare()      -> finish       the next iteration up to its update (`Trainer.prepare_iteration`);
                                   finish() runs the update, installs the new run state and
                                   returns the iteration's `Outcome`
    current()      -> RunState     the run state now
    directory      RunDirectory    checkpoints (`save`)
    outputs        Outputs         Hugging Face checkpoints during the run, completion tables
    logger         Logger          the metrics lines and tables, to every tracker
    notify(i, m)   -> Control      the callbacks' `on_iteration_end`
    tables(o)      -> [(name, columns, rows)]   what an iteration logs besides its line

Each iteration's update and its metrics line land together (interrupts held); Ctrl-C or
SIGTERM saves a checkpoint and raises KeyboardInterrupt."""

from __future__ import annotations

from typing import Callable, Optional

from jaxppo.rollout.prompts import PromptStreamEnded
from jaxppo.run.interrupts import interrupts_held, interrupts_raise
from jaxppo.run.logger import Logger
from jaxppo.testing import failpoints

__all__ = ["run_loop", "finish_run", "headline", "Progress", "FINAL_EVAL_FILE"]


def run_loop(*, prepare: Callable, current: Callable, directory, outputs, logger: Logger, notify: Callable,
             tables: Callable, run_config, title: str, description: str) -> Logger:
    """Run iterations until `run_config.iterations` (or a callback's `Control(stop=True)`, or
    the end of a one-shot prompt stream: a checkpoint is saved and the loop ends), logging
    each line with `logger` (see the module's docstring for the collaborators); return the
    (closed) logger. `title` is the first line printed, `description` the progress bar's."""
    total = run_config.iterations
    progress = None
    try:
        with interrupts_raise():
            # The SIGTERM handler is in place before the first line: a signal from here on
            # is a checkpoint and a clean exit, never the default kill.
            print(title, flush=True)
            progress = Progress(run_config, total, current().iteration, description)
            while current().iteration < total:
                failpoints.pause("iteration", at=current().iteration)
                try:
                    finish = prepare()
                except PromptStreamEnded as ended:
                    with interrupts_held():
                        directory.save(current())
                    print(f"stopped after {current().iteration} iterations (of {total}): {ended}. The checkpoint "
                          "holds the stream's position: run again with the stream to continue", flush=True)
                    break
                with interrupts_held(what="this iteration's update"):  # the new state and its line land together
                    outcome = finish()
                    metrics = outcome.metrics
                    logged = tables(outcome)  # before the metrics: a step's metrics end what it logs
                    for name, columns, rows in logged:
                        logger.log_table(metrics["iteration"], name, columns, rows)
                    logger.log(metrics, echo=progress.bar is None and metrics["iteration"] % run_config.log_every == 0)
                progress.update(metrics, current().iteration, next((t for t in logged if t[0] == "completions"), None))
                control = notify(metrics["iteration"], metrics)
                run = current()
                with interrupts_held():  # a Hugging Face checkpoint every save_hf_every iterations
                    outputs.hf.periodic(run.iteration, run.train.params)
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
            print(f"\ninterrupted: saving a checkpoint at iteration {current().iteration} ...", flush=True)
            directory.save(current())
        print(f"checkpoint saved at iteration {current().iteration}; run the same command again to resume", flush=True)
        raise
    finally:
        logger.close()
        progress and progress.close()
    return logger


class Progress:
    """The progress bar (tqdm, with `progress`) or plain lines, and the samples."""

    def __init__(self, run_config, total: int, initial: int, desc: str):
        self.bar = None
        if run_config.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, metrics: dict, iteration: int, table):
        if self.bar is not None:
            self.bar.update(1)
            if "objective/scores" in metrics:
                self.bar.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                                     **({"kl": f"{metrics['objective/kl']:.3f}"} if "objective/kl" in metrics else {}))
        for row in table[2] if table else ():
            text = f"  [{iteration}] {row[0]!r} -> {row[1]!r}"
            (self.bar.write if self.bar is not None else print)(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def headline(config, common_prefix: int = 0) -> str:
    """The run's first line: its length, its sizes and the update count they give."""
    b, g = config.batch, config.advantages.num_generations
    groups = f" ({config.prompts_per_batch} prompts x {g} completions)" if g > 1 else ""
    prefix = (f"; the prompts' common prefix ({common_prefix} tokens) runs once (--no-common-prefix: every row)"
              if common_prefix else "")
    return (f"jaxppo: {config.run.iterations} iterations x {b.batch_size} episodes{groups}; optimizer updates per "
            f"iteration = ppo_epochs * batch_size / mini_batch_size = {b.ppo_epochs} * {b.batch_size} / "
            f"{b.mini_batch_size} = {b.updates_per_step}; advantages: {config.advantages.advantage_estimator}{prefix}")


FINAL_EVAL_FILE = "final_eval.json"  # the final policy's evaluation (with eval prompts)


def finish_run(*, current: Callable, directory, outputs, logger: Logger, evaluate: Optional[Callable], run_config,
               summary: Callable):
    """At the end of a run: a checkpoint (a finished run is not redone), the evaluation of
    the final policy (`evaluate()`, with eval prompts: `final_eval.json`), the final export,
    the plot, the summary (`summary()`)."""
    import json
    import os

    import jax

    from jaxppo.files import atomic_write_text

    run = current()
    with interrupts_held():
        directory.save(run)  # at the end, whatever checkpoint_every says: a finished run is not redone
    if evaluate is not None and jax.process_index() == 0:
        final = {"iteration": run.iteration, **evaluate()}
        atomic_write_text(os.path.join(run_config.output_dir, FINAL_EVAL_FILE), json.dumps(final, indent=1) + "\n")
        print(f"final policy, after {run.iteration} iterations: "
              + "  ".join(f"{k[5:]} {v:.4g}" for k, v in final.items() if k.startswith("eval/") and k != "eval/time"),
              flush=True)
    if run_config.export_final:
        outputs.final(run.train.params, run_config.output_dir)
    if run_config.plot:
        logger.plot(os.path.join(run_config.output_dir, "metrics.png"))
    print(summary())
