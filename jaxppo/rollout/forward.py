"""The forward pass over sampled responses: a `RolloutBatch` from them (compiled,
`finish_rollout`). 0.5-dev's `jaxppo.rollout.scoring`; "scores" are the rewards' values, which
the reward stage computes (`jaxppo.rollout.rewards`).

A rollout is collected by two compiled stages with a host step between them only when the
reward is a Python function on decoded text:

    sample_responses(spec, params, prompts, key)        -> GenerationOutput     (jit, `engines`)
    [scores = reward_fn(prompt texts, response texts)]                          (host, `rewards`)
    finish_rollout(spec, params, ref_params, ...)       -> RolloutBatch, stats  (jit, here)

`finish_rollout` recomputes the policy's log-probs and the critic's values with the same function
the PPO loss uses (so the first update sees ratio 1), the reference log-probs, the scores
(reward model, token-level reward function, or the host scores), the missing-EOS penalty,
DAPO's overlong punishment, score normalisation and clipping, per-token KL, and rewards =
-beta * KL with the score added at the last real response token; with
`mask_truncated`, completions without a stop token get a zero response mask.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxppo.models.decoding import GenerationOutput, strings_completed
from jaxppo.models.model import joined_inputs, scored_mask
from jaxppo.models.vision import ImagePrompt
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.update import packing
from jaxppo.update.batch import (RolloutBatch, joined, model_method, queries, response_attention, response_outputs,
                                 routed_outputs, scorer, teacher_outputs)
from jaxppo.update.kl import KLControllerState, kl_per_token, kl_shaped_rewards
from jaxppo.update.losses import logprobs_from_logits
from jaxppo.update.prefix import prefix_layout, prefix_query, to_region
from jaxppo.update.shaping import overlong_penalty
from jaxppo.update.stats import RunningMoments, masked_sum, running_moments_update

__all__ = ["finish_rollout", "Shaping"]


class Shaping(NamedTuple):
    """What reward shaping carries from one iteration to the next: the KL controller's state
    (`jaxppo.update.kl.KLControllerState`: the coefficient of the KL penalty) and the running
    moments of the scores (`RunningMoments`, read and updated with `normalize_scores`)."""

    kl: KLControllerState
    score_moments: RunningMoments


def _group(spec: RolloutSpec, rows: int) -> int:
    """The rows that share one query in the forward pass: all `rows` in the common-prefix
    layout, G when it runs each group's prompt once (`share_prompts`), else 1."""
    if spec.common_prefix:
        return rows
    return spec.num_generations if spec.share_prompts else 1


def _outputs(spec: RolloutSpec, apply_fn, params, batch):
    """(log-probs, values, entropies) of the response tokens: packed when the spec says
    so, else padded (each group's prompt once with `share_prompts`)."""
    if spec.pack_streams is not None:
        return packing.response_outputs(apply_fn, params, batch, spec.temperature, spec.pack_streams,
                                        spec.pack_length)
    return response_outputs(apply_fn, params, batch, spec.temperature, _group(spec, batch["response_tokens"].shape[0]))


def _policy_outputs(spec: RolloutSpec, params, batch, gen):
    """(old-policy log-probs, values or None, the routing or None): the sampler's own
    log-probs when the spec says so (`RolloutSpec.sampler_logprobs_used`), with the
    critic's values alone from a separate critic (a value head on the policy runs the
    policy's forward for them); else both from one forward, which also records a mixture of
    experts' routing (`RolloutSpec.records_routing`)."""
    if spec.records_routing:
        (logprobs, values, _), routing = routed_outputs(spec.apply_fn, params, batch, spec.temperature)
        return logprobs, values if spec.uses_critic else None, routing["chosen"]
    if not spec.sampler_logprobs_used:
        logprobs, values, _ = _outputs(spec, spec.apply_fn, params, batch)
        return logprobs, values if spec.uses_critic else None, None  # critic-free: no values
    logprobs = gen.policy_logprobs.astype(jnp.float32)  # the policy's own, not the filtered ones sampled from
    if not spec.uses_critic:
        return logprobs, None, None
    critic = getattr(spec.apply_fn, "critic", None)  # a `PolicyAndCritic`: the critic alone
    if critic is None:
        return logprobs, _outputs(spec, spec.apply_fn, params, batch)[1], None
    return logprobs, _outputs(spec, critic.apply, params["critic"], batch)[1], None


