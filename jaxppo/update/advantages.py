"""Advantage estimators' math: GAE over a critic's values, GRPO's group-relative advantages
(group, batch or no scaling: GRPO, Dr. GRPO), RLOO's leave-one-out baseline, REINFORCE++'s
whitened discounted returns (with or without a group baseline). Pure functions on arrays
(they import only the masked statistics); the estimators of `jaxppo.algorithms` put them
on rollouts.

Shapes: B completions (rows), T response tokens, G completions per prompt
(`num_generations`). Rows are grouped consecutively: prompt i's completions are rows
i*G ... i*G + G - 1. `mask` is 1 at the tokens the policy produced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxppo.update.stats import masked_whiten

__all__ = [
    "gae",
    "gae_time_major",
    "GRPO_SCALES",
    "grpo_advantages",
    "zero_std_groups",
    "rloo_advantages",
    "group_baseline",
    "discounted_returns",
    "reinforce_pp_advantages",
]

GRPO_SCALES = ("group", "batch", "none")


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


def gae_time_major(rewards, values, dones, last_value, gamma: float, lam: float, *, truncations=None,
                   final_values=None):
    """GAE for vectorised environments that reset themselves: time-major rollouts of N
    environments (any trailing batch shape), by a reverse `lax.scan`.

    Args:
      rewards, values: (T, N...) r_t and V(s_t).
      dones: (T, N...) the episode ended at step t (terminated or truncated): s_{t+1} is
        the first state of a new episode, so nothing is bootstrapped or carried across it.
      last_value: (N...) V(s_T), the value of the state after the rollout's last step
        (bootstraps the last step unless it is done).
      gamma, lam: discount and GAE lambda.
      truncations: optional (T, N...) the episode was cut at step t by a time limit rather
        than terminated (a subset of `dones`). Without `final_values` such a step gets no
        learning signal (delta 0: Brax's convention); with them it is bootstrapped.
      final_values: optional (T, N...) V of the real final state of a truncated episode
        (the observation before the reset), read where `truncations` is set.

    Returns:
      (advantages, returns), each (T, N...):
        delta_t = r_t + gamma * (1 - done_t) * V_{t+1} - V_t   (V_T = last_value)
        delta_t = r_t + gamma * final_value_t - V_t             (truncated, with final_values)
        delta_t = 0                                             (truncated, without)
        A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1},  returns_t = A_t + V_t
    With no truncations this is PureJaxRL's `_calculate_gae`.
    """
    dtype = jnp.result_type(rewards, values, jnp.float32)
    rewards, values = rewards.astype(dtype), values.astype(dtype)
    cont = 1.0 - dones.astype(dtype)
    if truncations is None:
        truncations = jnp.zeros_like(cont)
    truncated = truncations.astype(dtype)
    if final_values is not None and final_values.shape != values.shape:
        raise ValueError(f"gae_time_major: final_values has shape {final_values.shape}; expected the values' "
                         f"{values.shape}")
    next_values = jnp.concatenate([values[1:], last_value.astype(dtype)[None]], axis=0)

    def backward(next_adv, inputs):
        r_t, v_t, next_v, c_t, trunc_t, final_t = inputs
        delta = r_t + gamma * c_t * next_v - v_t
        if final_values is None:
            delta = delta * (1.0 - trunc_t)
        else:
            delta = jnp.where(trunc_t > 0, r_t + gamma * final_t - v_t, delta)
        adv = delta + gamma * lam * c_t * next_adv
        return adv, adv

    finals = jnp.zeros_like(values) if final_values is None else final_values.astype(dtype)
    _, advantages = jax.lax.scan(backward, jnp.zeros_like(values[0]),
                                 (rewards, values, next_values, cont, truncated, finals), reverse=True)
    return advantages, advantages + values


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
    token of the batch (mean shifted). rewards (B, T) as `jaxppo.update.kl.kl_shaped_rewards`
    builds them (for the group-baseline variant, pass scores through `group_baseline`
    first). Returns (B, T), 0 at padding."""
    return masked_whiten(discounted_returns(rewards, mask, gamma), mask, shift_mean=True)
