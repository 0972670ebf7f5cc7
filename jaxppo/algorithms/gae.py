"""PPO's estimator: generalised advantage estimation with a critic (Schulman et al. 2016),
as TRL's PPOTrainer computes it."""

from __future__ import annotations

import jax.numpy as jnp

from jaxppo.algorithms.base import AdvantageEstimator, Advantages
from jaxppo.update.advantages import gae
from jaxppo.update.stats import masked_whiten


def compute(rollout, config) -> Advantages:
    """Rewards whitened (scale only) first if `config.whiten_rewards`; GAE with
    `config.gamma` and `config.lam` over the critic's `values`; advantages whitened over all
    real response tokens if `config.whiten_advantages`. Returns are GAE advantages + values,
    before whitening (the critic's regression target)."""
    mask = rollout.response_mask.astype(jnp.float32)
    rewards = rollout.rewards.astype(jnp.float32)
    if config.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae(rewards, rollout.values.astype(jnp.float32), mask, config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, mask, shift_mean=True)
    return Advantages(advantages, returns, {})


ESTIMATOR = AdvantageEstimator(
    name="gae", compute=compute, uses_critic=True, per_token=True,
    summary="GAE over the critic's values (PPO)",
    config_fields=("gamma", "lam", "whiten_rewards", "whiten_advantages", "vf_coef", "cliprange_value"))
