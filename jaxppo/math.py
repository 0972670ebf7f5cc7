"""The PPO math: pure functions on arrays.

Shapes use B for rows, T for response tokens and V for the vocabulary. `mask` arrays are
1 (or True) at real response tokens and 0 at padding; masked statistics count only the
real tokens. Every function here is pure and jit-friendly; none knows about models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "gae",
    "logprobs_from_logits",
    "entropy_from_logits",
    "policy_loss",
    "value_loss",
    "approx_kl",
]


def masked_sum(x, mask, axis=None):
    """Sum of x where mask is set, over `axis` (all axes when None). Entries outside the
    mask are never read into the sum (a NaN or inf there does not leak)."""
    return jnp.sum(jnp.where(mask.astype(bool), x, jnp.zeros_like(x)), axis=axis)


def masked_mean(x, mask, axis=None):
    """masked_sum(x) / sum(mask) over `axis`; 0 where the mask is empty (no NaN)."""
    count = jnp.sum(mask.astype(x.dtype), axis=axis)
    return masked_sum(x, mask, axis=axis) / jnp.maximum(count, 1.0)


def masked_var(x, mask, unbiased: bool = True):
    """Variance of the masked entries of `x` (all axes).

    var = mean_m((x - mean_m(x))^2), times n / (n - 1) (Bessel) when `unbiased`, where
    n = sum(mask). With n <= 1 the Bessel factor is skipped (the variance is then 0).
    """
    mask = mask.astype(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    if unbiased:
        n = jnp.sum(mask)
        var = jnp.where(n > 1, var * n / jnp.maximum(n - 1.0, 1.0), var)
    return var


def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps) with mean and (unbiased) variance over masked entries.

    With `shift_mean=False` the mean is added back: only the scale changes (used for
    rewards, whose sign carries meaning). Masked-out entries are returned as 0.
    """
    mask = mask.astype(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    white = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * mask


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens, by a reverse `lax.scan`.

    Args:
      rewards: (B, T) per-token rewards r_t.
      values: (B, T) value estimates V(s_t) of the state before token t.
      mask: (B, T) 1 at real response tokens. The episode ends after the last real
        token: V(s_{t+1}) counts only where mask[t + 1] is 1.
      gamma, lam: discount and GAE lambda.

    Returns:
      (advantages, returns), each (B, T), zero at masked-out tokens:
        delta_t = r_t + gamma * m_{t+1} * V_{t+1} - V_t
        A_t = delta_t + gamma * lam * m_{t+1} * A_{t+1}
        returns_t = A_t + V_t
    """
    dtype = jnp.result_type(rewards, values, jnp.float32)
    mask = mask.astype(dtype)
    rewards = rewards.astype(dtype) * mask
    values = values.astype(dtype) * mask
    # m_{t+1} * V_{t+1}: shift left by one token; nothing follows the last token.
    next_mask = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_mask * next_values - values

    def backward(carry, inputs):
        delta_t, next_mask_t = inputs
        adv_t = delta_t + gamma * lam * next_mask_t * carry
        return adv_t, adv_t

    # Scan over time (axis 0 after the transpose), last token first.
    _, adv_t_major = jax.lax.scan(
        backward, jnp.zeros(rewards.shape[0], dtype), (deltas.T, next_mask.T), reverse=True
    )
    advantages = adv_t_major.T * mask
    returns = (advantages + values) * mask
    return advantages, returns


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


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange: float):
    """Clipped surrogate objective, as a loss to minimise.

    ratio = exp(logprobs - old_logprobs)
    loss = mean_m(max(-A * ratio, -A * clip(ratio, 1 - c, 1 + c)))

    Returns (loss, clipfrac), where clipfrac = mean_m(1[clipped term > unclipped term]),
    the fraction of tokens whose gradient the clip switched off.
    """
    ratio = jnp.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).astype(jnp.float32), mask)
    return loss, clipfrac


def value_loss(values, old_values, returns, mask, cliprange_value: float):
    """Clipped value loss.

    v_clip = old_values + clip(values - old_values, -c, c)
    loss = 0.5 * mean_m(max((values - returns)^2, (v_clip - returns)^2))

    Returns (loss, clipfrac), clipfrac = mean_m(1[clipped error > unclipped error]).
    """
    clipped_values = old_values + jnp.clip(values - old_values, -cliprange_value, cliprange_value)
    err = jnp.square(values - returns)
    err_clipped = jnp.square(clipped_values - returns)
    loss = 0.5 * masked_mean(jnp.maximum(err, err_clipped), mask)
    clipfrac = masked_mean((err_clipped > err).astype(jnp.float32), mask)
    return loss, clipfrac


def approx_kl(logprobs, old_logprobs, mask):
    """Approximate KL(old || new) = 0.5 * mean_m((logprobs - old_logprobs)^2), as in TRL."""
    return 0.5 * masked_mean(jnp.square(logprobs - old_logprobs), mask)
