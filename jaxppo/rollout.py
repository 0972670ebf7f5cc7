"""Rollout collection: prompts + policy + reference + critic + reward -> a `Rollout`.

Two compiled stages with a host step between them only when the reward is a Python
function on decoded text:

    sample(params, prompts, key)                        -> GenerationOutput     (jit)
    [scores = reward_fn(prompt texts, response texts)]                          (host, checked)
    finish(params, ref_params, reward_params, ...)      -> Rollout, stats       (jit)

`finish` recomputes the policy's log-probs and the critic's values with the same function
the PPO loss uses (so the first update sees ratio 1), the reference log-probs, the scores
(reward model, token-level reward function, or the host scores), the missing-EOS penalty,
DAPO's overlong punishment, score normalisation and clipping, per-token KL, and rewards =
-beta * KL with the score added at the last real response token; with
`mask_truncated`, completions without a stop token get a zero response mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import math as ppo_math
from jaxppo import packing
from jaxppo.kl import check_kl_estimator
from jaxppo.models.continuous import generate_continuous
from jaxppo.models.generate import GenerationOutput, generate
from jaxppo.models.model import Model
from jaxppo.rollout_types import Rollout, joined, response_attention, response_outputs, scorer
from jaxppo.shaping import default_overlong_buffer, overlong_penalty

__all__ = ["RolloutSpec", "sample_responses", "finish_rollout", "check_scores", "nonfinite_rows", "RewardError"]


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Everything static about rollouts (hashable: a static jit argument).

    Attributes:
      policy: the causal-LM `Model` that samples (kind "causal_lm" or "causal_lm_value").
      apply_fn: the train state's `apply_fn(params, tokens, mask) -> (logits, values)`.
      policy_params_key: where the policy's params sit in the train params (None: the
        params are the policy's own, as with a shared trunk; "policy" for PolicyAndCritic).
      ref_apply: `ref_apply(ref_params, tokens, mask) -> logits`; one that offers
        `response_outputs` (a built-in model) scores without full logits. None: no
        reference (no KL in the reward or the loss); the KL is then 0 and not reported.
      ref_is_policy: the reference runs on the policy's own params (`ref_apply` is the
        policy's base model: a LoRA policy with `adapters=False`), so no `ref_params` are
        passed and no second copy of the weights exists.
      keep_ref_logprobs: put the reference log-probs in the rollout (`ref_logprobs`) for a
        KL term in the loss.
      reward_apply: `reward_apply(reward_params, tokens, mask) -> (B,)` scores, or None.
      reward_weight: the reward model's weight in the score (weighted reward functions on
        the host add theirs).
      token_reward_fn: a jittable `fn(prompt_ids, prompt_mask, response_ids, response_mask)
        -> (B,)` scores, or None.
      response_length, temperature, stop_token_ids, pad_token_id: sampling.
      kl_estimator: "k1", "k3", "abs" or "mse".
      missing_eos_penalty: subtracted from the score of responses without a stop token.
      normalize_scores: standardise scores by running mean/std before use.
      score_clip: clip (normalised) scores to [-score_clip, score_clip].
      uses_critic: the rollout carries the critic's values (PPO); False: `values` is None.
      num_generations: G, rows per prompt (consecutive): each prompt is prefilled once
        and its KV cache shared by its G rows (`jaxppo.models.generate`).
      num_slots: None (the static sampler) or the slots of the continuous-batching engine
        (`jaxppo.models.continuous`); the same tokens either way.
      overlong_penalty_factor, overlong_buffer: DAPO's soft overlong punishment of the
        scores (`jaxppo.shaping.overlong_penalty`; factor 0: off; buffer None: a fifth of
        `response_length`), from `PPOConfig`.
      mask_truncated: zero the rollout's response mask of completions without a stop token
        (`PPOConfig.mask_truncated_completions`), so the loss leaves them out.
      pack_sequences, pack_streams, pack_length: score the batch packed (`jaxppo.packing`:
        the policy's, critic's and reference's forwards over `pack_streams` streams of
        `pack_length` tokens, None: Q + R); `jaxppo.stages.build_rollout` sets the streams
        for each batch from its lengths. The reward model still scores padded rows.
    """

    policy: Model
    apply_fn: Callable
    ref_apply: Optional[Callable]
    response_length: int
    temperature: float = 1.0
    policy_params_key: Optional[str] = None
    reward_apply: Optional[Callable] = None
    reward_weight: float = 1.0
    keep_ref_logprobs: bool = False
    ref_is_policy: bool = False
    token_reward_fn: Optional[Callable] = None
    stop_token_ids: Tuple[int, ...] = ()
    pad_token_id: int = 0
    kl_estimator: str = "k1"
    missing_eos_penalty: Optional[float] = None
    normalize_scores: bool = False
    score_clip: Optional[float] = None
    uses_critic: bool = True
    num_generations: int = 1
    num_slots: Optional[int] = None
    overlong_penalty_factor: float = 0.0
    overlong_buffer: Optional[int] = None
    mask_truncated: bool = False
    pack_sequences: bool = False
    pack_streams: Optional[int] = None
    pack_length: Optional[int] = None

    def __post_init__(self):
        check_kl_estimator("kl_estimator=", self.kl_estimator)
        if self.overlong_buffer is not None and self.overlong_buffer > self.response_length:
            raise ValueError(f"PPOConfig.overlong_buffer={self.overlong_buffer} is longer than the response budget "
                             f"(response_length={self.response_length}); it must be in [1, {self.response_length}] "
                             "(None: a fifth of the budget)")
        if self.mask_truncated and not self.stop_token_ids:
            raise ValueError("PPOConfig.mask_truncated_completions=True needs a stop token (TrainerConfig."
                             "stop_token_id, or a tokenizer with an eos_token_id): without one every completion "
                             "is truncated and nothing would be trained")

    @property
    def buffer(self) -> int:
        """The overlong buffer in tokens (the configured one, or a fifth of the budget)."""
        return self.overlong_buffer or default_overlong_buffer(self.response_length)

    def policy_params(self, params):
        return params if self.policy_params_key is None else params[self.policy_params_key]


