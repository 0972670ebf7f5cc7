"""REINFORCE++ (Hu 2025, OpenRLHF): per-token returns of the KL-shaped rewards, whitened
over the batch; and its variant with a group baseline (the group's mean score subtracted at
each completion's last token first)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxppo.algorithms.base import AdvantageEstimator, Advantages, sequence_scores
from jaxppo.algorithms.grpo import zero_std_stats
from jaxppo.update.advantages import group_baseline, reinforce_pp_advantages
from jaxppo.update.kl import at_last_token


def compute(rollout, config) -> Advantages:
    """`jaxppo.update.advantages.reinforce_pp_advantages(rewards, mask, config.gamma)`."""
    mask = rollout.response_mask.astype(jnp.float32)
    advantages = reinforce_pp_advantages(rollout.rewards.astype(jnp.float32), mask, config.gamma)
    return Advantages(advantages, None, {})


def compute_with_baseline(rollout, config) -> Advantages:
    """As `compute`, after subtracting the group's mean score at each completion's last
    real token."""
    mask = rollout.response_mask.astype(jnp.float32)
    scores = sequence_scores(rollout)
    group_mean = scores - group_baseline(scores, config.num_generations)
    rewards = rollout.rewards.astype(jnp.float32) - at_last_token(group_mean, mask)
    advantages = reinforce_pp_advantages(rewards, mask, config.gamma)
    return Advantages(advantages, None, zero_std_stats(scores, config.num_generations))


ESTIMATOR = AdvantageEstimator(
    name="reinforce_pp", compute=compute, per_token=True, summary="whitened per-token returns (REINFORCE++)",
    config_fields=("gamma",))
BASELINE = AdvantageEstimator(
    name="reinforce_pp_baseline", compute=compute_with_baseline, per_token=True, min_generations=2,
    summary="REINFORCE++ after subtracting the group's mean score",
    config_fields=("gamma", "num_generations"), metrics=("frac_reward_zero_std",))
