"""One iteration as values: everything before its update (`prepare` -> `Prepared`), and the
update's result (`complete` -> `Outcome`: the run state after it, its metrics line and the
samples behind it). The `Trainer` installs an `Outcome`; nothing here holds a trainer.

    prepared = prepare(run, collect, spec, ref_params, reward_params, mesh)
      prompts, samples, host scores (`collect`), the rollout built on the device
    outcome = complete(prepared, train_step=..., config=..., ...)
      the update (or the skip of an iteration with non-finite scores), its metrics
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from jaxppo.config import PPOConfig
from jaxppo.rollout.prompts import PromptBatch
from jaxppo.rollout.rewards import HostScores
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.run import report, stages
from jaxppo.run.state import RunState

__all__ = ["Prepared", "Outcome", "prepare", "evaluate", "check_scores", "complete"]


class Prepared(NamedTuple):
    """An iteration up to its update: what `prepare` computed, and read nothing else of.

    iteration: its index; run: the `RunState` it starts from; batch: its `PromptBatch`;
    gen: the samples (`GenerationOutput`, or a multi-turn `EpisodeOutput`); episodes: the
    `Episodes` (multi-turn) or None; scores: the host scores (`HostScores`); extra: metrics
    of the collection (dynamic sampling, staleness); consumed: the prompts consumed (the
    run state's count); built: the rollout and its statistics (`jaxppo.run.stages.Built`);
    bad: rows whose raw score is not finite; train_key: the update's key; times: (start,
    host scores done, rollout built) in `time.perf_counter` seconds."""

    iteration: int
    run: RunState
    batch: PromptBatch
    gen: Any
    episodes: Any
    scores: HostScores
    extra: dict
    consumed: Any
    built: stages.Built
    bad: np.ndarray
    train_key: Any
    times: tuple


class Outcome(NamedTuple):
    """What an iteration gives: the run state after it, its metrics line (host floats, its
    evaluation's included), the samples behind it (prompt rows, `GenerationOutput`), for
    `Trainer.samples`, their scores (the combined raw scores (B,) on the host, the text
    reward functions' `{name: (values, given)}`), for `Trainer.completion_table`, the
    table of its evaluation's completions ((columns, rows), or None), and each row's
    advantage (B,) (`stages.row_advantages`, a device array; None when not asked for)."""

    run: RunState
    metrics: dict
    samples: tuple
    scores: tuple = (None, {})
    eval_table: Optional[tuple] = None
    advantages: Any = None


def evaluate(prepared: Prepared, evaluator, hf_checkpoints, reward_params=None) -> tuple:
    """The evaluation due at a prepared iteration, of the policy that sampled it (before its
    update: `prepared.run`'s parameters): (its metrics, its completions table), or ({},
    None) when none is due; the best checkpoint by it written where it is the best
    (`jaxppo.run.watch.HfCheckpoints.consider`)."""
    if evaluator is None or not evaluator.due(prepared.iteration):
        return {}, None
    params = prepared.run.train.params
    metrics, table = evaluator.evaluate(params, prepared.run.key, prepared.iteration, reward_params)
    hf_checkpoints.consider(prepared.iteration, metrics, params)
    return metrics, table


def prepare(run: RunState, collect: Callable, spec: RolloutSpec, ref_params, reward_params, mesh=None) -> Prepared:
    """Collect iteration `run.iteration` (`collect(run, iteration, sample key)` ->
    `jaxppo.rollout.dynamic.Collected`: the prompts, samples and host scores) and build its
    rollout from the parameters of `run`. Writes nothing: an interrupt here loses nothing."""
    it = run.iteration
    k_sample, k_train = run.iteration_keys(it)
    t0 = time.perf_counter()
    batch, gen, episodes, scores, extra, consumed = collect(run, it, k_sample)
    t1 = time.perf_counter()
    built = stages.build_rollout(spec, run.train.params, ref_params, reward_params, batch, gen, scores, run, mesh)
    return Prepared(it, run, batch, gen, episodes, scores, extra, consumed, built, stages.bad_rows(built), k_train,
                    (t0, t1, time.perf_counter()))


def check_scores(prepared: Prepared, source: str, skip: bool, prompts) -> None:
    """Non-finite scores at `prepared.bad`: a `RewardError` naming `source` and the rows'
    prompts (`prompts`: the prompt set's texts), before anything is updated; or with
    `skip` (`TrainerConfig.skip_nonfinite_scores`) a warning, and `complete` skips the
    iteration."""
    p = prepared
    if not p.bad.size:
        return
    if not skip:
        raise stages.nonfinite_error(p.iteration, source, p.built, p.bad, [prompts[r] for r in p.batch.rows])
    import warnings

    warnings.warn(f"iteration {p.iteration} skipped: {source} gave non-finite scores at rows {p.bad[:5].tolist()}",
                  RuntimeWarning, stacklevel=4)


def complete(prepared: Prepared, *, train_step, config: PPOConfig, pipelined=None, lr: Callable,
             with_functions: bool, advantages: bool = False) -> Outcome:
    """The update of a prepared iteration (`jaxppo.run.stages.update`: consumes the old
    train state, whose buffers are donated) and its metrics line (`lr`: the learning-rate
    schedule by update; `with_functions`: text reward functions beside a reward model;
    `advantages`: keep each row's advantage for the completion tables); or,
    for an iteration with non-finite scores, its skip (`jaxppo.run.stages.skip`). With
    `pipelined`, the producer's snapshots advance with the run state."""
    p = prepared
    if p.bad.size:
        new_run = _advance(pipelined, p.run, stages.skip(p.run).replace(prompts_consumed=p.consumed))
        metrics = {"iteration": p.iteration, "episode": (p.iteration + 1) * config.batch_size,
                   "ppo/updates_applied": 0, "ppo/updates_total": int(new_run.train.step),
                   "objective/nonfinite_score_rows": int(p.bad.size),
                   "objective/skipped_nonfinite_scores": new_run.skipped_iterations,
                   "time/generation": time.perf_counter() - p.times[0]}
        return Outcome(new_run, metrics, (p.batch.rows, p.gen), (p.built.raw_scores, p.scores.per_function))
    rows = stages.row_advantages(p.built, config) if advantages and not config.pack_sequences else None
    new_run, device = stages.update(p.run, p.built, p.train_key, train_step, config)
    new_run = _advance(pipelined, p.run, new_run.replace(prompts_consumed=p.consumed))
    host = jax.device_get(device)  # every metric of the iteration in one transfer
    host.update({**(p.episodes.metrics if p.episodes is not None else {}), **p.extra})
    metrics = report.iteration_metrics(p.iteration, host, p.built.raw_scores, p.scores.per_function,
                                       p.built.model_scores, (*p.times, time.perf_counter()), config=config, lr=lr,
                                       skipped=new_run.skipped_iterations, with_functions=with_functions)
    metrics.update({f"time/reward/{name}": seconds for name, seconds in p.scores.times.items()})
    return Outcome(new_run, metrics, (p.batch.rows, p.gen),
                   (p.built.raw_scores, report.with_model_scores(p.scores.per_function, p.built.model_scores)),
                   advantages=rows)


def _advance(pipelined: Optional[Any], run: RunState, new_run: RunState) -> RunState:
    return new_run if pipelined is None else pipelined.advance(run, new_run)
