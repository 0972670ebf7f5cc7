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
    # The four below: TRL 1.12 GRPOConfig's defaults (G = 8, group scaling, beta 0) with its
    # loss_type of that name, and the loss's own parameters at TRL's documented values. TRL
    # aggregates "cispo" and "vespo" over the generation batch's tokens ("token_sum_batch_norm"),
    # equal to the token mean here, with one mini-batch per generation batch, as for "dapo".
    Algorithm(
        # TRL's recommended epsilon_high=5.0 for cispo is the cap on the weight: 1 + cliprange_high.
        "cispo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                      surrogate="cispo", cliprange_high=4.0, loss_aggregation="token_mean", kl_loss_coef=0.0),
        source="MiniMax-M1 (arXiv 2506.13585); ScaleRL (arXiv 2510.13786); TRL loss_type='cispo', epsilon_high=5.0",
        summary="importance weights capped at 5 and detached, times A log pi: no token loses its gradient"),
    Algorithm(
        "sapo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                     surrogate="sapo", sapo_temperatures=(1.0, 1.05), loss_aggregation="seq_mean_token_mean",
                     kl_loss_coef=0.0),
        source="Soft Adaptive Policy Optimization (Qwen team, arXiv 2511.20347); TRL loss_type='sapo'",
        summary="a sigmoid gate of the ratio (temperatures 1.0 / 1.05) instead of the hard clip"),
    Algorithm(
        # LUSPO changes GSPO's loss only: each completion's loss scaled by its length.
        "luspo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                      importance_ratio="sequence", cliprange_low=3e-4, cliprange_high=4e-4,
                      loss_aggregation="seq_mean_token_sum", kl_loss_coef=0.0),
        source="Liu et al. 2026 (Length-Unbiased Sequence Policy Optimization, arXiv 2602.05261); "
               "TRL loss_type='luspo' with importance_sampling_level='sequence'",
        summary="GSPO with each completion's loss summed over its tokens (length-unbiased)"),
    Algorithm(
        "vespo", dict(_CRITIC_FREE, advantage_estimator="grpo", num_generations=8, grpo_scale="group",
                      surrogate="vespo", vespo_shape=(2.0, 3.0, 3.0, 2.0), loss_aggregation="token_mean",
                      kl_loss_coef=0.0),
        source="VESPO: Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693); TRL loss_type='vespo'",
        summary="a gamma weight of each completion's importance ratio (k, lambda = 2, 3 / 3, 2) instead of clipping"),
    Algorithm(
        # The teacher is the run's frozen model (Trainer(teacher=...)); no reward is needed
        # unless task_reward_weight > 0 (then G >= 2 completions per prompt are compared).
        "distill", dict(_CRITIC_FREE, advantage_estimator="distill", num_generations=1, task_reward_weight=0.0,
                        loss_aggregation="token_mean", kl_loss_coef=0.0),
        source="Agarwal et al. 2024 (On-Policy Distillation of Language Models, GKD); Thinking Machines 2025, "
               "On-Policy Distillation (per-token reverse KL as the advantage); NeMo-RL, verl OPD",
        summary="on-policy distillation: each sampled token's advantage is log pi_teacher - log pi_student"),
)
