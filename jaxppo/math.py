"""The PPO math: pure functions on arrays.

Shapes use B for rows, T for response tokens and V for the vocabulary. `mask` arrays are
1 (or True) at real response tokens and 0 at padding; masked statistics count only the
real tokens. Every function here is pure and jit-friendly; none knows about models.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# One home per idea: the masked statistics, the KL estimators and controller, and the
# critic-free estimators and aggregation live in their own modules; `jaxppo.math` is the
# whole math layer under one name.
from jaxppo import correction, critic_free, kl, shaping, stats
from jaxppo.correction import *  # noqa: F401,F403 - the sampler-mismatch correction
from jaxppo.critic_free import *  # noqa: F401,F403 - the critic-free math, re-exported
from jaxppo.kl import *  # noqa: F401,F403 - KL estimators, shaped rewards, the controller
from jaxppo.shaping import *  # noqa: F401,F403 - overlong punishment, the high-entropy token mask
from jaxppo.stats import *  # noqa: F401,F403 - masked statistics
from jaxppo.critic_free import aggregate_loss, clipped_policy_loss
from jaxppo.stats import masked_mean

__all__ = list(dict.fromkeys([  # each name once: critic_free re-exports two of kl's
    "gae",
    "logprobs_from_logits",
    "entropy_from_logits",
    "policy_loss",
    "value_loss",
    "approx_kl",
    "RunningMoments",
    "running_moments_update",
    *stats.__all__,
    *kl.__all__,
    *critic_free.__all__,
    *correction.__all__,
    *shaping.__all__,
]))


def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens, by a reverse `lax.scan`.

    Args:
      rewards: (B, T) per-token rewards r_t.
      values: (B, T) value estimates V(s_t) of the state before token t.
      mask: (B, T) 1 at the tokens the policy produced. The chain runs over these only:
        masked positions inside a row (the environment's tokens in a multi-turn episode)
        are skipped, so V(s_{t'}) of the row's next real token t' bootstraps token t, and
        the episode ends after the row's last real token. With a prefix mask this is the
        usual GAE over the response.
      gamma, lam: discount and GAE lambda.

    Returns:
      (advantages, returns), each (B, T), zero at masked-out tokens; with t' the next real
      token after t (none after the last):
        delta_t = r_t + gamma * V_{t'} - V_t
        A_t = delta_t + gamma * lam * A_{t'}
        returns_t = A_t + V_t
    """
    dtype = jnp.result_type(rewards, values, jnp.float32)
    mask = mask.astype(dtype)
    rewards = rewards.astype(dtype) * mask
    values = values.astype(dtype) * mask

    def backward(carry, inputs):
        next_value, next_adv = carry  # of the next real token (0 after the last one)
        r_t, v_t, m_t = inputs
        adv_t = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        real = m_t > 0
        return (jnp.where(real, v_t, next_value), jnp.where(real, adv_t, next_adv)), adv_t

    # Scan over time (axis 0 after the transpose), last token first.
    zeros = jnp.zeros(rewards.shape[0], dtype)
    _, adv_t_major = jax.lax.scan(backward, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
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
