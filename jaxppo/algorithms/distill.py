"""On-policy distillation (Agarwal et al. 2024, GKD's on-policy reverse KL; Thinking Machines
2025, "On-Policy Distillation"; NeMo-RL, verl, Tinker): the student samples, a teacher
scores every sampled token, and each token's advantage is the negative per-token reverse KL
to the teacher, the sampled-token estimate log pi_teacher(y_t) - log pi_student(y_t), with
no discount (each token is judged on its own). With `AdvantageConfig.task_reward_weight`
w > 0 the task's rewards join in: each completion's group-normalised score (GRPO's
advantage) times w is added at every token.

With `AdvantageConfig.distill_top_k` k > 0 the teacher's signal moves from the advantage
into the loss: the forward pass also keeps the teacher's k most likely tokens at each
position, and the loss adds the divergence between student and teacher over those tokens
and one bucket for the rest (`jaxppo.update.losses.top_k_divergence`; reverse or forward by
`distill_divergence`; the vocabulary size gives the full divergence, GKD's). The advantage
is then the task's part alone (0 without task rewards); `distill/reverse_kl` is still
reported, from the sampled tokens.

The teacher is the run's frozen model in the reference's place (`Trainer(teacher=...)`,
`--teacher`): its log-probs of the sampled tokens come from the forward pass, as the
reference's do, and reach the estimator as `rollout.ref_logprobs`."""

from __future__ import annotations

import jax.numpy as jnp

from jaxppo.algorithms.base import AdvantageEstimator, Advantages, sequence_scores
from jaxppo.algorithms.grpo import zero_std_stats
from jaxppo.update.advantages import grpo_advantages
from jaxppo.update.stats import masked_mean


def reverse_kl_advantages(logprobs, teacher_logprobs, mask):
    """(B, R): teacher_logprobs - logprobs at real tokens (the negative sampled-token
    estimate of KL(student || teacher) there), 0 at padding."""
    mask = mask.astype(jnp.float32)
    return (teacher_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)) * mask


def compute(rollout, config) -> Advantages:
    """`reverse_kl_advantages(rollout.logprobs, rollout.ref_logprobs, mask)` (0 with
    `distill_top_k`: the loss then carries the teacher's signal), plus `task_reward_weight`
    times GRPO's advantage of each completion's score at its tokens."""
    if rollout.ref_logprobs is None:
        raise ValueError("the 'distill' estimator needs the teacher's log-probs of the sampled tokens "
                         "(rollout.ref_logprobs, batch x response_len); give the run a teacher (Trainer(teacher=...), "
                         "--teacher), or fill ref_logprobs in a rollout you build")
    mask = rollout.response_mask.astype(jnp.float32)
    advantages = reverse_kl_advantages(rollout.logprobs, rollout.ref_logprobs, mask)
    stats = {"distill/reverse_kl": -masked_mean(advantages, mask)}
    if config.distill_top_k:
        advantages = jnp.zeros_like(advantages)
    if config.task_reward_weight:
        scores = sequence_scores(rollout)
        task, zero_std = grpo_advantages(scores, config.num_generations, config.grpo_scale, config.grpo_eps)
        advantages = advantages + config.task_reward_weight * task[:, None] * mask
        stats.update(zero_std_stats(scores, config.num_generations, zero_std))
    return Advantages(advantages, None, stats)


ESTIMATOR = AdvantageEstimator(
    name="distill", compute=compute, per_token=True, uses_reference=True,
    summary="per-token reverse KL to a teacher (on-policy distillation), plus weighted task advantages",
    config_fields=("task_reward_weight", "distill_top_k", "distill_divergence", "num_generations", "grpo_scale",
                   "grpo_eps"),
    metrics=("distill/reverse_kl",))
