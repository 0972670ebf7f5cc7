"""The loop around a trainer's iterations: signals, progress, logging, callbacks and the
checkpoint cadence. It drives any trainer that offers `prepare_iteration()` (returning the
`finish()` that applies the update and returns the metrics line), `iteration`,
`iterations`, `save_checkpoint()`, `samples(n)`, `callbacks`, `config` and `tc`; it reads
them and calls them, and writes nothing of the trainer's: each iteration's metrics line
goes to the logger (whose `history` the trainer holds) and to the callbacks."""

from __future__ import annotations

import json
import os

import jax

from jaxppo.config import PPOConfig
from jaxppo.files import atomic_write_text
from jaxppo.rollout.prompts import PromptStreamEnded
from jaxppo.run.callbacks import call_iteration_end
from jaxppo.run.interrupts import interrupts_held, interrupts_raise
from jaxppo.run.logger import Logger
from jaxppo.testing import failpoints
from jaxppo.trainer_config import TrainerConfig

__all__ = ["run_loop", "finish_run", "FINAL_EVAL_FILE"]

FINAL_EVAL_FILE = "final_eval.json"  # the final policy's evaluation (with eval prompts)


def run_loop(trainer, logger: Logger) -> Logger:
    """Run iterations until `trainer.iterations` (or a callback's `Control(stop=True)`, or the
    end of a one-shot prompt stream: a checkpoint is saved and the loop ends),
    logging each line with `logger`; return the (closed) logger. Each iteration's update and its metrics line land together
    (interrupts held); Ctrl-C or SIGTERM saves a checkpoint and raises KeyboardInterrupt."""
    tc = trainer.tc
    progress = None
    try:
        with interrupts_raise():
            # The SIGTERM handler is in place before the first line: a signal from here on
            # is a checkpoint and a clean exit, never the default kill.
            print(_headline(trainer.config, trainer.iterations, trainer.spec.common_prefix), flush=True)
            progress = _Progress(tc, trainer.iterations, trainer.iteration, trainer.config.advantage_estimator)
            while trainer.iteration < trainer.iterations:
                failpoints.pause("iteration", at=trainer.iteration)
                try:
                    finish = trainer.prepare_iteration()
                except PromptStreamEnded as ended:
                    with interrupts_held():
                        trainer.save_checkpoint()
                    print(f"stopped after {trainer.iteration} iterations (of {trainer.iterations}): {ended}. The "
                          "checkpoint holds the stream's position: run again with the stream to continue", flush=True)
                    break
                with interrupts_held(what="this iteration's update"):  # the new state and its line land together
                    metrics = finish()
                    table = _completions(trainer)  # before the metrics: a step's metrics end what it logs
                    table and logger.log_table(metrics["iteration"], "completions", *table)
                    if trainer.last_eval_table is not None:  # every completion of this iteration's evaluation
                        logger.log_table(metrics["iteration"], "eval_completions", *trainer.last_eval_table)
                    logger.log(metrics, echo=progress.bar is None and metrics["iteration"] % tc.log_every == 0)
                progress.update(metrics, trainer.iteration, table)
                control = call_iteration_end(trainer.callbacks, trainer, metrics["iteration"], metrics)
                with interrupts_held():  # a Hugging Face checkpoint every save_hf_every iterations
                    trainer.hf_checkpoints.periodic(trainer.iteration, trainer.state.params)
                if control.checkpoint or (tc.checkpoint_every and trainer.iteration % tc.checkpoint_every == 0):
                    with interrupts_held():  # a signal now would tear the save; it is served after
                        trainer.save_checkpoint()
                if control.stop and trainer.iteration < trainer.iterations:
                    print(f"stopped by a callback after {trainer.iteration} iterations (of {trainer.iterations}); "
                          "run the same command again to continue", flush=True)
                    break
    except KeyboardInterrupt:
        # Held from the first line: a second Ctrl-C after the message below (a user presses
        # twice) must wait for the checkpoint, not abort it.
        with interrupts_held(reraise=False):  # a KeyboardInterrupt is on its way out already
            logger.close()
            progress and progress.close()
            print(f"\ninterrupted: saving a checkpoint at iteration {trainer.iteration} ...", flush=True)
            trainer.save_checkpoint()
        print(f"checkpoint saved at iteration {trainer.iteration}; run the same command again to resume", flush=True)
        raise
    finally:
        logger.close()
        progress and progress.close()
    return logger


def finish_run(trainer, logger: Logger):
    """At the end of a run: a checkpoint (a finished run is not redone), the evaluation of
    the final policy (with eval prompts: `final_eval.json`), the final export, the plot, the
    summary."""
    tc = trainer.tc
    with interrupts_held():
        trainer.save_checkpoint()  # at the end, whatever checkpoint_every says: a finished run is not redone
    if trainer.parts.evaluator is not None and jax.process_index() == 0:
        final = {"iteration": trainer.iteration, **trainer.evaluate()}
        atomic_write_text(os.path.join(tc.output_dir, FINAL_EVAL_FILE), json.dumps(final, indent=1) + "\n")
        print(f"final policy, after {trainer.iteration} iterations: "
              + "  ".join(f"{k[5:]} {v:.4g}" for k, v in final.items() if k.startswith("eval/") and k != "eval/time"),
              flush=True)
    if tc.export_final:
        trainer.export(os.path.join(tc.output_dir, "final_policy"))
        if trainer.policy_model.lora is not None:
            trainer.export_adapter(os.path.join(tc.output_dir, "final_adapter"))
    if tc.plot:
        logger.plot(os.path.join(tc.output_dir, "metrics.png"))
    print(trainer.summary())


class _Progress:
    """The progress bar (tqdm, with `progress`) or plain lines, and the samples."""

    def __init__(self, tc: TrainerConfig, total: int, initial: int, desc: str):
        self.tc, self.bar = tc, None
        if tc.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, metrics: dict, iteration: int, table):
        if self.bar is not None:
            self.bar.update(1)
            if "objective/scores" in metrics:
                self.bar.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                                     **({"kl": f"{metrics['objective/kl']:.3f}"} if "objective/kl" in metrics else {}))
        for row in table[1] if table else ():
            text = f"  [{iteration}] {row[0]!r} -> {row[1]!r}"
            (self.bar.write if self.bar is not None else print)(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _completions(trainer):
    """The completions table (`Trainer.completion_table`) of the iteration just run, every
    `sample_every` iterations; else None."""
    tc = trainer.tc
    if tc.sample_every and tc.num_samples and trainer.iteration % tc.sample_every == 0:
        return trainer.completion_table(tc.num_samples)
    return None


def _headline(c: PPOConfig, iterations: int, common_prefix: int = 0) -> str:
    groups = f" ({c.prompts_per_batch} prompts x {c.num_generations} completions)" if c.num_generations > 1 else ""
    prefix = (f"; the prompts' common prefix ({common_prefix} tokens) runs once (--no-common-prefix: every row)"
              if common_prefix else "")
    return (f"jaxppo: {iterations} iterations x {c.batch_size} episodes{groups}; optimizer updates per iteration = "
            f"ppo_epochs * batch_size / mini_batch_size = {c.ppo_epochs} * {c.batch_size} / {c.mini_batch_size} = "
            f"{c.updates_per_step}; advantages: {c.advantage_estimator}{prefix}")
