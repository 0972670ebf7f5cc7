"""One iteration, in the order its data flows (each stage a function of its inputs):

    select_prompts(table, key, iteration, config)       -> PromptBatch        host
    sample(spec, params, batch, key)                    -> samples            device (`Collector.sample`
                                                                               with the run's engine; host
                                                                               steps between the turns of
                                                                               episodes)
    reward(rewards, tokenizer, table, batch, samples,   -> HostScores         host: text reward functions,
           iteration)                                                          environments' rewards
    build(spec, params, ref_params, reward_params,      -> Built              device: the forward pass
          batch, samples, scores, run)                                         (log-probs, reference, values,
                                                                               scores, KL-shaped rewards)
    evaluate_due(evaluator, prepared, ...)              -> eval/... metrics   the policy that sampled it
                                                                               (`jaxppo.run.evaluation`)
    check(prepared, source, skip, prompts)              -> raises, or the iteration is skipped
    update(run, built, key, train_step, config)         -> (RunState, device metrics)
    iteration_metrics(...)                              -> the metrics line   host (`jaxppo.run.report`)

Two functions run them, given the iteration's `RunState` and the run's parts
(`jaxppo.run.parts.RunParts`), and nothing else:

    prepare(run, parts)        -> Prepared    collect (sample and reward; or what the producer of
                                              pipelined iterations sampled ahead), build, the
                                              evaluation due, the check. Writes nothing (but the
                                              best checkpoint by that evaluation): an interrupt
                                              here loses nothing
    complete(prepared, parts)  -> Outcome     the update (or the skip of an iteration with
                                              non-finite scores) and the metrics line

The loop (`jaxppo.run.loop`) carries the `RunState` from one `Outcome` to the next; nothing
here holds a trainer. With dynamic sampling the sample and reward stages run in rounds
(`jaxppo.rollout.dynamic.collect`); with pipelined iterations a producer runs them ahead,
from older parameters (`jaxppo.run.pipeline`). The values that carry an iteration:
`PromptBatch`, the samples (`GenerationOutput`, or a multi-turn `Episodes`), `HostScores`,
`Collected` (the three), `Built` (the `RolloutBatch` and its statistics), `Prepared`,
`Outcome`, and the `RunState` carried to the next iteration.

The host waits for the device only where it needs the data: decoded text for text rewards,
the scores for the non-finite check, the metrics at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import sharding
from jaxppo.errors import RewardError
from jaxppo.models.tokenizer import decode_responses, unknown_token_count
from jaxppo.rollout import dynamic
from jaxppo.rollout.dynamic import Collected
from jaxppo.rollout.environments import EnvironmentSpec, EpisodeSetup, run_episodes
from jaxppo.rollout.engines import RolloutEngine, sample_responses
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.rollout.prompts import PromptBatch, PromptTable, prompt_batch
from jaxppo.rollout.rewards import HostRewards, HostScores, nonfinite_rows
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.run import report
from jaxppo.run.evaluation import evaluate_due
from jaxppo.run.state import RunState
from jaxppo.sharding import mesh_context, to_host
from jaxppo.update import packing
from jaxppo.update.kl import adaptive_kl_update
from jaxppo.update.shaping import adaptive_entropy_coef

__all__ = ["Collector", "Collected", "Built", "Prepared", "Outcome", "prompt_rows", "select_prompts", "sample", "reward",
           "build", "check", "update", "skip", "prepare", "complete", "row_advantages", "mesh_context",
           "scoring_streams"]


# ------------------------------------------------------------------ select prompts

def prompt_rows(table: PromptTable, key, iteration: int, config) -> np.ndarray:
    """Rows of the prompt set behind the `batch_size` completions of `iteration`: its
    `batch_size / num_generations` prompts (positions [i * n, (i + 1) * n) of the table's
    stream: walked in an order reshuffled every dataset epoch, see
    `jaxppo.rollout.prompts.prompt_order`, or a `PromptStream`'s own order), each repeated
    `num_generations` times in consecutive rows (a prompt's group)."""
    n = config.prompts_per_batch
    return np.repeat(table.rows_at(key, iteration * n, n), config.batch.num_generations)


def select_prompts(table: PromptTable, key, iteration: int, config, mesh=None) -> PromptBatch:
    """The prompts of `iteration` (`prompt_rows`), tokenized; under a mesh each process
    materialises only its rows."""
    return prompt_batch(table, prompt_rows(table, key, iteration, config), mesh)


# ------------------------------------------------------------------ sample, reward

def sample(spec: RolloutSpec, params, batch: PromptBatch, key, mesh=None):
    """Sample `spec.response_length` tokens per row from the policy in the train `params`
    with the spec's built-in engine (compiled; returns without waiting for the device): the
    sample stage as a function, for a loop of one's own (a run samples with its rollout
    engine, through `Collector`)."""
    with mesh_context(mesh):
        return sample_responses(spec, params, batch.queries, batch.mask, key)


@dataclasses.dataclass(frozen=True)
class Collector:
    """What a run samples with and rewards with, fixed for the run: the config, the rollout
    spec, the prompt table, the tokenizer, the text reward functions (`HostRewards`, or
    None), the environment (`EnvironmentSpec`, or None: single-turn), the rollout engine,
    and the mesh (or None). The engine is given its weights and samples under `lock`: one
    batch at a time (training, evaluation and a producer thread share it).

    `collect(run, it, key)` is an iteration's sample and reward stages (`Collected`); where
    they are separate (`staged`: single-turn, no dynamic sampling) a producer runs them in
    two threads: `sample_stage`, then `reward_stage`."""

    config: Any
    spec: RolloutSpec
    table: PromptTable
    tokenizer: Any
    host_rewards: Optional[HostRewards]
    environment: Optional[EnvironmentSpec]
    rollout_engine: RolloutEngine
    mesh: Any
    lock: Any = dataclasses.field(default_factory=threading.Lock, compare=False)
    warned: list = dataclasses.field(default_factory=list, compare=False)  # what was warned of once

    def collect(self, run: RunState, it: int, key) -> Collected:
        """The iteration's prompts, samples (or episodes) and host scores: one batch of the
        iteration's prompts, or with dynamic sampling the rounds of `dynamic.collect`."""
        c = self.config
        if c.rewards.dynamic_sampling:
            return dynamic.collect(self.table, key, run, c, lambda batch, k: self.sample(run, batch, k, it),
                                   lambda batch, gen, episodes: self.reward(batch, gen, episodes, it), self.mesh)
        batch = select_prompts(self.table, run.key, it, c, self.mesh)
        gen, episodes = self.sample(run, batch, key, it)
        return Collected(batch, gen, episodes, self.reward(batch, gen, episodes, it), {}, None)

    @property
    def staged(self) -> bool:
        """Sampling and rewarding are separate stages: no dynamic sampling (whose rounds
        sample after rewarding) and no environment (whose episodes step on the host between
        turns)."""
        return not self.config.rewards.dynamic_sampling and self.environment is None

    def sample_stage(self, run: RunState, it: int, key) -> Collected:
        """The first half of `collect` where `staged`: the prompts and the samples (possibly
        still being computed on the device), no scores yet. With in-flight updates and a
        `run.train` that offers `source()` (the newest parameters:
        `jaxppo.run.pipeline.SamplerView`), the engine takes new parameters while it decodes
        and the version of each token comes along (`Collected.token_versions`)."""
        sampling = self.config.sampling
        batch = select_prompts(self.table, run.key, it, self.config, self.mesh)
        source = getattr(run.train, "source", None)
        if sampling.inflight_updates and source is not None:
            with self.lock, mesh_context(self.mesh):
                gen, versions = self.rollout_engine.sample_inflight(
                    source, batch.queries, batch.mask, key, on_update=sampling.inflight_updates,
                    steps=sampling.inflight_steps)
            return Collected(batch, gen, None, None, {}, None, versions)
        return Collected(batch, self.sample(run, batch, key, it)[0], None, None, {}, None)

    def reward_stage(self, sampled: Collected, it: int) -> Collected:
        """The second half: the host scores of `sample_stage`'s batch."""
        return sampled._replace(scores=self.reward(sampled.batch, sampled.gen, None, it))

    def sample(self, run: RunState, batch: PromptBatch, key, it: int):
        """(the batch's sampled responses, None), or with an environment (its episodes'
        `EpisodeOutput`, the `Episodes`)."""
        spec, engine = self.spec, self.rollout_engine
        version = getattr(run.train, "version", run.iteration)  # iterations the parameters are after
        with self.lock:
            engine.set_weights(spec.policy_params(run.train.params), version)
            if self.environment is None:
                with mesh_context(self.mesh):
                    return engine.sample(batch.queries, batch.mask, key, num_generations=spec.num_generations,
                                         response_length=spec.response_length), None
            setup = EpisodeSetup(self.environment, self.table, self.tokenizer, self.mesh)
            episodes = run_episodes(setup, spec, run.train.params, batch, key, it, engine=engine)
        return episodes.output, episodes

    def reward(self, batch: PromptBatch, gen, episodes, it: int) -> HostScores:
        """The batch's host scores (`reward`); the first batch with token ids the tokenizer
        does not know is warned of (once per run)."""
        scores = reward(self.host_rewards, self.tokenizer, self.table, batch, gen, it, episodes)
        if scores.unknown_tokens and "unknown tokens" not in self.warned:
            self.warned.append("unknown tokens")
            import warnings

            warnings.warn(f"iteration {it}: the policy sampled {scores.unknown_tokens} token ids that the tokenizer "
                          f"does not know (>= {len(self.tokenizer)}: its vocabulary of "
                          f"{self.spec.policy.config.vocab_size} is padded beyond the tokenizer's); the reward "
                          "functions see them as the tokenizer's unknown token (warned once)", RuntimeWarning,
                          stacklevel=2)
        return scores


def reward(rewards: Optional[HostRewards], tokenizer, table: PromptTable, batch: PromptBatch, gen,
           iteration: int, episodes=None) -> HostScores:
    """Score the completions with the text reward functions (on the host: the one place the
    host waits for the sampled tokens). Without text rewards, nothing to do here: the
    reward model or token function scores on the device in `build`.

    With `episodes` (`jaxppo.rollout.environments.Episodes`, multi-turn), the reward functions
    receive each row's whole conversation (the decoded response region, observations
    included), the environments' rewards are added (`rewards/environment/...`), and
    failed episodes score 0."""
    if rewards is None and episodes is None:
        return HostScores(None, {}, 0)
    tokens, token_mask = to_host(gen.tokens), to_host(gen.mask)
    completions = episodes.conversations if episodes is not None else decode_responses(tokenizer, tokens, token_mask)
    total, per_function, times = np.zeros(len(batch.rows), np.float32), {}, {}
    if rewards is not None:
        prompts = [table.prompts[r] for r in batch.rows]
        columns = {name: [values[r] for r in batch.rows] for name, values in table.columns.items()}
        total, per_function, times = rewards(iteration, prompts, completions, columns)
    if episodes is not None:
        total = np.where(episodes.failed, 0.0, total + episodes.rewards).astype(np.float32)
        per_function = {**per_function, "environment": (episodes.rewards, ~episodes.failed)}
    return HostScores(jnp.asarray(total), per_function, unknown_token_count(tokenizer, tokens, token_mask), times)


# ------------------------------------------------------------------ build the rollout

class Built(NamedTuple):
    """A rollout and what came with it: the `RolloutBatch`, its statistics (device
    scalars), the new score moments, the combined raw scores and the reward model's own on
    the host."""

    rollout: Any
    stats: dict
    score_moments: Any
    raw_scores: np.ndarray
    model_scores: Any


def build(spec: RolloutSpec, params, ref_params, reward_params, batch: PromptBatch, gen, scores: HostScores,
          run: RunState, mesh=None) -> Built:
    """The rollout (log-probs of the forward pass, reference, values with a critic, scores,
    KL-shaped rewards; `jaxppo.rollout.forward.finish_rollout`), its statistics, and the raw
    scores on the host (the host needs them: non-finite scores stop the iteration before
    any update)."""
    if spec.pack_sequences:
        spec = scoring_streams(spec, batch, gen)
    with mesh_context(mesh):
        rollout, stats, moments = finish_rollout(spec, params, ref_params, reward_params, (batch.queries, batch.mask),
                                                 gen, scores.scores, Shaping(run.kl, run.score_moments))
    raw_scores = to_host(stats.pop("per_row/raw_scores"))
    model_scores = stats.pop("per_row/model_scores", None)
    if run.entropy_coef is not None:  # the adaptive coefficient reaches the loss with the rollout
        rollout = rollout.replace(entropy_coef=jnp.full(rollout.response_tokens.shape[:1], run.entropy_coef))
    if mesh is not None:
        rollout = sharding.shard_batch(rollout, mesh)
    return Built(rollout, stats, moments, raw_scores, model_scores)


def scoring_streams(spec: RolloutSpec, batch: PromptBatch, gen) -> RolloutSpec:
    """The spec with the streams that this batch's rows fit in when packed for the forward
    pass (`jaxppo.update.packing`: the fewest, rounded up by `round_streams`)."""
    attention = getattr(gen, "attention_mask", None)  # a multi-turn episode's response region
    lengths = packing.host_row_lengths(to_host(batch.mask), to_host(gen.mask if attention is None else attention))
    width = batch.ids.shape[1] + gen.tokens.shape[1]
    needed = packing.streams_needed(lengths, spec.pack_length or width)
    return dataclasses.replace(spec, pack_streams=packing.round_streams(needed, len(lengths)))


class Prepared(NamedTuple):
    """An iteration up to its update: what `prepare` computed, and read nothing else of.

    iteration: its index; run: the `RunState` it starts from; collected: its prompts,
    samples, host scores and collection metrics (`Collected`); built: the rollout and its
    statistics (`Built`); bad: rows whose raw score is not finite; train_key: the update's
    key; times: (start, host scores done, rollout built) in `time.perf_counter` seconds;
    evaluation: the evaluation due at it (`evaluate_due`: its `eval/...` metrics and its
    completions table, or ({}, None))."""

    iteration: int
    run: RunState
    collected: Collected
    built: Built
    bad: np.ndarray
    train_key: Any
    times: tuple
    evaluation: tuple = ({}, None)


def prepare(run: RunState, parts) -> Prepared:
    """Iteration `run.iteration` up to its update, with the run's parts (`RunParts`):
    collected (the prompts, samples and host scores: `Collector.collect`, or with pipelined
    iterations the producer's batch, sampled ahead), its rollout built from the parameters
    of `run`, the evaluation due at it (of those parameters), and its scores checked
    (`check`). Writes nothing but the best checkpoint by that evaluation: an interrupt here
    loses nothing."""
    it = run.iteration
    k_sample, k_train = run.iteration_keys(it)
    t0 = time.perf_counter()
    if parts.pipeline is not None:  # sampled ahead by the producer, from version max(0, it - k)
        collected = parts.pipeline.take(run)
    else:
        collected = parts.collector.collect(run, it, k_sample)
    t1 = time.perf_counter()
    built = build(parts.spec, run.train.params, parts.ref_params, parts.reward_params, collected.batch, collected.gen,
                  collected.scores, run, parts.mesh)
    prepared = Prepared(it, run, collected, built, nonfinite_rows(built.raw_scores), k_train,
                        (t0, t1, time.perf_counter()))
    prepared = prepared._replace(evaluation=evaluate_due(parts.evaluator, prepared, parts.outputs.hf,
                                                         parts.reward_params))
    check(prepared, parts.rewards.source(), parts.config.rewards.skip_nonfinite_scores, parts.table.texts)
    return prepared


# ------------------------------------------------------------------ check

def check(prepared: Prepared, source: str, skip_nonfinite_scores: bool, prompts) -> None:
    """The one check of scores before any update: non-finite scores at `prepared.bad` are a
    `RewardError` naming `source`, the rows, their values and prompts (`prompts`: the prompt
    set's texts); or with `skip_nonfinite_scores` (`RewardConfig`) a warning,
    and `complete` skips the iteration."""
    p = prepared
    if not p.bad.size:
        return
    rows = [prompts[r] for r in p.collected.batch.rows]
    if skip_nonfinite_scores:
        import warnings

        warnings.warn(f"iteration {p.iteration} skipped: {source} gave non-finite scores at rows "
                      f"{p.bad[:5].tolist()}", RuntimeWarning, stacklevel=4)
        return
    raw, bad = p.built.raw_scores, p.bad
    raise RewardError(
        f"iteration {p.iteration}: {source} gave non-finite scores {raw[bad[:5]].tolist()} at rows {bad[:5].tolist()}"
        + (f" (and {bad.size - 5} more)" if bad.size > 5 else "") +
        f" (prompts {[rows[i][:40] for i in bad[:3]]}); nothing was updated. Fix the reward, or set "
        "skip_nonfinite_scores (--skip-nonfinite-scores) to skip such iterations")


# ------------------------------------------------------------------ update

def update(run: RunState, built: Built, key, train_step, config):
    """The update of one iteration: `train_step` on the rollout (the old train state's
    buffers are donated), the KL controller's step, the adaptive entropy coefficient's step
    (with `entropy_target`), the new score moments, the iteration counted. Returns (new run
    state, device metrics: the rollout's statistics and the update's, without the
    per-mini-batch arrays)."""
    state, metrics = train_step(run.train, built.rollout, key)
    kl = adaptive_kl_update(run.kl, built.stats.get("objective/kl", 0.0), config.batch.batch_size)
    device = {**built.stats, **{k: v for k, v in metrics.items() if not k.startswith("per_minibatch/")}}
    device["ppo/updates_total"] = state.step
    entropy_coef = run.entropy_coef
    if entropy_coef is not None:  # this iteration's coefficient; the next one follows the entropy it measured
        device["objective/entropy_coef"] = entropy_coef
        entropy_coef = adaptive_entropy_coef(entropy_coef, metrics["policy/entropy_avg"], config.loss.entropy_target,
                                             config.loss.entropy_coef_step)
    run = run.replace(train=state, kl=kl, score_moments=built.score_moments, iteration=run.iteration + 1,
                      entropy_coef=entropy_coef)
    return run, device


def skip(run: RunState) -> RunState:
    """An iteration skipped for non-finite scores: no update, no KL or score-statistics
    change; the iteration (and so the data position) advances and the skip is counted."""
    return run.replace(iteration=run.iteration + 1, skipped_iterations=run.skipped_iterations + 1)


def row_advantages(built: Built, config):
    """Each row's advantage as the update computes it (`jaxppo.update.ppo.compute_advantages`
    on the rollout), averaged over the row's policy tokens (a sequence estimator's one
    number per completion), for the completion tables: a device array, not waited for.
    Dispatched before the update, whose train step may take the rollout's buffers."""
    return _row_advantages(built.rollout, config=config)


@functools.partial(jax.jit, static_argnames="config")
def _row_advantages(rollout, config):
    from jaxppo.update.ppo import compute_advantages

    advantages, _ = compute_advantages(rollout, config)
    mask = rollout.response_mask.astype(jnp.float32)
    return (advantages * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


# ------------------------------------------------------------------ the metrics line

class Outcome(NamedTuple):
    """What an iteration gives: the run state after it, its metrics line (host floats, its
    evaluation's included), the samples behind it (prompt rows, `GenerationOutput`), for
    `Trainer.samples`, their scores (the combined raw scores (B,) on the host, the text
    reward functions' `{name: (values, given)}`), for `Trainer.completion_table`, the
    table of its evaluation's completions ((columns, rows), or None), and each row's
    advantage (B,) (`row_advantages`, a device array; None when not asked for)."""

    run: RunState
    metrics: dict
    samples: tuple
    scores: tuple = (None, {})
    eval_table: Optional[tuple] = None
    advantages: Any = None


def complete(prepared: Prepared, parts) -> Outcome:
    """The update of a prepared iteration (`update`: consumes the old train state, whose
    buffers are donated) and its metrics line, its evaluation's metrics included; or, for an
    iteration with non-finite scores, its skip (`skip`). With pipelined iterations the
    producer's snapshots advance with the run state, and it is given the new one."""
    p, c, config = prepared, prepared.collected, parts.config
    samples = (c.batch.rows, c.gen)
    pipeline = parts.pipeline
    evaluated, eval_table = p.evaluation
    data = {"data/prompts_filtered": parts.table.filtered} if config.data.overlong_prompts == "filter" else {}
    if p.bad.size:
        new_run = _advance(pipeline, p.run, skip(p.run).replace(prompts_consumed=c.prompts_consumed))
        metrics = {"iteration": p.iteration, "episode": (p.iteration + 1) * config.batch.batch_size,
                   "ppo/updates_applied": 0, "ppo/updates_total": int(new_run.train.step),
                   "objective/nonfinite_score_rows": int(p.bad.size),
                   "objective/skipped_nonfinite_scores": new_run.skipped_iterations,
                   "time/generation": time.perf_counter() - p.times[0]}
        outcome = Outcome(new_run, {**metrics, **data, **evaluated}, samples, (p.built.raw_scores, c.scores.per_function),
                          eval_table)
    else:
        tables = bool(config.run.sample_every and config.run.num_samples) and not config.layout.pack_sequences
        rows = row_advantages(p.built, config) if tables else None
        new_run, device = update(p.run, p.built, p.train_key, parts.train_step, config)
        new_run = _advance(pipeline, p.run, new_run.replace(prompts_consumed=c.prompts_consumed))
        host = jax.device_get(device)  # every metric of the iteration in one transfer
        host.update({**(c.episodes.metrics if c.episodes is not None else {}), **c.metrics})
        metrics = report.iteration_metrics(p.iteration, host, p.built.raw_scores, c.scores.per_function,
                                           p.built.model_scores, (*p.times, time.perf_counter()), config=config,
                                           lr=parts.policy_schedule, skipped=new_run.skipped_iterations,
                                           with_functions=parts.host_rewards is not None)
        metrics.update({f"time/reward/{name}": seconds for name, seconds in c.scores.times.items()})
        outcome = Outcome(new_run, {**metrics, **data, **evaluated}, samples,
                          (p.built.raw_scores, report.with_model_scores(c.scores.per_function, p.built.model_scores)),
                          eval_table, rows)
    if pipeline is not None:
        pipeline.push(outcome.run)
    return outcome


def _advance(pipeline: Optional[Any], run: RunState, new_run: RunState) -> RunState:
    return new_run if pipeline is None else pipeline.advance(run, new_run)
