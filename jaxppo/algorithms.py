"""The algorithms: each is an advantage estimator plus a loss on the same compiled engine,
set by a handful of `PPOConfig` fields. `ALGORITHMS[name]` holds the fields that define a
method (everything else, such as the batch sizes, stays the user's); every one can still
be overridden. The sources of each default are listed beside it.

    PPOConfig.for_algorithm("grpo", batch_size=64, mini_batch_size=16)
    jaxppo --algorithm dapo --cliprange-high 0.3 ...
"""

from __future__ import annotations

__all__ = ["ALGORITHMS", "algorithm_defaults", "SOURCES"]

# Fields every critic-free method sets: no reward KL (KL, if any, is a loss term), no
# whitening of GAE quantities (they have no GAE).
_CRITIC_FREE = dict(kl_coef=0.0, whiten_advantages=False, whiten_rewards=False, vf_coef=0.0)

ALGORITHMS = {
    # PPO with a critic: PPOConfig's defaults (TRL PPOTrainer's, "The N Implementation
    # Details of RLHF with PPO").
    "ppo": dict(advantage_estimator="gae", num_generations=1),
    # GRPO (Shao et al. 2024, DeepSeekMath): group-normalised scores, mean over
    # completions of token means, KL to the reference in the loss (k3, beta 0.04), G = 8
    # (TRL GRPOConfig's num_generations).
    "grpo": dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                 loss_aggregation="seq_mean_token_mean", kl_loss_coef=0.04, kl_loss_estimator="k3"),
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): no std division,
    # token sums divided by a constant (the response length), no KL term.
    "dr_grpo": dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="none",
                    loss_aggregation="seq_mean_token_sum_norm", kl_loss_coef=0.0),
    # DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level mean over the batch, no
    # KL. Its dynamic sampling and overlong reward shaping are not part of this preset.
    "dapo": dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                 loss_aggregation="token_mean", cliprange_low=0.2, cliprange_high=0.28, kl_loss_coef=0.0),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline; KL in the reward as TRL's
    # RLOOTrainer (beta 0.05); G = 4 (the paper's k = 4).
    "rloo": dict(_CRITIC_FREE, advantage_estimator="rloo", num_generations=4, loss_aggregation="token_mean",
                 kl_coef=0.05),
    # REINFORCE++ (Hu 2025, OpenRLHF): per-token returns of KL-shaped rewards (OpenRLHF's
    # init_kl_coef 0.01, k1), whitened over the batch; one completion per prompt.
    "reinforce_pp": dict(_CRITIC_FREE, advantage_estimator="reinforce_pp", num_generations=1,
                         loss_aggregation="token_mean", kl_coef=0.01, gamma=1.0),
    # GSPO (Zheng et al. 2025): sequence-level importance ratio with its tiny clip range
    # (3e-4 / 4e-4), group-normalised advantages, mean over completions, no KL.
    "gspo": dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                 importance_ratio="sequence", cliprange_low=3e-4, cliprange_high=4e-4,
                 loss_aggregation="seq_mean_token_mean", kl_loss_coef=0.0),
}

SOURCES = {
    "ppo": "TRL PPOTrainer; Huang et al. 2024, The N Implementation Details of RLHF with PPO",
    "grpo": "Shao et al. 2024 (DeepSeekMath); TRL GRPOTrainer loss_type='grpo'",
    "dr_grpo": "Liu et al. 2025 (Understanding R1-Zero-Like Training); TRL loss_type='dr_grpo'",
    "dapo": "Yu et al. 2025 (DAPO); TRL loss_type='dapo'",
    "rloo": "Ahmadian et al. 2024 (Back to Basics); TRL RLOOTrainer",
    "reinforce_pp": "Hu 2025 (REINFORCE++); OpenRLHF advantage_estimator='reinforce'",
    "gspo": "Zheng et al. 2025 (Group Sequence Policy Optimization); TRL importance_sampling_level='sequence'",
}


def algorithm_defaults(name: str) -> dict:
    """The `PPOConfig` fields that algorithm `name` sets (a copy)."""
    if name not in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is unknown; valid: {', '.join(ALGORITHMS)}")
    return dict(ALGORITHMS[name])
