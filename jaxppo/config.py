"""`PPOConfig`: the sizes and coefficients of one PPO update, validated up front.

The config is a frozen dataclass, so it is hashable and can be passed to `jax.jit` as a
static argument: every size in it is part of the compiled shape of the update loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["PPOConfig", "ADVANTAGE_ESTIMATORS", "LOSS_AGGREGATIONS", "setting", "on_resume", "ON_RESUME"]

from jaxppo.algorithms import ESTIMATORS
from jaxppo.update.advantages import GRPO_SCALES
from jaxppo.update.correction import ROLLOUT_CORRECTIONS
from jaxppo.update.engine import BatchSizes, EngineConfig, check_sizes
from jaxppo.update.kl import KL_LOSS_ESTIMATORS
from jaxppo.update.losses import IMPORTANCE_RATIOS, LOSS_AGGREGATIONS

# The built-in advantage estimators; configs validate against the live registry
# (`jaxppo.algorithms.ESTIMATORS`, which `register_estimator` extends).
ADVANTAGE_ESTIMATORS = tuple(ESTIMATORS)
# How a field is treated when a run resumes (`setting(..., on_resume=...)`; plain fields are "same").
ON_RESUME = {
    "same": "recorded in the run's settings; a resumed run must match it",
    "same_if_set": "recorded only when it differs from its default (a field added after runs were first saved, "
                   "so runs saved before it existed still resume); a resumed run must match it",
    "free": "may differ on resume: it changes how the run computes or what it writes, not its results",
}


def setting(default, *, on_resume: str = "same"):
    """A config field with a default and its rule on resume (one of `ON_RESUME`'s keys),
    which `jaxppo.run.resume.run_settings` reads: adding a setting is one field."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume={on_resume!r} is invalid; valid: {', '.join(ON_RESUME)}")
    return dataclasses.field(default=default, metadata={"on_resume": on_resume})