def _reference_logprobs(spec: RolloutSpec, ref_params, batch):
    """The reference policy's log-probs of the response tokens, (B, R)."""
    grouped = _group(spec, batch["response_tokens"].shape[0]) > 1
    if spec.pack_streams is not None or (grouped and model_method(spec.ref_apply, "grouped_outputs")):
        return _outputs(spec, spec.ref_apply, ref_params, batch)[0]
    ref_scorer = scorer(spec.ref_apply)
    if ref_scorer is not None:  # a built-in model: no full logits
        return ref_scorer(ref_params, queries(batch), batch["query_mask"], batch["response_tokens"],
                          response_attention(batch), spec.temperature)[0]
    if batch.get("images") is not None:
        raise ValueError("the reference scores rows with images through a built-in Model (its response_outputs)")
    q, r = batch["query_tokens"].shape[1], batch["response_tokens"].shape[1]
    tokens, mask = joined(batch)
    ref_logits = spec.ref_apply(ref_params, tokens, mask)[:, q - 1 : q - 1 + r]
    return logprobs_from_logits(ref_logits, batch["response_tokens"], spec.temperature)


def reward_inputs(spec: RolloutSpec, usual):
    """What the reward model reads of rows (a dict of `RolloutBatch` fields, the usual
    layout): the rows' tokens and attention mask, and with images
    (a vision-language reward model of the policy's kind: `jaxppo.run.parts`) the images
    and the rotary positions through the responses, as the policy reads them."""
    if usual.get("images") is None:
        return joined(usual)
    model = getattr(spec.reward_apply, "__self__", None)
    if getattr(getattr(model, "config", None), "vision", None) is None:
        raise ValueError("the rows have images, which this reward model does not read: give a built-in "
                         "vision-language Model of the policy's kind as the reward model, or score with reward "
                         "functions")
    return joined_inputs(queries(usual), usual["query_mask"], usual["response_tokens"], response_attention(usual))


def _raw_scores(spec: RolloutSpec, reward_params, batch, host_scores, usual):
    """(B,) scores before penalties and normalisation: the reward model's (weighted) or the
    token function's, plus the host's; and the reward model's own (or None). `usual`: the
    batch in the usual layout, what a token function and a reward model without grouped
    outputs read (`batch` may be in the common-prefix layout)."""
    b = batch["query_tokens"].shape[0]
    model_scores = None
    grouped = model_method(spec.reward_apply, "grouped_outputs") if spec.common_prefix else None
    if grouped is not None:  # the common prefix once: the score at each row's last scored token
        # Output t of the grouped forward is the state before region token t: one padding column
        # more, and the output after each row's last real token is the state at that token.
        attention = jnp.pad(response_attention(batch), ((0, 0), (0, 1)))
        tokens = jnp.pad(batch["response_tokens"], ((0, 0), (0, 1)))
        scores = grouped(reward_params, batch["query_tokens"][:1], batch["query_mask"][:1], tokens, attention)[1]
        # The state after each row's last scored token (transformers' rule: not the padding token).
        scored = scored_mask(tokens, attention, grouped.__self__.config.pad_token_id)  # a built-in Model's method
        after_last = scored.shape[1] - jnp.argmax(scored[:, ::-1] > 0, axis=1)
        model_scores = jnp.take_along_axis(scores, after_last[:, None], axis=1)[:, 0].astype(jnp.float32)
        raw_scores = spec.reward_weight * model_scores
    elif spec.reward_apply is not None:
        model_scores = spec.reward_apply(reward_params, *reward_inputs(spec, usual)).astype(jnp.float32)
        raw_scores = spec.reward_weight * model_scores
    elif spec.token_reward_fn is not None:
        raw_scores = jnp.asarray(spec.token_reward_fn(usual["query_tokens"], usual["query_mask"],
                                                      usual["response_tokens"], response_attention(usual)),
                                 jnp.float32)
    else:
        raw_scores = jnp.zeros((b,), jnp.float32)
    if host_scores is not None:
        raw_scores = raw_scores + host_scores.astype(jnp.float32)
    if raw_scores.shape != (b,):
        raise ValueError(f"scores have shape {raw_scores.shape}; expected ({b},)")
    return raw_scores, model_scores


class _Scored(NamedTuple):
    """A rollout's reward terms, for its statistics: the per-token KL and non-score reward,
    the shaped and raw scores per row, the overlong penalty (or None)."""

    kl: jax.Array
    non_score: jax.Array
    scores: jax.Array
    raw_scores: jax.Array
    penalty: Optional[jax.Array]


