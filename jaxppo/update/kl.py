"""Everything about the KL divergence to the reference policy, in one place: the per-token
estimators (for the reward penalty and for a loss term), KL-shaped rewards, and the KL
controller (a fixed or adaptive coefficient) whose state is part of the run state.

Pure functions on arrays; imports only the masked statistics.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["KL_ESTIMATORS", "KL_LOSS_ESTIMATORS", "kl_per_token", "kl_loss_per_token", "check_kl_estimator",
           "kl_shaped_rewards", "at_last_token", "KLControllerState", "fixed_kl_controller", "kl_controller",
           "adaptive_kl_update"]

KL_ESTIMATORS = ("k1", "k3", "abs", "mse")
# The loss term's names (TRL's/verl's): k2 is the squared log-ratio, the reward's "mse".
KL_LOSS_ESTIMATORS = ("k1", "k2", "k3")
_LOSS_TO_REWARD_NAME = {"k1": "k1", "k2": "mse", "k3": "k3"}


def check_kl_estimator(what: str, estimator, valid=KL_ESTIMATORS):
    """ValueError naming what was set (`what`, e.g. "kl_estimator=" or "kl estimator "), the
    value and the valid estimators."""
    if estimator not in valid:
        raise ValueError(f"{what}{estimator!r} is invalid; valid: {', '.join(valid)}")


def kl_per_token(logprobs, ref_logprobs, estimator: str = "k1"):
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    With logr = ref_logprobs - logprobs:
      k1: -logr (unbiased, can be negative per token)
      k3: (exp(logr) - 1) - logr (unbiased, always >= 0)
      abs: |logr|
      mse: 0.5 * logr^2
    """
    check_kl_estimator("kl estimator ", estimator)
    logr = ref_logprobs - logprobs
    if estimator == "k1":
        return -logr
    if estimator == "k3":
        return jnp.expm1(logr) - logr
    if estimator == "abs":
        return jnp.abs(logr)
    return 0.5 * jnp.square(logr)


def kl_loss_per_token(logprobs, ref_logprobs, estimator: str = "k3"):
    """KL(policy || reference) per token as a loss term (differentiated through `logprobs`):
      k1: logprobs - ref_logprobs
      k2: 0.5 * (logprobs - ref_logprobs)^2
      k3: exp(ref - logprobs) - (ref - logprobs) - 1 (GRPO's; >= 0)
    The same estimators as `kl_per_token` (k2 is its "mse"), under the loss term's names."""
    check_kl_estimator("KL loss estimator ", estimator, KL_LOSS_ESTIMATORS)
    return kl_per_token(logprobs, ref_logprobs, _LOSS_TO_REWARD_NAME[estimator])


def at_last_token(values, mask):
    """(B,) values placed at each row's last real token of a (B, T) mask, 0 elsewhere (and
    everywhere in a row without real tokens). The mask need not be a prefix: in a
    multi-turn episode the last real token is the model's last one."""
    mask = mask.astype(jnp.float32)
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1] > 0, axis=1)
    return jax.nn.one_hot(last, mask.shape[1], dtype=jnp.float32) * mask * values[:, None]


def kl_shaped_rewards(kl, scores, mask, beta):
    """Per-token rewards: -beta * kl at each real token, plus the sequence score at the last
    real token. kl (B, T), scores (B,), mask (B, T) -> (B, T), 0 at padding.

    Returns (rewards, non_score_rewards)."""
    mask = mask.astype(jnp.float32)
    non_score = -beta * kl * mask
    return non_score + at_last_token(scores, mask), non_score


class KLControllerState(NamedTuple):
    """beta: the current KL coefficient (float32 scalar). target, horizon: the adaptive
    controller's settings (target <= 0 means a fixed coefficient)."""

    beta: jax.Array
    target: jax.Array
    horizon: jax.Array


def kl_controller(beta: float, target: float = 0.0, horizon: float = 1.0) -> KLControllerState:
    """A controller starting at `beta`: adaptive toward `target` over `horizon` samples
    (Ziegler et al. 2019) when target > 0, else fixed."""
    return KLControllerState(jnp.float32(beta), jnp.float32(target), jnp.float32(horizon))


def fixed_kl_controller(beta: float) -> KLControllerState:
    """A controller that keeps `beta` fixed."""
    return kl_controller(beta)


@jax.jit
def adaptive_kl_update(state: KLControllerState, current_kl, n_steps) -> KLControllerState:
    """Ziegler et al. (2019) adaptive KL: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) *
    n_steps / horizon. A state with target <= 0 is fixed and returned unchanged. One
    compiled program (op by op, each of its few ops would compile and dispatch on its own)."""
    error = jnp.clip(current_kl / jnp.where(state.target > 0, state.target, 1.0) - 1.0, -0.2, 0.2)
    mult = 1.0 + error * n_steps / state.horizon
    beta = jnp.where(state.target > 0, state.beta * mult, state.beta)
    return state._replace(beta=beta.astype(jnp.float32))