def on_resume(cls, name: str) -> str:
    """The resume rule of field `name` of the config class `cls` ("same" unless it says)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("on_resume", "same")


def is_int(value) -> bool:
    # bool is a subclass of int; a bool where a count is due is a mistake, not a 0/1.
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _fail(field: str, value, valid: str):
    raise ValueError(f"PPOConfig.{field}={value!r} is invalid: {field} must be {valid}.")


@dataclasses.dataclass(frozen=True)
class PPOConfig(BatchSizes):
    """Sizes and coefficients of a PPO update (one `train_step`).

    Sizes (all counts of rollout rows, global over all devices):
      batch_size: rows collected per PPO iteration (one rollout).
      mini_batch_size: rows per optimizer update. `batch_size % mini_batch_size == 0`.
      ppo_epochs: passes over the rollout per iteration, each with a fresh permutation.
      gradient_accumulation_steps: micro-batches one mini-batch is split into to cut memory;
        still exactly one optimizer update per mini-batch.
        `mini_batch_size % gradient_accumulation_steps == 0`.

    Loss coefficients:
      cliprange: PPO ratio clip epsilon (ratio is clipped to [1 - c, 1 + c]); >= 0.
      cliprange_value: value clip range around the old values; >= 0.
      vf_coef: weight of the value loss in the total loss; >= 0.
      ent_coef: weight of the entropy bonus (subtracted from the loss); >= 0.

    Advantages:
      gamma: discount per token, in [0, 1].
      lam: GAE lambda, in [0, 1].
      whiten_advantages: whiten advantages over the whole rollout (masked) before updates.
      whiten_rewards: whiten per-token rewards (no mean shift) before GAE.

    Sampling and early stopping:
      temperature: logits are divided by this before log-softmax, as at sampling time; > 0.
      target_kl: if set (> 0), once a mini-batch's approximate KL (measured before its
        update) exceeds it, that update and every later one in the same `train_step` are
        not applied. None disables early stopping.

    RLHF rollout (used by the rollout layer, not by the update itself):
      kl_coef: initial beta of the KL penalty in the per-token rewards; >= 0.

    Algorithm (the defaults are PPO's; `PPOConfig.for_algorithm(name)` and
    `jaxppo.algorithms.ALGORITHMS` set those of GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++ and
    GSPO):
      advantage_estimator: "gae" (PPO, with a critic), "grpo", "rloo", "reinforce_pp" or
        "reinforce_pp_baseline" (critic-free: no critic is built, run or checkpointed).
        Only "gae" uses gamma, lam, whiten_advantages, whiten_rewards, vf_coef and
        cliprange_value; the critic-free estimators normalise as their method defines.
      num_generations: completions per prompt (G). `batch_size` and `mini_batch_size`
        count completions; `batch_size % num_generations == 0`, and each iteration
        samples `batch_size / num_generations` prompts. "grpo", "rloo" and
        "reinforce_pp_baseline" compare the completions of a prompt: they need G >= 2.
      grpo_scale: "group" (GRPO: divide by the group's std), "batch" (by the batch's std),
        "none" (Dr. GRPO: no division). grpo_eps: added to that std; > 0.
      loss_aggregation: "token_mean" (every real token of the mini-batch counts equally:
        PPO, DAPO), "seq_mean_token_mean" (mean over completions of their token means:
        GRPO), "seq_mean_token_sum_norm" (mean over completions of their token sums divided
        by `loss_norm_length`, default the response length: Dr. GRPO), or
        "token_sum_batch_norm" (the mini-batch's token sum divided by the rollout batch's
        real tokens / `num_minibatches`: TRL's `loss_type="dapo"` with `steps_per_generation`
        = num_minibatches; equal to "token_mean" with one mini-batch). Applies to every term
        of the loss.
      loss_norm_length: the constant "seq_mean_token_sum_norm" divides by (TRL's
        `max_completion_length`); None: the rollout's response width. A positive int.
      cliprange_low, cliprange_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's
        clip-higher); None means `cliprange`.
      dual_clip: None, or a constant c > 1: for negative advantages the loss is capped at
        -A * c (dual-clip PPO).
      importance_ratio: "token" (per-token ratios), "sequence" (GSPO: exp of the mean
        per-token log-ratio of the completion, shared by its tokens) or "sequence_sum"
        (TRL RLOOTrainer's: exp of the summed log-ratio, the whole completion as one
        action). The sequence-level ratios need one advantage per completion: they are
        refused with the per-token estimators ("gae", "reinforce_pp", "reinforce_pp_baseline").
      kl_loss_coef: beta of a KL(policy || reference) term in the loss (GRPO's), >= 0;
        kl_loss_estimator: "k1", "k2" or "k3". When kl_coef, kl_loss_coef are 0 and the
        trainer has no kl_target, no reference model is built or run at all.
        kl_loss_bias_correction: multiply each token's KL term by its importance ratio
        pi / pi_old (gradient through the ratio too): TRL's `use_bias_correction_kl`, on by
        default there, off here (as in verl and the GRPO paper).

    Sampler mismatch (applies to rollouts that carry the sampler's log-probs,
    `Rollout.sampler_logprobs`, as the trainer's do):
      rollout_correction: how the policy loss corrects for the sampler's distribution
        differing from the trainer's (`jaxppo.update.correction`): "token_truncate" (default:
        each token's loss weighted by min(pi_old / pi_sampler, C), truncated importance
        sampling), "token_mask" (tokens whose ratio lies outside [1/C, C] get weight 0),
        "sequence_truncate" / "sequence_mask" (the same with the completion's ratio, the
        product of its tokens'), or "none". With the built-in sampler in float32 the
        ratios are 1 within rounding and the default changes nothing measurable; in bf16,
        or with another engine, it is the correction the samples need.
      rollout_correction_cap: C, > 1.

    Adaptive entropy coefficient:
      entropy_target: None (default: `ent_coef` stays fixed), or a per-token entropy in nats
        (> 0) that the entropy bonus steers toward: `ent_coef` is then the starting
        coefficient, and after every iteration it moves by `entropy_coef_step`, up when the
        update's mean per-token entropy (`policy/entropy_avg`) was below the target, down
        otherwise, never below 0 (`jaxppo.update.shaping.adaptive_entropy_coef`; Skywork-OR1's
        adaptive entropy control). The coefficient is part of the run state (checkpointed)
        and reaches the loss as `Rollout.entropy_coef`. entropy_coef_step: > 0.

    Token selection and overlong completions:
      top_entropy_quantile: train the policy term only on this fraction of the response
        tokens, those of highest entropy under the current policy (Wang et al. 2025,
        "Beyond the 80/20 rule": 0.2; TRL's `top_entropy_quantile`): a token counts when
        its entropy is >= the (1 - q)-quantile of the entropies of the real response
        tokens of the (micro-)batch the loss sees. In (0, 1]; 1.0 (default) keeps all.
        The other terms (value, entropy bonus, KL) keep every token.
      overlong_penalty_factor: DAPO's soft overlong punishment, added to each completion's
        score by the rollout layer: 0 for length L <= Lmax - buffer, falling linearly to
        -factor at L = Lmax, where Lmax is the response budget (the rollout's width) and
        buffer `overlong_buffer`. >= 0; 0 (default) turns it off.
      overlong_buffer: the buffer in tokens, a positive int no longer than the response
        budget; None (default) means a fifth of the budget (DAPO's 4096 of 20480). Only
        read when overlong_penalty_factor > 0.
      mask_truncated_completions: completions that reach the budget without a stop token
        are left out of the loss (their response mask is zeroed in the rollout; their
        scores still count in their group's statistics), as DAPO's overlong filtering and
        TRL's `mask_truncated_completions`. Needs a stop token.

    Groups of completions (`num_generations` G > 1): when G divides `mini_batch_size`,
    every mini-batch holds whole groups (the rollout is shuffled group by group;
    `jaxppo.update.ppo.minibatch_group`), else rows are shuffled one by one.
      share_prompts: run each group's prompt once, for its G completions, in the scoring
        pass and in the update's loss (`jaxppo.models.Model.grouped_outputs`: the prompt's
        keys and values are shared, its activations receive the sum of the G completions'
        gradients): the same log-probs, losses and gradients up to float rounding, for a
        group's Q + G * R tokens instead of G * (Q + R) (built-in models; any other runs
        every row). Only where G also divides the micro-batch and without `pack_sequences`, which packs
        rows instead. Under a mesh of several devices the loss runs every row (a JAX
        partitioner bug in the grouped gradient, seen in 0.10.2 to 0.12.0.1); the scoring pass still groups.
        None (the default): the trainer turns it on (its groups share their prompt by
        construction); `train_step` on a rollout you build runs every row. True: your
        rollout's groups share their prompt (`jaxppo.check_rollout` checks it; a group
        that does not gives wrong results). False: every row, as 0.3 did.

    Packed sequences (`jaxppo.update.packing`; the same losses and gradients, up to float rounding):
      pack_sequences: run the loss's forward on each micro-batch's rows of real tokens
        packed into `pack_streams` streams of `pack_length` tokens (segment ids: attention
        and positions restart per row) instead of the padded (rows, Q + R) batch. Needs a
        built-in model (`jaxppo.models.Model` or `PolicyAndCritic`). The mini-batches and
        the update count are those of the padded path. A micro-batch whose rows need more
        streams runs padded (counted: `packing/overflow`).
      pack_streams: streams per micro-batch, a positive int no larger than the micro-batch.
        None: `train_step` refuses it; the `Trainer` chooses it per iteration with
        `jaxppo.update.packing.minibatch_streams` (the fewest that every micro-batch fits in,
        rounded up to 1, 2, 3, 4, 6, 8, 12, ...), so nothing falls back.
      pack_length: tokens per stream, >= the padded width Q + R (checked while tracing);
        None: Q + R.
    """

    batch_size: int = 64
    mini_batch_size: int = 16
    ppo_epochs: int = 4
    gradient_accumulation_steps: int = 1
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    temperature: float = 1.0
    target_kl: Optional[float] = None
    kl_coef: float = 0.05
    advantage_estimator: str = setting("gae", on_resume="same_if_set")
    num_generations: int = setting(1, on_resume="same_if_set")
    grpo_scale: str = setting("group", on_resume="same_if_set")
    grpo_eps: float = setting(1e-4, on_resume="same_if_set")
    loss_aggregation: str = setting("token_mean", on_resume="same_if_set")
    cliprange_low: Optional[float] = setting(None, on_resume="same_if_set")
    cliprange_high: Optional[float] = setting(None, on_resume="same_if_set")
    dual_clip: Optional[float] = setting(None, on_resume="same_if_set")
    importance_ratio: str = setting("token", on_resume="same_if_set")
    kl_loss_coef: float = setting(0.0, on_resume="same_if_set")
    kl_loss_estimator: str = setting("k3", on_resume="same_if_set")
    rollout_correction: str = setting("token_truncate", on_resume="same_if_set")
    rollout_correction_cap: float = setting(2.0, on_resume="same_if_set")
    top_entropy_quantile: float = setting(1.0, on_resume="same_if_set")
    overlong_penalty_factor: float = setting(0.0, on_resume="same_if_set")
    overlong_buffer: Optional[int] = setting(None, on_resume="same_if_set")
    mask_truncated_completions: bool = setting(False, on_resume="same_if_set")
    entropy_target: Optional[float] = setting(None, on_resume="same_if_set")
    entropy_coef_step: float = setting(0.005, on_resume="same_if_set")
    loss_norm_length: Optional[int] = setting(None, on_resume="same_if_set")
    kl_loss_bias_correction: bool = setting(False, on_resume="same_if_set")
    share_prompts: Optional[bool] = setting(None, on_resume="free")
    pack_sequences: bool = setting(False, on_resume="free")
    pack_streams: Optional[int] = setting(None, on_resume="free")
    pack_length: Optional[int] = setting(None, on_resume="free")

    def __post_init__(self):
        _check_sizes(self)
        _check_algorithm(self)
        _check_numbers(self)

    @property
    def engine(self) -> EngineConfig:
        """What the update engine reads of this config (`jaxppo.update.engine.EngineConfig`):
        the sizes, epochs, accumulation and `target_kl`."""
        return EngineConfig(self.batch_size, self.mini_batch_size, self.ppo_epochs, self.gradient_accumulation_steps,
                            self.target_kl, owner="PPOConfig")

    @property
    def uses_critic(self) -> bool:
        """Whether the algorithm has a critic (value model): its advantage estimator says
        (of the built-in ones, only GAE)."""
        return ESTIMATORS[self.advantage_estimator].uses_critic

    @property
    def estimator(self):
        """The `jaxppo.algorithms.AdvantageEstimator` this config uses."""
        return ESTIMATORS[self.advantage_estimator]

    @property
    def clip_low(self) -> float:
        return self.cliprange if self.cliprange_low is None else self.cliprange_low

    @property
    def clip_high(self) -> float:
        return self.cliprange if self.cliprange_high is None else self.cliprange_high

    @property
    def prompts_per_batch(self) -> int:
        """Prompts sampled per iteration: `batch_size // num_generations`."""
        return self.batch_size // self.num_generations

    @classmethod
    def for_algorithm(cls, name: str, **overrides) -> "PPOConfig":
        """A config with the defaults of algorithm `name` (see `jaxppo.algorithms`), then
        `overrides` (any field)."""
        from jaxppo.algorithms import algorithm_defaults

        return cls(**{**algorithm_defaults(name), **overrides})

    def replace(self, **changes) -> "PPOConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_sizes(c: "PPOConfig"):
    """The counts and how they divide one another (the engine's, then the groups')."""
    check_sizes("PPOConfig", c.batch_size, c.mini_batch_size, c.ppo_epochs, c.gradient_accumulation_steps)
    if not is_int(c.num_generations) or c.num_generations <= 0:
        kind = "" if is_int(c.num_generations) else f" (got type {type(c.num_generations).__name__})"
        _fail("num_generations", c.num_generations, "a positive int" + kind)
    if c.batch_size % c.num_generations != 0:
        raise ValueError(
            f"PPOConfig.batch_size={c.batch_size} is not a multiple of "
            f"PPOConfig.num_generations={c.num_generations}: batch_size counts completions, "
            f"num_generations of them per prompt. Valid num_generations values for this "
            f"batch_size: {_divisors(c.batch_size)}."
        )


def _check_algorithm(c: "PPOConfig"):
    """The choices against the registry, and what the estimator accepts."""
    choices = {"advantage_estimator": tuple(ESTIMATORS), "grpo_scale": GRPO_SCALES,
               "loss_aggregation": LOSS_AGGREGATIONS, "importance_ratio": IMPORTANCE_RATIOS,
               "kl_loss_estimator": KL_LOSS_ESTIMATORS, "rollout_correction": ROLLOUT_CORRECTIONS}
    for name, valid in choices.items():
        if getattr(c, name) not in valid:
            _fail(name, getattr(c, name), "one of " + ", ".join(repr(v) for v in valid))
    estimator = ESTIMATORS[c.advantage_estimator]
    if c.num_generations < estimator.min_generations:
        _fail("num_generations", c.num_generations,
              f">= {estimator.min_generations} with advantage_estimator={c.advantage_estimator!r}, which "
              "compares the completions of each prompt (a group of one has no baseline)")
    if c.importance_ratio != "token" and estimator.per_token:
        _fail("importance_ratio", c.importance_ratio,
              f"'token' with advantage_estimator={c.advantage_estimator!r}: its advantages vary along a "
              "completion, and a sequence-level ratio weighs one number per completion (use an estimator with "
              f"one advantage per completion: {', '.join(n for n, e in ESTIMATORS.items() if not e.per_token)})")
    for name in ("cliprange_low", "cliprange_high"):
        value = getattr(c, name)
        if value is not None and (not is_real(value) or value < 0 or (name == "cliprange_low" and value > 1)):
            _fail(name, value, "None (use cliprange) or a finite real number >= 0"
                  + (" and <= 1" if name == "cliprange_low" else ""))
    if c.dual_clip is not None and (not is_real(c.dual_clip) or c.dual_clip <= 1):
        _fail("dual_clip", c.dual_clip, "None (no dual clip) or a finite real number > 1")
    if not is_real(c.rollout_correction_cap) or c.rollout_correction_cap <= 1:
        _fail("rollout_correction_cap", c.rollout_correction_cap, "a finite real number > 1")


def _check_numbers(c: "PPOConfig"):
    """Coefficients, ranges and flags."""
    if not is_real(c.grpo_eps) or c.grpo_eps <= 0:
        _fail("grpo_eps", c.grpo_eps, "a finite real number > 0")
    for name in ("cliprange", "cliprange_value", "vf_coef", "ent_coef", "kl_coef", "kl_loss_coef"):
        value = getattr(c, name)
        if not is_real(value) or value < 0:
            _fail(name, value, "a finite real number >= 0")
    for name in ("gamma", "lam"):
        value = getattr(c, name)
        if not is_real(value) or not 0.0 <= value <= 1.0:
            _fail(name, value, "a real number in [0, 1]")
    if not is_real(c.top_entropy_quantile) or not 0 < c.top_entropy_quantile <= 1:
        _fail("top_entropy_quantile", c.top_entropy_quantile,
              "a real number in (0, 1]: the fraction of response tokens, by highest entropy, the policy term "
              "trains on (1.0 keeps all)")
    if not is_real(c.overlong_penalty_factor) or c.overlong_penalty_factor < 0:
        _fail("overlong_penalty_factor", c.overlong_penalty_factor, "a finite real number >= 0 (0: off)")
    if c.overlong_buffer is not None:
        if not is_int(c.overlong_buffer) or c.overlong_buffer <= 0:
            _fail("overlong_buffer", c.overlong_buffer,
                  "None (a fifth of the response budget) or a positive int (tokens)")
        if not c.overlong_penalty_factor:
            _fail("overlong_buffer", c.overlong_buffer,
                  "None while overlong_penalty_factor is 0 (the buffer is only read with a penalty: set "
                  "overlong_penalty_factor > 0, DAPO's is 1.0)")
    if c.entropy_target is not None and (not is_real(c.entropy_target) or c.entropy_target <= 0):
        _fail("entropy_target", c.entropy_target,
              "None (a fixed ent_coef) or a finite real number > 0 (nats per token)")
    if not is_real(c.entropy_coef_step) or c.entropy_coef_step <= 0:
        _fail("entropy_coef_step", c.entropy_coef_step, "a finite real number > 0")
    if c.loss_norm_length is not None and (not is_int(c.loss_norm_length) or c.loss_norm_length <= 0):
        _fail("loss_norm_length", c.loss_norm_length,
              "None (the response width) or a positive int (TRL's max_completion_length)")
    _check_packing(c)
    if c.share_prompts not in (None, True, False):
        _fail("share_prompts", c.share_prompts, "None (the trainer: on; train_step: off), True or False")
    for name in ("whiten_advantages", "whiten_rewards", "mask_truncated_completions", "pack_sequences"):
        value = getattr(c, name)
        if not isinstance(value, bool):
            _fail(name, value, "a bool (True or False)")
    if not is_real(c.temperature) or c.temperature <= 0:
        _fail("temperature", c.temperature, "a finite real number > 0")
    if c.target_kl is not None and (not is_real(c.target_kl) or c.target_kl <= 0):
        _fail("target_kl", c.target_kl, "None (no early stopping) or a finite real number > 0")


def _check_packing(c: "PPOConfig"):
    if c.pack_streams is not None and (not is_int(c.pack_streams) or not 0 < c.pack_streams <= c.micro_batch_size):
        _fail("pack_streams", c.pack_streams,
              f"None (chosen per iteration by the Trainer) or an int in [1, micro_batch_size={c.micro_batch_size}] "
              "(streams per micro-batch)")
    if c.pack_length is not None and (not is_int(c.pack_length) or c.pack_length <= 0):
        _fail("pack_length", c.pack_length, "None (the padded width Q + R) or a positive int (tokens per stream)")
    for name in ("pack_streams", "pack_length"):
        if getattr(c, name) is not None and c.pack_sequences is not True:
            _fail(name, getattr(c, name), "None unless pack_sequences=True (it sizes the packed streams)")


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]
