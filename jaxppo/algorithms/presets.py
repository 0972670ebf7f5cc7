"""The published methods as presets: the settings that define each, with the
sources of its defaults."""

from __future__ import annotations

from jaxppo.algorithms.base import Algorithm

# Fields every critic-free method sets: no reward KL (KL, if any, is a loss term), no
# whitening of GAE quantities (they have no GAE), no value loss.
_CRITIC_FREE = dict(kl_coef=0.0, whiten_advantages=False, whiten_rewards=False, vf_coef=0.0)

PRESETS = (
    Algorithm(
        "ppo", dict(advantage_estimator="gae", num_generations=1),
        source="TRL PPOTrainer; Huang et al. 2024, The N Implementation Details of RLHF with PPO",
        summary="PPO with a critic: GAE, clipped policy and value losses, KL-shaped rewards"),
    Algorithm(
        # G = 8 is TRL GRPOConfig's num_generations; KL to the reference in the loss (k3, beta 0.04).
        "grpo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                     loss_aggregation="seq_mean_token_mean", kl_loss_coef=0.04, kl_loss_estimator="k3"),
        source="Shao et al. 2024 (DeepSeekMath); TRL GRPOTrainer loss_type='grpo'",
        summary="group-normalised scores, mean over completions of token means, k3 KL in the loss"),
    Algorithm(
        "dr_grpo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="none",
                        loss_aggregation="seq_mean_token_sum_norm", kl_loss_coef=0.0),
        source="Liu et al. 2025 (Understanding R1-Zero-Like Training); TRL loss_type='dr_grpo'",
        summary="no std division; token sums over a constant (the response length); no KL"),
    Algorithm(
        # The paper's Table 1 adds, in turn, overlong filtering (masking truncated completions),
        # clip-higher, the soft overlong punishment (factor 1.0, buffer 4096 of 20480: a fifth
        # of the budget here) and the token-level loss. Its dynamic sampling is a setting of the
        # loop, not of the update: RewardConfig.dynamic_sampling (--dynamic-sampling).
        "dapo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                     loss_aggregation="token_mean", cliprange_low=0.2, cliprange_high=0.28, kl_loss_coef=0.0,
                     mask_truncated_completions=True, overlong_penalty_factor=1.0),
        source="Yu et al. 2025 (DAPO); TRL loss_type='dapo' with one update per generation batch",
        summary="clip-higher (0.2 / 0.28), token mean over the mini-batch, no KL, truncated completions masked, "
                "soft overlong punishment"),
    Algorithm(
        # KL in the reward as TRL's RLOOTrainer (beta 0.05); G = 4 (the paper's k = 4). The loss
        # clips per token with a token mean (verl's form); TRL's RLOOTrainer clips one
        # sequence-level ratio per completion (importance_ratio="sequence_sum" here).
        "rloo", dict(_CRITIC_FREE, advantage_estimator="rloo", num_generations=4, loss_aggregation="token_mean",
                     kl_coef=0.05),
        source="Ahmadian et al. 2024 (Back to Basics); verl's per-token RLOO loss, TRL RLOOTrainer's KL and k",
        summary="leave-one-out baseline, KL in the reward, per-token clip with a token mean"),
    Algorithm(
        # OpenRLHF's init_kl_coef 0.01 (k1); one completion per prompt.
        "reinforce_pp", dict(_CRITIC_FREE, advantage_estimator="reinforce_pp", num_generations=1,
                             loss_aggregation="token_mean", kl_coef=0.01, gamma=1.0),
        source="Hu 2025 (REINFORCE++); OpenRLHF advantage_estimator='reinforce'",
        summary="per-token returns of KL-shaped rewards, whitened over the batch"),
    Algorithm(
        "gspo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                     importance_ratio="sequence", cliprange_low=3e-4, cliprange_high=4e-4,
                     loss_aggregation="seq_mean_token_mean", kl_loss_coef=0.0),
        source="Zheng et al. 2025 (Group Sequence Policy Optimization); TRL importance_sampling_level='sequence'",
        summary="sequence-level importance ratio with a tiny clip range (3e-4 / 4e-4), no KL"),
)
