"""The PPO math: pure functions on arrays.

Shapes use B for rows, T for response tokens and V for the vocabulary. `mask` arrays are
1 (or True) at real response tokens and 0 at padding; masked statistics count only the
real tokens. Every function here is pure and jit-friendly; none knows about models.
"""

from __future__ import annotations

from typing import NamedTuple

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
    "KL_ESTIMATORS",
    "kl_per_token",
    "kl_shaped_rewards",
    "at_last_token",
    "KLControllerState",
    "fixed_kl_controller",
    "adaptive_kl_update",
    "RunningMoments",
    "running_moments_update",
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


KL_ESTIMATORS = ("k1", "k3", "abs", "mse")


def kl_per_token(logprobs, ref_logprobs, estimator: str = "k1"):
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    With logr = ref_logprobs - logprobs:
      k1: -logr (unbiased, can be negative per token)
      k3: (exp(logr) - 1) - logr (unbiased, always >= 0)
      abs: |logr|
      mse: 0.5 * logr^2
    """
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        return jnp.expm1(logr) - logr
    if estimator == "abs":
        return jnp.abs(logr)
    if estimator == "mse":
        return 0.5 * jnp.square(logr)
    raise ValueError(f"kl estimator {estimator!r} is invalid; valid estimators: {', '.join(KL_ESTIMATORS)}")


def kl_shaped_rewards(kl, scores, mask, beta):
    """Per-token rewards: -beta * kl at each real token, plus the sequence score at the last
    real token. kl (B, T), scores (B,), mask (B, T) prefix of ones -> (B, T), 0 at padding.

    Returns (rewards, non_score_rewards)."""
    mask = mask.astype(jnp.float32)
    non_score = -beta * kl * mask
    return non_score + at_last_token(scores, mask), non_score


def at_last_token(values, mask):
    """(B,) values placed at each row's last real token of a (B, T) prefix mask, 0 elsewhere
    (and everywhere in a row without real tokens)."""
    mask = mask.astype(jnp.float32)
    last = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.int32) - 1, 0)
    return jax.nn.one_hot(last, mask.shape[1], dtype=jnp.float32) * mask * values[:, None]


class KLControllerState(NamedTuple):
    """beta: the current KL coefficient (float32 scalar). target, horizon: the adaptive
    controller's settings (target <= 0 means a fixed coefficient)."""

    beta: jax.Array
    target: jax.Array
    horizon: jax.Array


def fixed_kl_controller(beta: float) -> KLControllerState:
    return KLControllerState(jnp.float32(beta), jnp.float32(0.0), jnp.float32(1.0))


def adaptive_kl_update(state: KLControllerState, current_kl, n_steps) -> KLControllerState:
    """Ziegler et al. (2019) adaptive KL: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) *
    n_steps / horizon. A state with target <= 0 is fixed and returned unchanged."""
    error = jnp.clip(current_kl / jnp.where(state.target > 0, state.target, 1.0) - 1.0, -0.2, 0.2)
    mult = 1.0 + error * n_steps / state.horizon
    beta = jnp.where(state.target > 0, state.beta * mult, state.beta)
    return state._replace(beta=beta.astype(jnp.float32))


class RunningMoments(NamedTuple):
    """Running mean, variance (population) and count of a scalar stream."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def zeros(cls) -> "RunningMoments":
        return cls(jnp.float32(0.0), jnp.float32(1.0), jnp.float32(0.0))


def running_moments_update(state: RunningMoments, x) -> RunningMoments:
    """Merge a batch `x` (any shape) into the running moments (Chan et al. parallel update)."""
    x = x.astype(jnp.float32).ravel()
    n = jnp.float32(x.size)
    batch_mean = jnp.mean(x)
    batch_var = jnp.var(x)
    total = state.count + n
    delta = batch_mean - state.mean
    mean = state.mean + delta * n / total
    m2 = state.var * state.count + batch_var * n + jnp.square(delta) * state.count * n / total
    return RunningMoments(mean, m2 / total, total)


# The critic-free estimators, aggregation modes and clipping live in their own module of
# the math layer; they are part of `jaxppo.math` too. Imported last: that module uses the
# masked statistics defined above.
from jaxppo.critic_free import (  # noqa: E402
    aggregate_loss,
    clipped_policy_loss,
    discounted_returns,
    group_baseline,
    grpo_advantages,
    kl_loss_per_token,
    zero_std_groups,
    reinforce_pp_advantages,
    rloo_advantages,
    sequence_log_ratio,
)

__all__ += ["grpo_advantages", "zero_std_groups", "rloo_advantages", "group_baseline", "discounted_returns", "reinforce_pp_advantages",
            "aggregate_loss", "sequence_log_ratio", "clipped_policy_loss", "kl_loss_per_token"]