def sample_responses(spec: RolloutSpec, params, prompt_ids, prompt_mask, key) -> GenerationOutput:
    """Sample `spec.response_length` tokens per prompt from the current policy (compiled)."""
    common = dict(response_length=spec.response_length, temperature=spec.temperature,
                  stop_token_ids=spec.stop_token_ids, pad_token_id=spec.pad_token_id)
    if spec.num_slots is not None:
        return generate_continuous(spec.policy, spec.policy_params(params), prompt_ids, prompt_mask, key,
                                   num_slots=spec.num_slots, **common)
    return generate(spec.policy, spec.policy_params(params), prompt_ids, prompt_mask, key,
                    num_generations=spec.num_generations, **common)


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number per response."""


def check_scores(scores, batch: int, name: str = "reward function", prompts=None, responses=None,
                 allow_none: bool = False):
    """Validate what a host-side reward function returned: one real number (int, float,
    numpy scalar or 0-d array) per response, `batch` of them, as a list, tuple or 1-D array.
    Returns float32 (batch,). Non-finite numbers pass through (the trainer reports or skips
    them for every kind of reward alike). With `allow_none`, None means "no opinion on this
    row": returns (scores with 0 there, given: bool (batch,) False there).

    Raises `RewardError` naming the function (`name`), the row and the value, and the row's
    prompt and response when given."""

    def row_text(i):
        if prompts is None or responses is None:
            return ""
        return f" (prompt {prompts[i][:40]!r}, response {responses[i][:40]!r})"

    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise RewardError(f"{name} returned a {type(scores).__name__} ({scores!r:.60}); it must return a list or 1-D "
                          f"array of {batch} numbers, one per response")
    if isinstance(scores, np.ndarray) and scores.ndim != 1:
        raise RewardError(f"{name} returned an array of shape {scores.shape}; expected ({batch},): one number per "
                          "response")
    if len(scores) != batch:
        raise RewardError(f"{name} returned {len(scores)} scores for {batch} responses; expected ({batch},): one "
                          "number per response")
    out = np.empty(batch, np.float32)
    given = np.ones(batch, bool)
    for i, value in enumerate(scores):
        if value is None and allow_none:
            out[i], given[i] = 0.0, False
            continue
        if value is None:
            raise RewardError(f"{name} returned None at row {i}{row_text(i)}: every response needs a score (a reward "
                              "function with no opinion on a row must still return a number for it)")
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise RewardError(f"{name} returned {value!r:.60} ({type(value).__name__}) at row {i}{row_text(i)}; "
                              "each score must be a real number (int or float)")
        out[i] = float(value)
    return (out, given) if allow_none else out


def nonfinite_rows(scores) -> np.ndarray:
    """Indices of the non-finite entries of (B,) scores (on the host)."""
    return np.flatnonzero(~np.isfinite(np.asarray(scores, np.float64)))


def _outputs(spec: RolloutSpec, apply_fn, params, batch):
    """(log-probs, values, entropies) of the response tokens: packed when the spec says
    so, else padded."""
    if spec.pack_streams is not None:
        return packing.response_outputs(apply_fn, params, batch, spec.temperature, spec.pack_streams,
                                        spec.pack_length)
    return response_outputs(apply_fn, params, batch, spec.temperature)


def _reference_logprobs(spec: RolloutSpec, ref_params, batch):
    """The reference policy's log-probs of the response tokens, (B, R)."""
    if spec.pack_streams is not None:
        return _outputs(spec, spec.ref_apply, ref_params, batch)[0]
    ref_scorer = scorer(spec.ref_apply)
    if ref_scorer is not None:  # a built-in model: no full logits
        return ref_scorer(ref_params, batch["query_tokens"], batch["query_mask"], batch["response_tokens"],
                          response_attention(batch), spec.temperature)[0]
    q, r = batch["query_tokens"].shape[1], batch["response_tokens"].shape[1]
    tokens, mask = joined(batch)
    ref_logits = spec.ref_apply(ref_params, tokens, mask)[:, q - 1 : q - 1 + r]
    return ppo_math.logprobs_from_logits(ref_logits, batch["response_tokens"], spec.temperature)


