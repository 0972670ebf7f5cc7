"""Shaping what the update learns from, beyond the advantage estimators: DAPO's soft
overlong punishment of scores (applied by the rollout layer), the selection of the
highest-entropy response tokens for the policy term (applied by the loss), and the
adaptive entropy coefficient (a controller between iterations).

Depends on the masked statistics only (`jaxppo.update.stats`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxppo.update.stats import masked_quantile

__all__ = ["overlong_penalty", "default_overlong_buffer", "high_entropy_mask", "adaptive_entropy_coef"]


def default_overlong_buffer(budget: int) -> int:
    """The buffer used when `RewardConfig.overlong_buffer` is None: a fifth of the response
    budget, at least 1 token (DAPO: 4096 of 20480)."""
    return max(1, budget // 5)


def overlong_penalty(lengths, budget: int, buffer: int, factor: float):
    """DAPO's soft overlong punishment, (B,) float32, to add to the scores.

    With L the completion's length in tokens (its stop token included) and Lmax `budget`:
    0 for L <= Lmax - buffer, then falling linearly, (Lmax - buffer - L) / buffer * factor,
    to -factor at L = Lmax (a completion cut at the budget), and -factor past it (which a
    rollout cannot hold), as the paper's equation 13."""
    if not 0 < buffer <= budget:
        raise ValueError(f"overlong buffer {buffer} must be in [1, {budget}] (the response budget)")
    excess = jnp.asarray(lengths, jnp.float32) - (budget - buffer)
    return jnp.clip(-excess / buffer * factor, -factor, 0.0)


def high_entropy_mask(entropy, mask, top_fraction: float):
    """1.0 at the real tokens whose entropy is >= the (1 - top_fraction)-quantile of the
    entropies of all real tokens of the batch (linear interpolation, as numpy's and torch's
    quantile), 0.0 elsewhere: the highest-entropy `top_fraction` of them, ties kept.
    No gradient flows through it."""
    entropy = jax.lax.stop_gradient(entropy).astype(jnp.float32)
    threshold = masked_quantile(entropy, mask, 1.0 - top_fraction)
    return ((entropy >= threshold) & mask.astype(bool)).astype(jnp.float32)


def adaptive_entropy_coef(coef, entropy, target: float, step: float):
    """One step of the adaptive entropy coefficient (Skywork-OR1's adaptive entropy
    control): `coef + step` when the measured per-token entropy is below `target`, else
    `coef - step`, never below 0. A non-finite entropy (no update was applied) leaves the
    coefficient as it is. float32 scalar."""
    coef = jnp.asarray(coef, jnp.float32)
    entropy = jnp.asarray(entropy, jnp.float32)
    moved = jnp.maximum(jnp.where(entropy < target, coef + step, coef - step), 0.0)
    return jnp.where(jnp.isfinite(entropy), moved, coef).astype(jnp.float32)
