"""The losses' math: log-probs and entropies from logits, importance ratios (per token or
per completion: GSPO, TRL's RLOO), the policy surrogates (the clipped one with asymmetric
and dual clipping; CISPO's capped, detached weights; SAPO's soft gate; VESPO's gamma
weight of the completion's ratio), the clipped value loss, the approximate KL, on-policy
distillation's divergence to the teacher's top k, and the loss aggregation modes every
algorithm's loss is reduced by. Pure functions on arrays (they
import only the masked statistics); `jaxppo.update.objective.total_loss` puts them together.

Shapes: B rows (completions), T response tokens, V the vocabulary. `mask` is 1 at real
response tokens and 0 at padding; masked statistics count only the real tokens.
"""

from __future__ import annotations

import math

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
    "SURROGATES",
    "clipped_policy_loss",
    "cispo_policy_loss",
    "sapo_policy_loss",
    "vespo_weights",
    "vespo_policy_loss",
    "policy_loss",
    "value_loss",
    "approx_kl",
    "DISTILL_DIVERGENCES",
    "top_k_divergence",
]

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
                     "token_sum_batch_norm")
SURROGATES = ("clip", "cispo", "sapo", "vespo")
IMPORTANCE_RATIOS = ("token", "sequence", "sequence_sum")
DISTILL_DIVERGENCES = ("reverse", "forward")


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
      seq_mean_token_sum       mean over rows of each row's token sum (LUSPO: a completion
                               weighs by its length)
      seq_mean_token_sum_norm  mean over rows of each row's token sum / max_length
                               (Dr. GRPO; max_length: the configured response length)
      token_sum_batch_norm     sum over all real tokens / max_length, here a token count
                               given from outside (a scalar, may be traced): the rollout
                               batch's real tokens per mini-batch (TRL's "dapo")

    Names follow verl's `loss_agg_mode` (with underscores). TRL's `loss_type` "bnpo" and
    "grpo" are the first two, "luspo" the third, "dr_grpo" the fourth; its "dapo" (and the
    aggregation of its "cispo" and "vespo") is "token_sum_batch_norm" (equal to
    "token_mean" when one mini-batch is the whole batch)."""
    mask = mask.astype(jnp.float32)
    if mode == "token_mean":
        return masked_mean(per_token, mask)
    if mode == "seq_mean_token_mean":
        return jnp.mean(masked_mean(per_token, mask, axis=1))
    if mode == "seq_mean_token_sum":
        return jnp.mean(masked_sum(per_token, mask, axis=1))
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


def _per_token_advantages(advantages, shape):
    return jnp.broadcast_to(advantages[:, None], shape) if advantages.ndim == 1 else advantages


def _fraction(x, mask):
    return jax.lax.stop_gradient(masked_mean(x.astype(jnp.float32), mask))


def cispo_policy_loss(logprobs, log_ratio, advantages, mask, cap: float, aggregation: str = "token_mean",
                      max_length: int = None, weights=None):
    """CISPO (MiniMax-M1; ScaleRL): the importance weight is capped and detached, and every
    token keeps a gradient (no token is clipped out of the update):
      per_token = -sg(min(ratio, cap)) * A * logprobs
    times `weights` (detached) when given, reduced by `aggregate_loss`. Its gradient is
    min(ratio, cap) * A * grad log pi. (TRL's `loss_type="cispo"` with `epsilon_high=cap`.)

    Returns (loss, metrics): clipfrac (tokens whose weight the cap lowered) and
    clip_ratio/high_mean (those with A > 0: TRL's `cispo_clip_ratio`)."""
    advantages = _per_token_advantages(advantages, log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    per_token = -jax.lax.stop_gradient(jnp.minimum(ratio, cap)) * advantages * logprobs
    if weights is not None:
        per_token = per_token * jax.lax.stop_gradient(weights)
    capped = ratio > cap
    return aggregate_loss(per_token, mask, aggregation, max_length), {
        "clipfrac": _fraction(capped, mask), "clip_ratio/high_mean": _fraction(capped & (advantages > 0), mask)}


def sapo_policy_loss(log_ratio, advantages, mask, temperatures, aggregation: str = "seq_mean_token_mean",
                     max_length: int = None, weights=None):
    """SAPO (Soft Adaptive Policy Optimization): a smooth gate of the ratio instead of a hard
    clip, with temperature tau_pos where A > 0 and tau_neg elsewhere:
      per_token = -(4 / tau) * sigmoid(tau * (ratio - 1)) * A
    times `weights` (detached) when given, reduced by `aggregate_loss`. On-policy (ratio 1)
    its gradient equals the unclipped surrogate's; it fades smoothly as the ratio moves away.
    (TRL's `loss_type="sapo"`, `sapo_temperature_pos`/`_neg` = `temperatures`.)

    Returns (loss, metrics): sapo_gate, the mean of the gate's slope 4 s (1 - s) (s the
    sigmoid), the factor on the ratio's gradient (1 on-policy, toward 0 far off it)."""
    advantages = _per_token_advantages(advantages, log_ratio.shape)
    tau_pos, tau_neg = temperatures
    tau = jnp.where(advantages > 0, tau_pos, tau_neg)
    gate = jax.nn.sigmoid(tau * (jnp.exp(log_ratio) - 1.0))
    per_token = -(4.0 / tau) * gate * advantages
    if weights is not None:
        per_token = per_token * jax.lax.stop_gradient(weights)
    slope = jax.lax.stop_gradient(4.0 * gate * (1.0 - gate))
    return aggregate_loss(per_token, mask, aggregation, max_length), {"sapo_gate": masked_mean(slope, mask)}


_VESPO_LOG_FLOOR = math.log(1e-8)


def vespo_weights(log_ratio, advantages, mask, shape, log_correction=None):
    """VESPO's weight phi(w) of each completion, broadcast over its tokens, (B, T), detached:
    w the completion's importance weight exp(sum over real tokens of the per-token log-ratio,
    each clipped to [-20, 20]; plus, when given, the sum of `log_correction`, the log of the
    sampler-mismatch weights, each clipped to [log 1e-8, 20]), its log clipped to
    [log 1e-8, 20], and
      phi(w) = exp(lam + k log w - lam w)    (phi(1) = 1; 0 where not finite)
    with (k, lam) = (k_pos, lam_pos) where A >= 0, else (k_neg, lam_neg): `shape` =
    (k_pos, lam_pos, k_neg, lam_neg), lam floored at 1e-4. No length normalisation."""
    k_pos, lam_pos, k_neg, lam_neg = shape
    seq = masked_sum(jnp.clip(log_ratio, -20.0, 20.0), mask, axis=1)
    if log_correction is not None:
        seq = seq + masked_sum(jnp.clip(log_correction, _VESPO_LOG_FLOOR, 20.0), mask, axis=1)
    log_w = jnp.clip(seq, _VESPO_LOG_FLOOR, 20.0)[:, None]
    nonneg = _per_token_advantages(advantages, log_ratio.shape) >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lam_pos, lam_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def vespo_policy_loss(logprobs, log_ratio, advantages, mask, shape, aggregation: str = "token_mean",
                      max_length: int = None, log_correction=None, weights=None):
    """VESPO (Variational sEquence-level Soft Policy Optimization): a smooth, asymmetric gamma
    weight of the completion's whole importance weight in place of clipping
    (`vespo_weights`), detached:
      per_token = -phi * A * logprobs
    times `weights` (detached) when given, reduced by `aggregate_loss`. The sampler-mismatch
    correction enters through w (`log_correction`), not as a factor. `log_ratio` is the
    per-token one. (TRL's `loss_type="vespo"`, `vespo_k_pos`, `vespo_lambda_pos`,
    `vespo_k_neg`, `vespo_lambda_neg` = `shape`.)

    Returns (loss, metrics): vespo_phi, the token mean of phi (TRL's `vespo/phi_seq_mean`)."""
    advantages = _per_token_advantages(advantages, log_ratio.shape)
    phi = vespo_weights(log_ratio, advantages, mask, shape, log_correction)
    per_token = -phi * advantages * logprobs
    if weights is not None:
        per_token = per_token * jax.lax.stop_gradient(weights)
    return aggregate_loss(per_token, mask, aggregation, max_length), {"vespo_phi": masked_mean(phi, mask)}


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


# The least probability mass the bucket of the tokens outside the teacher's top k is given:
# with k = the vocabulary it is empty up to float rounding on both sides (its term is then 0).
_REST_FLOOR = 1e-6


def _log_rest(top_logprobs):
    """log(1 - sum(exp(top_logprobs))) over the last axis: the log-mass of the tokens outside
    the top k, at least log(_REST_FLOOR)."""
    total = jax.nn.logsumexp(top_logprobs, axis=-1)
    return jnp.log(-jnp.expm1(jnp.minimum(total, math.log1p(-_REST_FLOOR))))


def top_k_divergence(student_top, teacher_top, kind: str = "reverse"):
    """Per-token KL divergence between the student and the teacher, (B, T) float32, over
    the teacher's top k tokens and one bucket for all the others: the two distributions
    coarsened to k + 1 outcomes (the teacher's k most likely tokens, each its own outcome,
    and the rest of the vocabulary as one), which is at most the full divergence and equal
    to it when k is the vocabulary.

    student_top, teacher_top: (B, T, k) log-probs of the teacher's top-k token ids under
    the student (differentiable) and under the teacher. kind: "reverse" KL(student ||
    teacher) = sum q (log q - log p), or "forward" KL(teacher || student) = sum p (log p -
    log q), q the student's and p the teacher's coarsened probabilities. The bucket's mass
    is 1 minus the top k's, floored at 1e-6 on each side (an empty bucket contributes 0)."""
    if kind not in DISTILL_DIVERGENCES:
        raise ValueError(f"kind={kind!r} is invalid; use one of {DISTILL_DIVERGENCES}")
    q = jnp.concatenate([student_top, _log_rest(student_top)[..., None]], axis=-1).astype(jnp.float32)
    p = jnp.concatenate([teacher_top, _log_rest(teacher_top)[..., None]], axis=-1).astype(jnp.float32)
    if kind == "forward":
        q, p = p, q
    return jnp.sum(jnp.exp(q) * (q - p), axis=-1)
