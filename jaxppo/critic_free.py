"""The math of critic-free RL (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++, GSPO): advantage
estimators, loss aggregation modes, asymmetric / dual clipping, sequence-level importance
ratios and KL-as-loss estimators. Pure functions on arrays, part of the math layer (they
import only `jaxppo.stats` and `jaxppo.kl`, and `jaxppo.math` re-exports them); `jaxppo.ppo`'s
`train_step` and loss put them on the engine.

Shapes: B completions (rows), T response tokens, G completions per prompt
(`num_generations`). Rows are grouped consecutively: prompt i's completions are rows
i*G ... i*G + G - 1. `mask` is 1 at real response tokens (a prefix of ones per row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxppo.kl import KL_LOSS_ESTIMATORS, kl_loss_per_token
from jaxppo.stats import masked_mean, masked_sum, masked_whiten

__all__ = [
    "GRPO_SCALES",
    "grpo_advantages",
    "zero_std_groups",
    "rloo_advantages",
    "group_baseline",
    "discounted_returns",
    "reinforce_pp_advantages",
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "sequence_log_ratio",
    "IMPORTANCE_RATIOS",
    "log_importance_ratio",
    "clipped_policy_loss",
    "KL_LOSS_ESTIMATORS",
    "kl_loss_per_token",
]

GRPO_SCALES = ("group", "batch", "none")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum_batch_norm")
IMPORTANCE_RATIOS = ("token", "sequence", "sequence_sum")


def _groups(scores, num_generations: int):
    scores = jnp.asarray(scores, jnp.float32)
    if scores.ndim != 1:
        raise ValueError(f"scores have shape {scores.shape}; expected (batch,)")
    b = scores.shape[0]
    if not isinstance(num_generations, int) or num_generations < 1 or b % num_generations:
        raise ValueError(f"num_generations={num_generations!r} must be a positive int dividing the batch of "
                         f"{b} completions")
    return scores.reshape(b // num_generations, num_generations)


def grpo_advantages(scores, num_generations: int, scale: str = "group", eps: float = 1e-4):
    """GRPO's advantage of each completion from its group's scores.

    (score - group mean) / (std + eps), std with Bessel's correction (as TRL), where std is
    the group's (`scale="group"`, GRPO), the whole batch's (`"batch"`), or no division at
    all (`"none"`, Dr. GRPO). A group of one has std 0.

    Returns (advantages (B,), zero_std (B / G,) bool: groups whose scores are all equal,
    whose advantages are therefore 0)."""
    if scale not in GRPO_SCALES:
        raise ValueError(f"scale={scale!r} is invalid; valid: {', '.join(GRPO_SCALES)}")
    groups = _groups(scores, num_generations)
    g = num_generations
    mean = jnp.mean(groups, axis=1, keepdims=True)
    centred = groups - mean
    group_std = jnp.sqrt(jnp.sum(jnp.square(centred), axis=1) / max(g - 1, 1))
    zero_std = zero_std_groups(scores, num_generations)
    if scale == "group":
        adv = centred / (group_std[:, None] + eps)
    elif scale == "batch":
        flat = groups.ravel()
        batch_std = jnp.sqrt(jnp.sum(jnp.square(flat - jnp.mean(flat))) / max(flat.size - 1, 1))
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    return adv.ravel(), zero_std


def zero_std_groups(scores, num_generations: int):
    """(B / G,) bool: the groups whose scores are all equal (every group-relative advantage
    in them is 0)."""
    groups = _groups(scores, num_generations)
    return jnp.all(groups == groups[:, :1], axis=1)


def rloo_advantages(scores, num_generations: int):
    """RLOO: each completion's score minus the mean score of the other G - 1 completions of
    its prompt. Needs G >= 2. Returns (B,)."""
    if not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"RLOO needs num_generations >= 2 (a leave-one-out baseline); got {num_generations!r}")
    groups = _groups(scores, num_generations)
    others = (jnp.sum(groups, axis=1, keepdims=True) - groups) / (num_generations - 1)
    return (groups - others).ravel()


def group_baseline(scores, num_generations: int):
    """Scores minus their group's mean (REINFORCE++ with a group baseline). Returns (B,)."""
    groups = _groups(scores, num_generations)
    return (groups - jnp.mean(groups, axis=1, keepdims=True)).ravel()


def discounted_returns(rewards, mask, gamma: float = 1.0):
    """Per-token returns G_t = sum over the real tokens s >= t of gamma^k r_s, with k the
    number of real tokens between t and s (reverse `lax.scan`); 0 at padding. Masked
    positions inside a row (a multi-turn episode's environment tokens) are skipped, not
    discounted. rewards, mask: (B, T)."""
    mask = mask.astype(jnp.float32)
    rewards = rewards.astype(jnp.float32) * mask

    def back(carry, inputs):
        r_t, m_t = inputs
        g_t = r_t + gamma * carry
        return jnp.where(m_t > 0, g_t, carry), g_t

    _, out = jax.lax.scan(back, jnp.zeros(rewards.shape[0], jnp.float32), (rewards.T, mask.T), reverse=True)
    return out.T * mask


def reinforce_pp_advantages(rewards, mask, gamma: float = 1.0):
    """REINFORCE++: per-token returns of the (KL-shaped) rewards, whitened over every real
    token of the batch (mean shifted). rewards (B, T) as `jaxppo.math.kl_shaped_rewards`
    builds them (for the group-baseline variant, pass scores through `group_baseline`
    first). Returns (B, T), 0 at padding."""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask, shift_mean=True)


