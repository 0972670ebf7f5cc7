"""One iteration as a chain of stages, each a function of its inputs:

    select_prompts(table, key, iteration, config)                 -> PromptBatch      (host)
    sample(spec, params, batch, key)                               -> GenerationOutput (device)
    score(rewards, tokenizer, table, batch, gen, iteration)        -> HostScores       (host: text rewards)
    build_rollout(spec, params, ref_params, reward_params, batch,
                  gen, scores, run)                                -> Built            (device)
    update(run, built, key, train_step, config)                    -> (RunState, device metrics)

(each takes an optional `mesh` last; `score` takes a multi-turn run's `Episodes`).

`sample` and `build_rollout` read a parameters snapshot (`params`) and write nothing, so a
producer may run them for iteration i + 1 while `update` of iteration i runs. The trainer
is the loop around these (progress, signals, logging, checkpoints); a research loop can
call them directly. The host waits for the device only where it needs the data: decoded
text for text rewards, the scores for the non-finite check, the metrics at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import sharding
from jaxppo.config import PPOConfig
from jaxppo.errors import RewardError
from jaxppo.models.tokenizer import decode_responses, unknown_token_count
from jaxppo.rollout.prompts import PromptBatch, PromptTable, prompt_batch
from jaxppo.rollout.rewards import HostRewards, HostScores, nonfinite_rows
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.rollout.scoring import finish_rollout
from jaxppo.run.state import RunState
from jaxppo.sharding import to_host
from jaxppo.update import packing
from jaxppo.update.batch import RolloutBatch
from jaxppo.update.engine import minibatch_indices
from jaxppo.update.kl import adaptive_kl_update
from jaxppo.update.ppo import minibatch_group
from jaxppo.update.shaping import adaptive_entropy_coef

__all__ = ["PromptTable", "PromptBatch", "HostScores", "Built", "select_prompts", "sample", "score", "build_rollout",
           "update", "skip", "bad_rows", "update_step", "PackedSteps", "scoring_streams",
           "Precompiled", "precompile", "abstract_rollout", "nonfinite_error", "prompt_rows", "prompt_batch", "mesh_context",
           "row_advantages"]


class Built(NamedTuple):
    """A rollout and what came with it: the rollout's statistics (device scalars), the new
    score moments, the combined raw scores and the reward model's own on the host."""

    rollout: RolloutBatch
    stats: dict
    score_moments: Any
    raw_scores: np.ndarray
    model_scores: Any