def _statistics(spec: RolloutSpec, logprobs, response_mask, scored: _Scored, kl_state, contains_eos, lengths,
                with_kl: bool) -> dict:
    """The rollout's TRL-named statistics (device scalars) and the raw scores per row."""
    kl, non_score, scores, raw_scores, penalty = scored
    mean_non_score = jnp.mean(jnp.sum(non_score, axis=1))
    stats = {
        "objective/entropy": jnp.mean(jnp.sum(-logprobs * response_mask, axis=1)),
        "objective/non_score_reward": mean_non_score,
        "objective/rlhf_reward": jnp.mean(scores) + mean_non_score,
        "objective/scores": jnp.mean(scores),
        "objective/raw_scores": jnp.mean(raw_scores),
        "objective/kl_coef": kl_state.beta,
        "val/num_eos_tokens": jnp.sum(contains_eos.astype(jnp.int32)),
        "val/response_length": jnp.mean(lengths.astype(jnp.float32)),
        "per_row/raw_scores": raw_scores,
    }
    if penalty is not None:
        stats["objective/overlong_penalty"] = jnp.mean(penalty)
    if spec.mask_truncated:
        stats["val/num_truncated_masked"] = jnp.sum((~contains_eos).astype(jnp.int32))
    if with_kl:
        stats["objective/kl"] = jnp.mean(jnp.sum(kl, axis=1))
    return stats


def _common_prefix_layout(spec: RolloutSpec, prompt_ids, prompt_mask, gen: GenerationOutput, attention):
    """The batch in the common-prefix layout (`jaxppo.update.prefix`): the prompts' first
    `spec.common_prefix` tokens as every row's query, the rest of each prompt and the
    response as its response region (attended; the response alone trained)."""
    if attention is not None:
        raise ValueError("common_prefix is for single-turn rollouts; a multi-turn episode's response region "
                         "already interleaves the environment's tokens")
    layout = prefix_layout(prompt_mask, spec.common_prefix, gen.tokens.shape[1])
    ids, mask = prefix_query(layout, prompt_ids)
    no_tokens = jnp.zeros_like(prompt_mask)
    moved = GenerationOutput(tokens=to_region(layout, prompt_ids, gen.tokens),
                             logprobs=to_region(layout, no_tokens, gen.logprobs),
                             mask=to_region(layout, no_tokens, gen.mask),
                             full_logprobs=None if gen.full_logprobs is None else to_region(layout, no_tokens,
                                                                                           gen.full_logprobs))
    return ids, mask, moved, to_region(layout, prompt_mask, gen.mask)


def _batches(spec: RolloutSpec, prompts: tuple, gen):
    """(the rows in the usual layout, the rows as the forward passes read them, the samples
    in that layout): the same but in the common-prefix layout. Each a dict of the
    `RolloutBatch` fields; a vision-language policy's `ImagePrompt` gives the ids and the
    images (which travel with the rows)."""
    (ids, mask), images = prompts, None
    if isinstance(ids, ImagePrompt):
        images, ids = ids._replace(ids=None), ids.ids
    attention = getattr(gen, "attention_mask", None)

    def rows(ids, mask, gen, attention):
        out = {"query_tokens": ids, "query_mask": mask, "response_tokens": gen.tokens, "response_mask": gen.mask}
        extra = {"response_attention_mask": attention, "images": images}
        return {**out, **{k: v for k, v in extra.items() if v is not None}}

    usual = rows(ids, mask, gen, attention)
    if spec.common_prefix:
        ids, mask, gen, attention = _common_prefix_layout(spec, ids, mask, gen, attention)
    return usual, rows(ids, mask, gen, attention), gen


@functools.partial(jax.jit, static_argnames=("spec",))
def _stopped(spec: RolloutSpec, gen, truncated):
    """(B,) bool: the completion ended at a stop token or a stop string (an episode: without
    running out of budget, stop token or not)."""
    if truncated is not None:
        return ~truncated
    stop_ids = jnp.asarray(spec.stop_token_ids or (-1,), jnp.int32)
    stopped = jnp.any(jnp.isin(gen.tokens, stop_ids) & (gen.mask > 0), axis=1)
    if spec.stop_strings is not None:  # or it ended at the token that completed a stop string
        stopped = stopped | strings_completed(jnp.asarray(spec.stop_strings.table), gen.tokens, gen.mask)
    return stopped


def _shaped_scores(spec: RolloutSpec, raw_scores, stopped, lengths, budget: int, score_moments):
    """The scores the rewards carry: the missing-stop penalty, DAPO's overlong punishment
    (the penalty, or None without it), normalisation by the running moments (updated), the
    clip. Returns (scores, penalty, score_moments)."""
    scores, penalty = raw_scores, None
    if spec.missing_eos_penalty is not None:
        scores = jnp.where(stopped, scores, scores - spec.missing_eos_penalty)
    if spec.overlong_penalty_factor:
        penalty = overlong_penalty(lengths, budget, spec.buffer, spec.overlong_penalty_factor)
        scores = scores + penalty
    if spec.normalize_scores:
        score_moments = running_moments_update(score_moments, scores)
        scores = (scores - score_moments.mean) / jnp.sqrt(score_moments.var + 1e-8)
    if spec.score_clip is not None:
        scores = jnp.clip(scores, -spec.score_clip, spec.score_clip)
    return scores, penalty, score_moments


