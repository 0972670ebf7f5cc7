"""The losses' math: log-probs and entropies from logits, importance ratios (per token or
per completion: GSPO, TRL's RLOO), the clipped surrogate with asymmetric and dual clipping,
the clipped value loss, the approximate KL, and the loss aggregation modes every algorithm's
loss is reduced by. Pure functions on arrays (they import only the masked statistics);
`jaxppo.update.objective.ppo_loss` puts them together.

Shapes: B rows (completions), T response tokens, V the vocabulary. `mask` is 1 at real
response tokens and 0 at padding; masked statistics count only the real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxppo.update.stats import masked_mean, masked_sum

__all__ = [
    "LOSS_AGGREGATIONS",
    "IMPORTANCE_RATIOS",
    "logprobs_from_logits",
    "entropy_from_logits",
    "aggregate_loss",
    "sequence_log_ratio",
    "log_importance_ratio",
    "clipped_policy_loss",
    "policy_loss",
    "value_loss",
    "approx_kl",
]

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum_batch_norm")
IMPORTANCE_RATIOS = ("token", "sequence", "sequence_sum")


def logprobs_from_logits(logits, tokens, temperature: float = 1.0):
    """log softmax(logits / temperature)[tokens]: (B, T, V), (B, T) -> (B, T).

    The temperature is the sampling temperature, so these are the log-probabilities of
    the distribution the tokens were actually drawn from.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def entropy_from_logits(logits, temperature: float = 1.0):
    """Entropy (nats) of softmax(logits / temperature) per position: (..., V) -> (...)."""
    logits = logits.astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


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
    `jaxppo.update.correction.correction_weights`), reduced by
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


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float):
    """Clipped surrogate objective (symmetric clip, token mean), as a loss to minimise.

    ratio = exp(logprobs - old_logprobs)
    loss = mean_m(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)))

    Returns (loss, clipfrac), where clipfrac = mean_m(1[clipped term > unclipped term]),
    the fraction of tokens whose gradient the clip switched off. The special case
    low = high = c of `clipped_policy_loss`, which every algorithm's loss uses.
    """
    loss, metrics = clipped_policy_loss(logprobs - old_logprobs, advantages, mask, cliprange, cliprange)
    return loss, metrics["clipfrac"]


def value_loss(values, old_values, returns, mask, cliprange_value: float, aggregation: str = "token_mean",
               max_length: int = None):
    """Clipped value loss.

    v_clip = old_values + clip(values - old_values, -c, c)
    loss = 0.5 * agg_m(max((values - returns)^2, (v_clip - returns)^2))

    where agg is `aggregate_loss(..., aggregation, max_length)` (the token mean by default).
    Returns (loss, clipfrac), clipfrac = mean_m(1[clipped error > unclipped error]) (a
    token mean whatever the aggregation).
    """
    clipped_values = old_values + jnp.clip(values - old_values, -cliprange_value, cliprange_value)
    err = jnp.square(values - returns)
    err_clipped = jnp.square(clipped_values - returns)
    loss = 0.5 * aggregate_loss(jnp.maximum(err, err_clipped), mask, aggregation, max_length)
    clipfrac = masked_mean((err_clipped > err).astype(jnp.float32), mask)
    return loss, clipfrac


def approx_kl(logprobs, old_logprobs, mask):
    """Approximate KL(old || new) = 0.5 * mean_m((logprobs - old_logprobs)^2), as in TRL."""
    return 0.5 * masked_mean(jnp.square(logprobs - old_logprobs), mask)