def mesh_context(mesh):
    """The mesh in context for compiled calls (axis names resolve inside them)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def prompt_rows(table: PromptTable, key, iteration: int, config: PPOConfig) -> np.ndarray:
    """Rows of the prompt set behind the `batch_size` completions of `iteration`: its
    `batch_size / num_generations` prompts (positions [i * n, (i + 1) * n) of the table's
    stream: walked in an order reshuffled every dataset epoch, see
    `jaxppo.rollout.prompts.prompt_order`, or a `PromptStream`'s own order), each repeated
    `num_generations` times in consecutive rows (a prompt's group)."""
    n = config.prompts_per_batch
    return np.repeat(table.rows_at(key, iteration * n, n), config.num_generations)


def select_prompts(table: PromptTable, key, iteration: int, config: PPOConfig, mesh=None) -> PromptBatch:
    """The `batch_size / num_generations` prompts of `iteration` (walked in an order
    reshuffled every dataset epoch from `key`, see `jaxppo.rollout.prompts.prompt_order`), each
    repeated `num_generations` times. Under a mesh each process materialises only its rows."""
    return prompt_batch(table, prompt_rows(table, key, iteration, config), mesh)


def sample(spec: RolloutSpec, params, batch: PromptBatch, key, mesh=None):
    """Sample `spec.response_length` tokens per row from the policy in `params` (compiled;
    returns without waiting for the device)."""
    with mesh_context(mesh):
        return sample_responses(spec, params, batch.ids, batch.mask, key)


def score(rewards: Optional[HostRewards], tokenizer, table: PromptTable, batch: PromptBatch, gen,
          iteration: int, episodes=None) -> HostScores:
    """Score the completions with the text reward functions (on the host: the one place the
    host waits for the sampled tokens). Without text rewards, nothing to do here: the
    reward model or token function scores on the device in `build_rollout`.

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


def build_rollout(spec: RolloutSpec, params, ref_params, reward_params, batch: PromptBatch, gen, scores: HostScores,
                  run: RunState, mesh=None) -> Built:
    """The rollout (log-probs of the scoring pass, reference, values with a critic, scores,
    KL-shaped rewards; see `jaxppo.rollout.scoring.finish_rollout`), its statistics, and the raw
    scores on the host (the host needs them: non-finite scores stop the iteration before
    any update)."""
    if spec.pack_sequences:
        spec = scoring_streams(spec, batch, gen)
    with mesh_context(mesh):
        rollout, stats, moments = finish_rollout(spec, params, ref_params, reward_params, batch.ids, batch.mask, gen,
                                                 scores.scores, run.kl, run.score_moments)
    raw_scores = to_host(stats.pop("per_row/raw_scores"))
    model_scores = stats.pop("per_row/model_scores", None)
    if run.entropy_coef is not None:  # the adaptive coefficient reaches the loss with the rollout
        rollout = rollout.replace(entropy_coef=jnp.full(rollout.response_tokens.shape[:1], run.entropy_coef))
    if mesh is not None:
        rollout = sharding.shard_batch(rollout, mesh)
    return Built(rollout, stats, moments, raw_scores, model_scores)


def scoring_streams(spec: RolloutSpec, batch: PromptBatch, gen) -> RolloutSpec:
    """The spec with the streams that this batch's rows fit in when packed for scoring
    (`jaxppo.update.packing`: the fewest, rounded up by `round_streams`)."""
    attention = getattr(gen, "attention_mask", None)  # a multi-turn episode's response region
    lengths = packing.host_row_lengths(to_host(batch.mask), to_host(gen.mask if attention is None else attention))
    width = batch.ids.shape[1] + gen.tokens.shape[1]
    needed = packing.streams_needed(lengths, spec.pack_length or width)
    return dataclasses.replace(spec, pack_streams=packing.round_streams(needed, len(lengths)))


class PackedSteps:
    """The update with packed sequences and the streams chosen per iteration
    (`PPOConfig.pack_streams` None): from the rollout's row lengths and the update's
    mini-batch permutations (`jaxppo.update.engine.minibatch_indices` of the same key), the fewest
    streams every micro-batch fits in, rounded up to 1, 2, 3, 4, 6, 8, 12, ...
    (`jaxppo.update.packing.minibatch_streams`), so that nothing falls back to padding and a run
    compiles for a few stream counts at most. `make_step(config)` builds the compiled step
    for a config; one per stream count is kept. Adds `packing/streams` and `packing/fill`
    (the share of the streams' slots that hold real tokens) to the metrics."""

    def __init__(self, make_step, config: PPOConfig):
        self.make_step, self.config, self.steps = make_step, config, {}

    def __call__(self, state, rollout: RolloutBatch, key):
        c = self.config
        length = packing.stream_length(rollout, c.pack_length)
        attention = rollout.response_mask if rollout.response_attention_mask is None else rollout.response_attention_mask
        lengths = packing.host_row_lengths(to_host(rollout.query_mask), to_host(attention))
        order = minibatch_indices(key, c, minibatch_group(c))  # the update's own order
        streams = packing.minibatch_streams(lengths, np.asarray(order), c.micro_batch_size, length)
        if streams not in self.steps:
            self.steps[streams] = self.make_step(c.replace(pack_streams=streams))
        state, metrics = self.steps[streams](state, rollout, key)
        slots = c.num_minibatches * c.gradient_accumulation_steps * streams * length
        return state, {**metrics, "packing/streams": streams, "packing/fill": float(lengths.sum()) / slots}


def update_step(make_step, config: PPOConfig):
    """The trainer's compiled update for `config`: `make_step(config)`, or with packed
    sequences whose streams are left to the trainer, a `PackedSteps` that chooses them."""
    if config.pack_sequences and config.pack_streams is None:
        return PackedSteps(make_step, config)
    return make_step(config)


class Precompiled:
    """The update's `train_step`, compiled ahead of time in a background thread while the
    first iteration samples and scores (XLA compiles without holding Python's lock, so on a
    machine with more than one core the two overlap; the update's compile is the largest
    of a run's start). `step` is `functools.partial(jitted, config=...)`; `args` what to
    lower it with (the train state, an abstract rollout from `abstract_rollout`, a key), or
    a function returning them, called in the background thread too.

    Calls wait for the compile and run the compiled program. If lowering or compiling fails,
    or the rollout given does not match the one it was compiled for, the call falls back to
    `step` itself (which compiles, or raises, as it would have without this)."""

    def __init__(self, step, args):
        import concurrent.futures

        self.step, self.compiled = step, None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxppo-compile")
        self.future = pool.submit(lambda: step.func.lower(*(args() if callable(args) else args),
                                                          **step.keywords).compile())
        pool.shutdown(wait=False)

    def __call__(self, state, rollout, key):
        if self.future is not None:
            future, self.future = self.future, None
            try:
                self.compiled = future.result()
            except Exception:  # the plain call below compiles, or raises the same error in this thread
                self.compiled = None
        if self.compiled is not None:
            try:
                return self.compiled(state, rollout, key)
            except (TypeError, ValueError):  # inputs unlike the ones compiled for (checked before running)
                self.compiled = None
        return self.step(state, rollout, key)


def abstract_rollout(spec: RolloutSpec, run: RunState, ref_params, reward_params, rows: int, query_width: int,
                     host_scores: bool) -> RolloutBatch:
    """The shapes and dtypes of the rollout that `build_rollout` will produce for `rows` rows
    of prompts `query_width` wide (`jax.eval_shape` of `finish_rollout`: nothing runs)."""
    from jaxppo.models.decoding import GenerationOutput

    tokens = jax.ShapeDtypeStruct((rows, spec.response_length), jnp.int32)
    gen = GenerationOutput(tokens, jax.ShapeDtypeStruct(tokens.shape, jnp.float32), tokens)
    ids = jax.ShapeDtypeStruct((rows, query_width), jnp.int32)
    scores = jax.ShapeDtypeStruct((rows,), jnp.float32) if host_scores else None
    shapes = jax.eval_shape(lambda *a: finish_rollout(spec, *a), run.train.params, ref_params, reward_params, ids, ids,
                            gen, scores, run.kl, run.score_moments)
    return shapes[0]


def precompile(train_step, spec: RolloutSpec, run: RunState, ref_params, reward_params, table: PromptTable,
               config: PPOConfig, host_scores: bool, key):
    """`train_step` as a `Precompiled` (its compile started now) where the rollout's form is
    known before sampling: a plain compiled step (one device, no per-iteration choice of
    packed streams; a `Precompiled` is returned as it is, so this starts one compile at
    most), single-turn (the caller's part), no adaptive entropy coefficient; else
    `train_step` unchanged."""
    if not isinstance(train_step, functools.partial) or run.entropy_coef is not None:
        return train_step
    width = table.width
    return Precompiled(train_step, lambda: (run.train, abstract_rollout(spec, run, ref_params, reward_params,
                                                                        config.batch_size, width, host_scores), key))


def bad_rows(built: Built) -> np.ndarray:
    """Rows whose raw score is not finite."""
    return nonfinite_rows(built.raw_scores)


def nonfinite_error(iteration: int, source: str, built: Built, bad, prompts) -> RewardError:
    """The error for non-finite scores at rows `bad` (`prompts`: the batch's prompt texts)."""
    raw = built.raw_scores
    return RewardError(
        f"iteration {iteration}: {source} gave non-finite scores {raw[bad[:5]].tolist()} at rows {bad[:5].tolist()}"
        + (f" (and {bad.size - 5} more)" if bad.size > 5 else "") +
        f" (prompts {[prompts[i][:40] for i in bad[:3]]}); nothing was updated. Fix the reward, or set "
        "skip_nonfinite_scores (--skip-nonfinite-scores) to skip such iterations")


def row_advantages(built: Built, config: PPOConfig):
    """Each row's advantage as the update computes it (`jaxppo.compute_advantages` on the
    rollout), averaged over the row's policy tokens (a sequence estimator's one number per
    completion), for the completion tables: a device array, not waited for. Dispatched
    before the update, whose train step may take the rollout's buffers."""
    return _row_advantages(built.rollout, config=config)


@functools.partial(jax.jit, static_argnames="config")
def _row_advantages(rollout, config):
    from jaxppo.update.ppo import compute_advantages

    advantages, _ = compute_advantages(rollout, config)
    mask = rollout.response_mask.astype(jnp.float32)
    return (advantages * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)


def update(run: RunState, built: Built, key, train_step, config: PPOConfig):
    """The update of one iteration: `train_step` on the rollout (the old train state's
    buffers are donated), the KL controller's step, the adaptive entropy coefficient's step
    (with `entropy_target`), the new score moments, the iteration counted. Returns (new run
    state, device metrics: the rollout's statistics and the update's, without the
    per-mini-batch arrays)."""
    state, metrics = train_step(run.train, built.rollout, key)
    kl = adaptive_kl_update(run.kl, built.stats.get("objective/kl", 0.0), config.batch_size)
    device = {**built.stats, **{k: v for k, v in metrics.items() if not k.startswith("per_minibatch/")}}
    device["ppo/updates_total"] = state.step
    entropy_coef = run.entropy_coef
    if entropy_coef is not None:  # this iteration's coefficient; the next one follows the entropy it measured
        device["objective/entropy_coef"] = entropy_coef
        entropy_coef = adaptive_entropy_coef(entropy_coef, metrics["policy/entropy_avg"], config.entropy_target,
                                             config.entropy_coef_step)
    run = run.replace(train=state, kl=kl, score_moments=built.score_moments, iteration=run.iteration + 1,
                      entropy_coef=entropy_coef)
    return run, device


def skip(run: RunState) -> RunState:
    """An iteration skipped for non-finite scores: no update, no KL or score-statistics
    change; the iteration (and so the data position) advances and the skip is counted."""
    return run.replace(iteration=run.iteration + 1, skipped_iterations=run.skipped_iterations + 1)