def aggregate_loss(per_token, mask, mode: str, max_length: int = None):
    """Reduce a per-token loss (B, T) to a scalar.

      token_mean               sum over all real tokens / their count (DAPO; PPO's default)
      seq_mean_token_mean      mean over rows of each row's token mean (GRPO as published)
      seq_mean_token_sum_norm  mean over rows of each row's token sum / max_length
                               (Dr. GRPO; max_length: the configured response length)
      token_sum_batch_norm     sum over all real tokens / max_length, here a token count
                               given from outside (a scalar, may be traced): the rollout
                               batch's real tokens per mini-batch (TRL's "dapo")

    Names follow verl's `loss_agg_mode` (with underscores). TRL's `loss_type` "bnpo",
    "grpo" and "dr_grpo" are the first three; its "dapo" is "token_sum_batch_norm" (equal
    to "token_mean" when one mini-batch is the whole batch)."""
    mask = mask.astype(jnp.float32)
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean_token_mean":
        return jnp.mean(masked_mean(per_token, mask, axis=1))
    if mode == "seq_mean_token_sum_norm":
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"aggregation {mode!r} needs max_length, a positive int (the response length); "
                             f"got {max_length!r}")
        return jnp.mean(masked_sum(per_token, mask, axis=1) / max_length)
    if mode == "token_sum_batch_norm":
        if max_length is None:
            raise ValueError(f"aggregation {mode!r} needs the token count to divide by (max_length)")
        return masked_sum(per_token, mask) / max_length
    raise ValueError(f"loss aggregation {mode!r} is invalid; valid: {', '.join(LOSS_AGGREGATIONS)}")


def sequence_log_ratio(logprobs, old_logprobs, mask, reduce: str = "mean"):
    """A sequence-level log importance ratio, broadcast over the row's tokens, (B, T):
    over the real tokens of each row, the mean of (logprobs - old_logprobs) (GSPO,
    `reduce="mean"`) or their sum (TRL RLOOTrainer's ratio of whole-completion
    probabilities, `reduce="sum"`). Its gradient flows to every token of the row equally."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce={reduce!r} is invalid; valid: 'mean', 'sum'")
    seq = (masked_mean if reduce == "mean" else masked_sum)(logprobs - old_logprobs, mask, axis=1)
    return jnp.broadcast_to(seq[:, None], logprobs.shape)


def log_importance_ratio(logprobs, old_logprobs, mask, level: str = "token"):
    """The log importance ratio the loss clips, (B, T): per token ("token"), or one per
    completion ("sequence": GSPO's mean, "sequence_sum": the summed log-ratio)."""
    if level == "token":
        return logprobs - old_logprobs
    if level in ("sequence", "sequence_sum"):
        return sequence_log_ratio(logprobs, old_logprobs, mask, "mean" if level == "sequence" else "sum")
    raise ValueError(f"importance ratio level {level!r} is invalid; valid: {', '.join(IMPORTANCE_RATIOS)}")


def clipped_policy_loss(log_ratio, advantages, mask, cliprange_low: float, cliprange_high: float,
                        dual_clip: float = None, aggregation: str = "token_mean", max_length: int = None,
                        weights=None):
    """Clipped surrogate with an asymmetric range and an optional dual clip.

    ratio = exp(log_ratio) (token-level: logprobs - old_logprobs; GSPO:
    `sequence_log_ratio`); advantages (B, T) or (B,) (broadcast over tokens).
      per_token = max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))
      dual clip c > 1: where A < 0, per_token = min(per_token, -A * c)
    times `weights` (B, T) when given (the sampler-mismatch correction,
    `jaxppo.correction.correction_weights`), reduced by
    `aggregate_loss(..., aggregation, max_length)`.

    Returns (loss, metrics) with the token fractions (token mean over the batch):
    clip_ratio/low_mean (ratio < 1 - low with A < 0), clip_ratio/high_mean (ratio > 1 + high
    with A > 0), clip_ratio/region_mean (either), dual_clip_fraction, and clipfrac (PPO's:
    tokens whose gradient the clip switched off, clipped term > unclipped term)."""
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip={dual_clip!r} must be None or a constant > 1")
    if advantages.ndim == 1:
        advantages = jnp.broadcast_to(advantages[:, None], log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    per_token = jnp.maximum(unclipped, clipped)
    dual = jnp.zeros_like(per_token, dtype=bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (per_token > cap)
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, cap), per_token)
    if weights is not None:
        per_token = per_token * jax.lax.stop_gradient(weights)
    loss = aggregate_loss(per_token, mask, aggregation, max_length)
    low = (ratio < 1.0 - cliprange_low) & (advantages < 0)
    high = (ratio > 1.0 + cliprange_high) & (advantages > 0)
    frac = lambda x: jax.lax.stop_gradient(masked_mean(x.astype(jnp.float32), mask))
    metrics = {"clip_ratio/low_mean": frac(low), "clip_ratio/high_mean": frac(high),
               "clip_ratio/region_mean": frac(low | high), "dual_clip_fraction": frac(dual),
               "clipfrac": frac(clipped > unclipped)}
    return loss, metrics