@functools.partial(jax.jit, static_argnames=("spec",))
def finish_rollout(spec: RolloutSpec, params, ref_params, reward_params, prompts: tuple, gen: GenerationOutput,
                   host_scores, shaping: Shaping):
    """Build the `RolloutBatch` and its statistics from sampled responses (compiled).

    params (the policy's, with the critic's where the spec has one), ref_params, reward_params
    (None where the spec has no such model). prompts: (ids, mask), each (B, query width), the
    rows `gen` was sampled from (the ids a vision-language policy's `ImagePrompt`, whose
    images the forward passes read and the rollout carries). shaping: the KL coefficient
    and the score moments. host_scores: (B,) scores from text reward functions (weighted and summed), or None; added
    to the reward model's scores (times `spec.reward_weight`) when the spec has one. Returns
    (rollout, stats, score_moments), with TRL-named statistics (objective/kl, .../entropy,
    .../non_score_reward, .../rlhf_reward, .../scores, val/num_eos_tokens, ...; no
    objective/kl without a reference) and the (B,) scores before penalties and normalisation
    as `per_row/raw_scores` (the reward model's own as `per_row/model_scores`)."""
    kl_state, score_moments = shaping
    # A multi-turn episode (`jaxppo.rollout.environments.EpisodeOutput`) also has the environment's
    # tokens in the sequence, and says which episodes ran out of budget.
    truncated, budget = getattr(gen, "truncated", None), gen.tokens.shape[1]
    attention = getattr(gen, "attention_mask", None)
    lengths = jnp.sum(gen.mask if attention is None else attention, axis=1)
    usual, batch, gen = _batches(spec, prompts, gen)
    response_mask = gen.mask  # the policy's tokens
    logprobs, values, routing = _policy_outputs(spec, params, batch, gen)
    ref_logprobs, teacher_top = None, (None, None)
    if spec.ref_apply is not None:
        frozen = spec.policy_params(params) if spec.ref_is_policy else ref_params
        if spec.distill_top_k:  # the teacher's top k beside its log-probs of the sampled tokens, one forward
            ref_logprobs, *teacher_top = teacher_outputs(spec.ref_apply, frozen, batch, spec.distill_top_k,
                                                         spec.temperature)
        else:
            ref_logprobs = _reference_logprobs(spec, frozen, batch)
    raw_scores, model_scores = _raw_scores(spec, reward_params, batch, host_scores, usual)

    contains_eos = _stopped(spec, gen, truncated)
    scores, penalty, score_moments = _shaped_scores(spec, raw_scores, contains_eos, lengths, budget, score_moments)
    if ref_logprobs is not None:
        kl = kl_per_token(logprobs, ref_logprobs, spec.kl_estimator) * response_mask
    else:
        kl = jnp.zeros_like(logprobs)
    rewards, non_score = kl_shaped_rewards(kl, scores, response_mask, kl_state.beta)
    # A completion's sequence score for the group estimators: the score plus its summed KL
    # penalty (the sum of its rewards), kept as a field rather than recovered from `rewards`.
    sequence_scores = scores + masked_sum(non_score, response_mask.astype(jnp.float32), axis=1)
    # Truncated completions still count in their group's statistics (their scores above);
    # a zero mask leaves them out of every loss term.
    train_mask = response_mask
    if spec.mask_truncated:
        train_mask = response_mask * contains_eos[:, None].astype(response_mask.dtype)
    rollout = RolloutBatch(query_tokens=batch["query_tokens"], query_mask=batch["query_mask"],
                           response_tokens=gen.tokens, response_mask=train_mask, logprobs=logprobs, values=values,
                           rewards=rewards, ref_logprobs=ref_logprobs if spec.keep_ref_logprobs else None,
                           scores=sequence_scores, sampler_logprobs=gen.logprobs,
                           response_attention_mask=batch.get("response_attention_mask"),
                           teacher_top_logprobs=teacher_top[0], teacher_top_ids=teacher_top[1], routing=routing,
                           images=batch.get("images"))
    stats = _statistics(spec, logprobs, response_mask, _Scored(kl, non_score, scores, raw_scores, penalty), kl_state,
                        contains_eos, lengths, ref_logprobs is not None)
    if model_scores is not None:
        stats["per_row/model_scores"] = model_scores
    return rollout, stats, score_moments