def _raw_scores(spec: RolloutSpec, reward_params, batch, host_scores):
    """(B,) scores before penalties and normalisation: the reward model's (weighted) or the
    token function's, plus the host's; and the reward model's own (or None)."""
    b = batch["query_tokens"].shape[0]
    model_scores = None
    if spec.reward_apply is not None:
        model_scores = spec.reward_apply(reward_params, *joined(batch)).astype(jnp.float32)
        raw_scores = spec.reward_weight * model_scores
    elif spec.token_reward_fn is not None:
        raw_scores = jnp.asarray(spec.token_reward_fn(batch["query_tokens"], batch["query_mask"],
                                                      batch["response_tokens"], response_attention(batch)),
                                 jnp.float32)
    else:
        raw_scores = jnp.zeros((b,), jnp.float32)
    if host_scores is not None:
        raw_scores = raw_scores + host_scores.astype(jnp.float32)
    if raw_scores.shape != (b,):
        raise ValueError(f"scores have shape {raw_scores.shape}; expected ({b},)")
    return raw_scores, model_scores


def _statistics(spec: RolloutSpec, logprobs, response_mask, kl, non_score, scores, raw_scores, kl_state,
                contains_eos, lengths, penalty, with_kl: bool) -> dict:
    """The rollout's TRL-named statistics (device scalars) and the raw scores per row."""
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


