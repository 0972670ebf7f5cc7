"""The algorithm's settings, by concern: how advantages are estimated (`AdvantageConfig`),
the loss (`LossConfig`), the KL to the reference in the reward or the loss and its control
(`KLConfig`), and how scores become rewards (`RewardConfig`). The sizes of the batch are
`jaxppo.BatchConfig` (the mini-batch loop's). `jaxppo.Config` composes them and checks what
spans two of them; `Config.for_algorithm(name)` sets those that define a published method."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from jaxppo.config.fields import Concern, check_bools, check_choice, check_counts, check_optional_real, check_real
from jaxppo.update.advantages import GRPO_SCALES
from jaxppo.update.checks import invalid, is_int, is_real
from jaxppo.update.correction import ROLLOUT_CORRECTIONS
from jaxppo.update.kl import KL_ESTIMATORS, KL_LOSS_ESTIMATORS
from jaxppo.update.losses import DISTILL_DIVERGENCES, IMPORTANCE_RATIOS, LOSS_AGGREGATIONS, SURROGATES

__all__ = ["AdvantageConfig", "LossConfig", "KLConfig", "RewardConfig"]


@dataclasses.dataclass(frozen=True)
class AdvantageConfig(Concern):
    """How advantages come from a rollout, and the critic that PPO's need (the defaults are
    PPO's; `jaxppo.Config.for_algorithm(name)` sets another method's).

    Attributes:
      advantage_estimator: "gae" (PPO, with a critic), "grpo", "rloo", "reinforce_pp" or
        "reinforce_pp_baseline" (critic-free: no critic is built, run or checkpointed), or a
        name registered with `jaxppo.algorithms.register_estimator` (checked by
        `jaxppo.Config` against the registry). Only "gae" uses gamma, lam,
        whiten_advantages, whiten_rewards and the critic's settings.
      gamma: discount per token, in [0, 1].
      lam: GAE's lambda, in [0, 1].
      whiten_advantages: whiten advantages over the whole rollout (masked) before updates.
      whiten_rewards: whiten per-token rewards (no mean shift) before GAE.
      grpo_scale: "group" (GRPO: divide by the group's std), "batch" (by the batch's std),
        "none" (Dr. GRPO: no division).
      grpo_eps: added to the std that grpo_scale divides by; > 0.
      shared_trunk: PPO's critic is a value head on the policy's trunk (one model) instead
        of a model of its own.
      task_reward_weight: read by "distill" (on-policy distillation) only: the weight of
        the task's rewards (each completion's group-normalised score, GRPO's advantage,
        added at every token) beside the per-token reverse KL to the teacher; >= 0, 0: the
        teacher alone (no reward needed). > 0 needs `BatchConfig.num_generations` >= 2.
      distill_top_k: read by "distill" only: 0 (the default) takes the teacher's signal
        from the sampled tokens alone (the advantage above); k > 0 keeps the teacher's k most
        likely tokens at each response position (one forward pass, `teacher_top_logprobs`)
        and trains the student on the divergence between the two distributions over those
        k tokens and one bucket for the rest, a term of the loss (NeMo-RL's and verl's top-k
        distillation; the vocabulary size gives the full divergence, GKD's); the advantage
        is then the task's part alone. The rollout holds (batch, response_length, k) values
        and ids; k <= the vocabulary (checked when the models are known).
      distill_divergence: with distill_top_k > 0: "reverse" (KL(student || teacher), mode
        seeking, the default) or "forward" (KL(teacher || student), GKD's beta = 0);
        "forward" without a top k is refused (it would be unused).
    """

    advantage_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    grpo_scale: str = "group"
    grpo_eps: float = 1e-4
    shared_trunk: bool = False
    task_reward_weight: float = 0.0
    distill_top_k: int = 0
    distill_divergence: str = "reverse"

    def __post_init__(self):
        if not isinstance(self.advantage_estimator, str) or not self.advantage_estimator:
            raise invalid("AdvantageConfig", "advantage_estimator", self.advantage_estimator,
                          "the name of a registered estimator (jaxppo.algorithms.ESTIMATORS)")
        for name in ("gamma", "lam"):
            check_real(self, name, 0.0, 1.0)
        check_bools(self, ("whiten_advantages", "whiten_rewards", "shared_trunk"))
        check_choice(self, "grpo_scale", GRPO_SCALES)
        check_real(self, "grpo_eps", 0.0, low_open=True)
        check_real(self, "task_reward_weight", 0.0)
        check_counts(self, ("distill_top_k",), least=0)
        check_choice(self, "distill_divergence", DISTILL_DIVERGENCES)


@dataclasses.dataclass(frozen=True)
class LossConfig(Concern):
    """The loss every algorithm trains with: its policy term (clipping, the importance
    ratio, how tokens are aggregated), the value term (a critic's), the entropy bonus, and
    the correction for a sampler whose distribution differs from the trainer's. The KL term
    is `KLConfig`'s.

    Attributes:
      surrogate: the policy term: "clip" (PPO's clipped surrogate, the clip range below),
        "cispo" (CISPO: the ratio capped at 1 + cliprange_high and detached, times A log pi:
        every token keeps a gradient; TRL's `loss_type="cispo"` with `epsilon_high` =
        1 + cliprange_high), "sapo" (SAPO: a soft gate of the ratio at `sapo_temperatures`
        instead of a clip) or "vespo" (VESPO: a gamma weight of the completion's whole
        importance ratio, shaped by `vespo_shape`, detached, times A log pi). Only "clip"
        reads cliprange_low and dual_clip, only "clip" and "cispo" the clip range.
      cliprange: PPO's ratio clip epsilon (the ratio is clipped to [1 - c, 1 + c]); >= 0. A
        clip range of 0 (no policy gradient past the first update) or of 1 or more (no lower
        clip) is warned about.
      cliprange_low, cliprange_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's
        clip-higher); None means `cliprange`. low in [0, 1].
      dual_clip: None, or c > 1: for negative advantages the loss is capped at -A * c.
      sapo_temperatures: SAPO's gate temperatures (for A > 0, for A <= 0), each > 0 (TRL's
        `sapo_temperature_pos`, `sapo_temperature_neg`).
      vespo_shape: VESPO's (k_pos, lambda_pos, k_neg, lambda_neg): the power k and decay
        lambda of its weight w^k e^(lambda (1 - w)) for completions with A >= 0 and A < 0,
        each >= 0 (TRL's `vespo_k_pos`, `vespo_lambda_pos`, `vespo_k_neg`,
        `vespo_lambda_neg`). VESPO needs `importance_ratio="token"` (it forms the
        completion's weight itself) and a per-token `rollout_correction` or "none".
      cliprange_value: the value clip range around the old values; >= 0.
      vf_coef: the value loss's weight; >= 0 (PPO only).
      ent_coef: the entropy bonus's weight (subtracted from the loss); >= 0.
      entropy_target: None (`ent_coef` stays fixed), or a per-token entropy in nats (> 0)
        that the bonus steers toward: `ent_coef` is then the starting coefficient, moved
        after every iteration by `entropy_coef_step`, up when the update's mean entropy
        (`policy/entropy_avg`) was below the target, down otherwise, never below 0
        (Skywork-OR1's adaptive entropy control; part of the run state).
      entropy_coef_step: how far `ent_coef` moves per iteration toward `entropy_target`;
        > 0.
      importance_ratio: "token" (per-token ratios), "sequence" (GSPO: exp of the mean
        per-token log-ratio of a completion, shared by its tokens) or "sequence_sum"
        (TRL's RLOOTrainer: exp of the summed log-ratio). The sequence-level ratios need
        one advantage per completion: refused with the per-token estimators.
      loss_aggregation: "token_mean" (every real token of the mini-batch counts equally:
        PPO, DAPO), "seq_mean_token_mean" (mean over completions of their token means:
        GRPO), "seq_mean_token_sum" (mean over completions of their token sums: LUSPO),
        "seq_mean_token_sum_norm" (token sums over `loss_norm_length`: Dr. GRPO) or
        "token_sum_batch_norm" (TRL's `loss_type="dapo"`). Applies to every term.
      loss_norm_length: the constant "seq_mean_token_sum_norm" divides by (TRL's
        `max_completion_length`); None: the response width. A positive int.
      top_entropy_quantile: train the policy term only on this fraction of the response
        tokens, those of highest entropy (Wang et al. 2025: 0.2; TRL's
        `top_entropy_quantile`); in (0, 1], 1.0 keeps all.
      rollout_correction: how the policy loss corrects for the sampler's distribution
        differing from the trainer's (rollouts that carry the sampler's log-probs):
        "token_truncate" (each token weighted by min(pi_old / pi_sampler, C)),
        "token_mask" (tokens whose ratio lies outside [1/C, C] get weight 0),
        "sequence_truncate" / "sequence_mask" (the same with the completion's ratio), or
        "none" (`jaxppo.update.correction`).
      rollout_correction_cap: the cap C of `rollout_correction`'s weights or ratios; > 1.
      routing_replay: a mixture-of-experts policy (`jaxppo.models.moe`) computes the
        update's forward with the experts its router chose in the rollout's forward pass
        (the forward that gave the old log-probs), weighted by its current router's
        probabilities of them, so that a change of routing does not move the importance
        ratio (verl's and slime's "routing replay"). The plain layout only (no shared
        prompts, common prefix or packing: the trainer then picks it).
      router_aux_loss_coef: a mixture-of-experts policy's load-balancing loss (the Switch
        Transformer's, as Hugging Face computes it for Mixtral and Qwen3-MoE, over the
        rows' real tokens) times this is added to the loss; 0 (the default): off. The
        plain layout only, as `routing_replay`.
    """

    surrogate: str = "clip"
    cliprange: float = 0.2
    cliprange_low: Optional[float] = None
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    sapo_temperatures: Tuple[float, float] = (1.0, 1.05)
    vespo_shape: Tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    entropy_target: Optional[float] = None
    entropy_coef_step: float = 0.005
    importance_ratio: str = "token"
    loss_aggregation: str = "token_mean"
    loss_norm_length: Optional[int] = None
    top_entropy_quantile: float = 1.0
    rollout_correction: str = "token_truncate"
    rollout_correction_cap: float = 2.0
    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0

    def __post_init__(self):
        for name in ("cliprange", "cliprange_value", "vf_coef", "ent_coef", "router_aux_loss_coef"):
            check_real(self, name, 0.0)
        check_optional_real(self, "cliprange_high", 0.0, none="None (use cliprange)")
        if self.cliprange_low is not None:
            check_real(self, "cliprange_low", 0.0, 1.0)
        check_optional_real(self, "dual_clip", 1.0, low_open=True, none="None (no dual clip)")
        check_optional_real(self, "entropy_target", 0.0, low_open=True, none="None (a fixed ent_coef)")
        check_real(self, "entropy_coef_step", 0.0, low_open=True)
        check_choice(self, "importance_ratio", IMPORTANCE_RATIOS)
        check_choice(self, "loss_aggregation", LOSS_AGGREGATIONS)
        if self.loss_norm_length is not None and (not is_int(self.loss_norm_length) or self.loss_norm_length <= 0):
            raise invalid("LossConfig", "loss_norm_length", self.loss_norm_length,
                          "None (the response width) or a positive int (TRL's max_completion_length)")
        check_real(self, "top_entropy_quantile", 0.0, 1.0, low_open=True,
                   note=": the fraction of response tokens, by highest entropy, the policy term trains on (1.0 keeps "
                        "all)")
        check_choice(self, "rollout_correction", ROLLOUT_CORRECTIONS)
        check_real(self, "rollout_correction_cap", 1.0, low_open=True)
        if not isinstance(self.routing_replay, bool):
            raise invalid("LossConfig", "routing_replay", self.routing_replay, "True or False")
        _check_surrogate(self)
        _warn_clip(self)


def _check_surrogate(c: LossConfig):
    """The surrogate, its shapes (a list given for a tuple becomes the tuple), and what VESPO
    needs of the ratio and the correction."""
    check_choice(c, "surrogate", SURROGATES)
    for name, length, low_open, what in (("sapo_temperatures", 2, True, "(tau_pos, tau_neg), each > 0"),
                                         ("vespo_shape", 4, False,
                                          "(k_pos, lambda_pos, k_neg, lambda_neg), each >= 0")):
        value = getattr(c, name)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(c, name, value)
        if (not isinstance(value, tuple) or len(value) != length
                or not all(is_real(v) and (v > 0 if low_open else v >= 0) for v in value)):
            raise invalid("LossConfig", name, value, f"{length} finite numbers {what}")
    if c.surrogate == "vespo" and c.importance_ratio != "token":
        raise invalid("LossConfig", "importance_ratio", c.importance_ratio,
                      "'token' with surrogate='vespo': VESPO forms each completion's importance weight from the "
                      "per-token ratios itself")
    if c.surrogate == "vespo" and c.rollout_correction.startswith("sequence"):
        raise invalid("LossConfig", "rollout_correction", c.rollout_correction,
                      "'token_truncate', 'token_mask' or 'none' with surrogate='vespo': VESPO adds each token's "
                      "correction to the completion's importance weight (a sequence-level weight would count once "
                      "per token)")


def _warn_clip(c: LossConfig):
    """Legal clip ranges that are almost surely mistakes."""
    import warnings

    if c.cliprange == 0 and c.cliprange_low is None and c.cliprange_high is None:
        warnings.warn("LossConfig.cliprange=0: the ratio is clipped to exactly 1, so every update after the first of "
                      "an iteration's mini-batches gets no policy gradient where the advantage pushes past it "
                      "(typical: 0.1 to 0.3)", UserWarning, stacklevel=4)
    which = "cliprange_low" if c.cliprange_low is not None else "cliprange"
    if getattr(c, which) >= 1:
        warnings.warn(f"LossConfig.{which}={getattr(c, which)}: the ratio's lower clip 1 - {getattr(c, which)} is "
                      "<= 0, which no ratio reaches: the lower clip is gone, and an update may push a token's "
                      "probability down without limit where the advantage is negative (typical: 0.1 to 0.3)",
                      UserWarning, stacklevel=4)


@dataclasses.dataclass(frozen=True)
class KLConfig(Concern):
    """The KL divergence to the reference policy: as a penalty in the per-token rewards (and
    its adaptive control), and as a term of the loss. With `kl_coef` and `kl_loss_coef` 0
    and no `adaptive_kl_target`, no reference model is built or run at all.

    Attributes:
      kl_coef: the initial beta of the KL penalty in the per-token rewards; >= 0.
      adaptive_kl_target: None (a fixed `kl_coef`), or the KL that the adaptive controller steers
        beta toward (TRL's AdaptiveKLController); > 0.
      kl_horizon: the adaptive controller's horizon, in episodes; a positive int.
      kl_estimator: the per-token estimate in the reward: "k1", "k3", "abs" or "mse".
      kl_loss_coef: beta of a KL(policy || reference) term in the loss (GRPO's); >= 0.
      kl_loss_estimator: that term's estimate: "k1", "k2" or "k3".
      kl_loss_bias_correction: multiply each token's KL term by its importance ratio
        pi / pi_old (TRL's `use_bias_correction_kl`; off here, as in verl and the GRPO paper).
    """

    kl_coef: float = 0.05
    adaptive_kl_target: Optional[float] = None
    kl_horizon: int = 10000
    kl_estimator: str = "k1"
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_loss_bias_correction: bool = False

    def __post_init__(self):
        check_real(self, "kl_coef", 0.0)
        check_optional_real(self, "adaptive_kl_target", 0.0, low_open=True, none="None (a fixed kl_coef)")
        check_counts(self, ("kl_horizon",))
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KLConfig.kl_estimator={self.kl_estimator!r} is invalid; valid: "
                             f"{', '.join(KL_ESTIMATORS)}")
        check_real(self, "kl_loss_coef", 0.0)
        check_choice(self, "kl_loss_estimator", KL_LOSS_ESTIMATORS)
        check_bools(self, ("kl_loss_bias_correction",))

    @property
    def needs_reference(self) -> bool:
        """A reference policy is needed: a KL penalty in the reward (kl_coef > 0, or an
        adaptive controller) or a KL term in the loss (kl_loss_coef > 0)."""
        return self.kl_coef > 0 or self.adaptive_kl_target is not None or self.kl_loss_coef > 0


@dataclasses.dataclass(frozen=True)
class RewardConfig(Concern):
    """How scores become rewards: the shaping of scores and of lengths, what a non-finite
    score does, and dynamic sampling (DAPO's filter of groups whose scores are all equal).

    Attributes:
      missing_eos_penalty: None, or a number subtracted from the score of completions that
        end without a stop token.
      normalize_scores: standardise scores by their running mean and std before use.
      score_clip: None, or clip (normalised) scores to [-score_clip, score_clip]; > 0.
      overlong_penalty_factor: DAPO's soft overlong punishment: 0 for length L <= Lmax -
        buffer, falling linearly to -factor at L = Lmax (the response budget); >= 0, 0 off.
      overlong_buffer: that buffer in tokens, in [1, response_length]; None: a fifth of the
        budget (DAPO's 4096 of 20480). Only with a penalty.
      mask_truncated_completions: completions that reach the budget without a stop token
        are left out of the loss (their scores still count in their group's statistics), as
        DAPO's overlong filtering and TRL's option. Needs a stop token.
      skip_nonfinite_scores: an iteration whose scores include NaN or inf is skipped and
        counted (`objective/skipped_nonfinite_scores`) instead of stopping the run with an
        error naming the rows.
      dynamic_sampling: groups of `num_generations` completions whose scores are all equal
        carry no signal: they are dropped and replaced by groups of further prompts, so
        every update still sees `batch_size` completions (`jaxppo.rollout.dynamic`).
      dynamic_sampling_rounds: generation rounds per iteration at most, the first included;
        when they do not fill the batch, the rest is filled with dropped groups whose
        response mask is zero (`dynamic/masked_groups`).
    """

    missing_eos_penalty: Optional[float] = None
    normalize_scores: bool = False
    score_clip: Optional[float] = None
    overlong_penalty_factor: float = 0.0
    overlong_buffer: Optional[int] = None
    mask_truncated_completions: bool = False
    skip_nonfinite_scores: bool = False
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 3

    def __post_init__(self):
        check_optional_real(self, "missing_eos_penalty")
        check_optional_real(self, "score_clip", 0.0, low_open=True)
        check_real(self, "overlong_penalty_factor", 0.0, note=" (0: off)")
        if self.overlong_buffer is not None:
            if not is_int(self.overlong_buffer) or self.overlong_buffer <= 0:
                raise invalid("RewardConfig", "overlong_buffer", self.overlong_buffer,
                              "None (a fifth of the response budget) or a positive int (tokens)")
            if not self.overlong_penalty_factor:
                raise invalid("RewardConfig", "overlong_buffer", self.overlong_buffer,
                              "None while overlong_penalty_factor is 0 (the buffer is only read with a penalty: set "
                              "overlong_penalty_factor > 0, DAPO's is 1.0)")
        check_bools(self, ("normalize_scores", "mask_truncated_completions", "skip_nonfinite_scores",
                           "dynamic_sampling"))
        check_counts(self, ("dynamic_sampling_rounds",))

