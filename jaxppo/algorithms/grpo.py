"""GRPO's estimator (Shao et al. 2024): each completion's score against its group's, over
the G completions of its prompt; with `grpo_scale="none"` Dr. GRPO's (Liu et al. 2025)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxppo.algorithms.base import AdvantageEstimator, Advantages, sequence_scores
from jaxppo.update.advantages import grpo_advantages, zero_std_groups


def zero_std_stats(scores, num_generations: int, zero_std=None) -> dict:
    """`frac_reward_zero_std`: the fraction of groups whose scores are all equal (`zero_std`,
    (B / G,) bool, when already computed)."""
    if zero_std is None:
        zero_std = zero_std_groups(scores, num_generations)
    return {"frac_reward_zero_std": jnp.mean(zero_std.astype(jnp.float32))}


def compute(rollout, config) -> Advantages:
    """`jaxppo.update.advantages.grpo_advantages(scores, G, config.grpo_scale, config.grpo_eps)`,
    broadcast over each completion's real tokens."""
    scores = sequence_scores(rollout)
    mask = rollout.response_mask.astype(jnp.float32)
    advantages, zero_std = grpo_advantages(scores, config.num_generations, config.grpo_scale, config.grpo_eps)
    return Advantages(advantages[:, None] * mask, None, zero_std_stats(scores, config.num_generations, zero_std))


ESTIMATOR = AdvantageEstimator(
    name="grpo", compute=compute, min_generations=2, summary="score minus its group's mean, over the group's std",
    config_fields=("num_generations", "grpo_scale", "grpo_eps"), metrics=("frac_reward_zero_std",))