@functools.partial(jax.jit, static_argnames=("spec",))
def finish_rollout(spec: RolloutSpec, params, ref_params, reward_params, prompt_ids, prompt_mask,
                   gen: GenerationOutput, host_scores, kl_state: ppo_math.KLControllerState,
                   score_moments: ppo_math.RunningMoments):
    """Build the `Rollout` and its statistics from sampled responses (compiled).

    host_scores: (B,) scores from text reward functions (weighted and summed), or None;
    added to the reward model's scores (times `spec.reward_weight`) when the spec has one. Returns (rollout, stats, score_moments), with
    TRL-named statistics: objective/kl, objective/entropy, objective/non_score_reward,
    objective/rlhf_reward, objective/scores, val/num_eos_tokens, ..., and the (B,) scores
    before penalties and normalisation as `per_row/raw_scores` (the reward model's own as
    `per_row/model_scores`). Without a reference, `objective/kl` is absent.
    """
    response_mask = gen.mask  # the policy's tokens
    # A multi-turn episode (`jaxppo.environments.EpisodeOutput`) also has the environment's
    # tokens in the sequence, and says which episodes ran out of budget.
    attention = getattr(gen, "attention_mask", None)
    truncated = getattr(gen, "truncated", None)
    batch = {"query_tokens": prompt_ids, "query_mask": prompt_mask,
             "response_tokens": gen.tokens, "response_mask": response_mask}
    if attention is not None:
        batch["response_attention_mask"] = attention
    logprobs, values, _ = _outputs(spec, spec.apply_fn, params, batch)
    if not spec.uses_critic:
        values = None  # the critic-free algorithms carry no values
    ref_logprobs = None
    if spec.ref_apply is not None:
        ref_logprobs = _reference_logprobs(spec, spec.policy_params(params) if spec.ref_is_policy else ref_params,
                                           batch)
    raw_scores, model_scores = _raw_scores(spec, reward_params, batch, host_scores)

    stop_ids = jnp.asarray(spec.stop_token_ids or (-1,), jnp.int32)
    if truncated is None:
        contains_eos = jnp.any(jnp.isin(gen.tokens, stop_ids) & (response_mask > 0), axis=1)
    else:  # an episode ends without running out of budget, stop token or not
        contains_eos = ~truncated
    scores = raw_scores
    if spec.missing_eos_penalty is not None:
        scores = jnp.where(contains_eos, scores, scores - spec.missing_eos_penalty)
    lengths = jnp.sum(response_mask if attention is None else attention, axis=1)
    if spec.overlong_penalty_factor:
        penalty = overlong_penalty(lengths, gen.tokens.shape[1], spec.buffer, spec.overlong_penalty_factor)
        scores = scores + penalty
    if spec.normalize_scores:
        score_moments = ppo_math.running_moments_update(score_moments, scores)
        scores = (scores - score_moments.mean) / jnp.sqrt(score_moments.var + 1e-8)
    if spec.score_clip is not None:
        scores = jnp.clip(scores, -spec.score_clip, spec.score_clip)

    if ref_logprobs is not None:
        kl = ppo_math.kl_per_token(logprobs, ref_logprobs, spec.kl_estimator) * response_mask
    else:
        kl = jnp.zeros_like(logprobs)
    rewards, non_score = ppo_math.kl_shaped_rewards(kl, scores, response_mask, kl_state.beta)
    # A completion's sequence score for the group estimators: the score plus its summed KL
    # penalty (the sum of its rewards), kept as a field rather than recovered from `rewards`.
    sequence_scores = scores + ppo_math.masked_sum(non_score, response_mask.astype(jnp.float32), axis=1)
    # Truncated completions still count in their group's statistics (their scores above);
    # a zero mask leaves them out of every loss term.
    train_mask = response_mask
    if spec.mask_truncated:
        train_mask = response_mask * contains_eos[:, None].astype(response_mask.dtype)
    rollout = Rollout(query_tokens=prompt_ids, query_mask=prompt_mask, response_tokens=gen.tokens,
                      response_mask=train_mask, logprobs=logprobs, values=values, rewards=rewards,
                      ref_logprobs=ref_logprobs if spec.keep_ref_logprobs else None, scores=sequence_scores,
                      sampler_logprobs=gen.logprobs, response_attention_mask=attention)
    stats = _statistics(spec, logprobs, response_mask, kl, non_score, scores, raw_scores, kl_state, contains_eos,
                        lengths, penalty if spec.overlong_penalty_factor else None, ref_logprobs is not None)
    if model_scores is not None:
        stats["per_row/model_scores"] = model_scores
    return rollout, stats, score_moments
