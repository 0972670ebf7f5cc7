"""RLOO's estimator (Ahmadian et al. 2024): each completion's score minus the mean score of
the other G - 1 completions of its prompt."""

from __future__ import annotations

import jax.numpy as jnp

from jaxppo.algorithms.base import AdvantageEstimator, Advantages, sequence_scores
from jaxppo.algorithms.grpo import zero_std_stats
from jaxppo.update.advantages import rloo_advantages


def compute(rollout, config) -> Advantages:
    """`jaxppo.update.advantages.rloo_advantages(scores, G)`, broadcast over each completion's tokens."""
    scores = sequence_scores(rollout)
    mask = rollout.response_mask.astype(jnp.float32)
    advantages = rloo_advantages(scores, config.num_generations)
    return Advantages(advantages[:, None] * mask, None, zero_std_stats(scores, config.num_generations))


ESTIMATOR = AdvantageEstimator(
    name="rloo", compute=compute, min_generations=2, summary="leave-one-out baseline over the group",
    config_fields=("num_generations",), metrics=("frac_reward_zero_std",))
