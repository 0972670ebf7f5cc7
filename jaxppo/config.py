"""`PPOConfig`: the sizes and coefficients of one PPO iteration, validated up front.

The config is a frozen dataclass, so it is hashable and can be passed to `jax.jit` as a
static argument: every size in it is part of the compiled shape of the update loop.

It is the user's entry point, flat (one field per setting, one CLI flag each), and it
composes the configs of the layers below it, each of which validates its own fields:
`engine` (`jaxppo.update.engine.EngineConfig`: the sizes the compiled loop reads), `loss`
(`jaxppo.update.objective.LossConfig`: what the loss reads), `update` (what `train_step`
reads: the two and the advantage function of the registered estimator) and `rollout`
(`jaxppo.rollout.sampling.RolloutConfig`: sampling and score shaping). What spans layers
(the estimator's registry, the groups against the sizes) is checked here.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["PPOConfig", "ADVANTAGE_ESTIMATORS", "LOSS_AGGREGATIONS", "setting", "on_resume", "ON_RESUME"]

from jaxppo.algorithms import ESTIMATORS
from jaxppo.rollout.sampling import RolloutConfig
from jaxppo.update.advantages import GRPO_SCALES
from jaxppo.update.checks import divisors, invalid, is_int, is_real
from jaxppo.update.engine import BatchSizes, EngineConfig, check_sizes
from jaxppo.update.losses import LOSS_AGGREGATIONS
from jaxppo.update.objective import LossConfig
from jaxppo.update.ppo import UpdateConfig

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
    which `jaxppo.run.save_restore.run_settings` reads: adding a setting is one field."""
    if on_resume not in ON_RESUME:
        raise ValueError(f"on_resume={on_resume!r} is invalid; valid: {', '.join(ON_RESUME)}")
    return dataclasses.field(default=default, metadata={"on_resume": on_resume})


def on_resume(cls, name: str) -> str:
    """The resume rule of field `name` of the config class `cls` ("same" unless it says)."""
    return {f.name: f for f in dataclasses.fields(cls)}[name].metadata.get("on_resume", "same")


def _fail(field: str, value, valid: str):
    raise invalid("PPOConfig", field, value, valid)


@dataclasses.dataclass(frozen=True)
class PPOConfig(BatchSizes):
    """The settings of a PPO iteration, for every algorithm: the user's one config, flat (a
    field per setting, a CLI flag each), composing the configs of the layers that read them
    (`engine`, `loss`, `update`, `rollout`: properties that make each from these fields).

    Sizes (the engine's, `jaxppo.update.engine.EngineConfig`; all counts of rollout rows,
    global over all devices):
      batch_size: rows collected per PPO iteration (one rollout).
      mini_batch_size: rows per optimizer update. `batch_size % mini_batch_size == 0`.
      ppo_epochs: passes over the rollout per iteration, each with a fresh permutation.
      gradient_accumulation_steps: micro-batches one mini-batch is split into to cut memory;
        still exactly one optimizer update per mini-batch.
        `mini_batch_size % gradient_accumulation_steps == 0`.
      target_kl: if set (> 0), once a mini-batch's approximate KL (measured before its
        update) exceeds it, that update and every later one in the same `train_step` are
        not applied. None disables early stopping.

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
      gamma: discount per token, in [0, 1].
      lam: GAE lambda, in [0, 1].
      whiten_advantages: whiten advantages over the whole rollout (masked) before updates.
      whiten_rewards: whiten per-token rewards (no mean shift) before GAE.

    The loss (`jaxppo.update.objective.LossConfig` documents each): cliprange,
    cliprange_low, cliprange_high, dual_clip, cliprange_value, vf_coef, ent_coef,
    temperature, importance_ratio, loss_aggregation, loss_norm_length, top_entropy_quantile,
    kl_loss_coef, kl_loss_estimator, kl_loss_bias_correction, rollout_correction,
    rollout_correction_cap, share_prompts, common_prefix, pack_sequences, pack_streams,
    pack_length.

    The rollout (`jaxppo.rollout.sampling.RolloutConfig` documents each): temperature (the
    loss's too), num_generations, kl_coef, overlong_penalty_factor, overlong_buffer,
    mask_truncated_completions.

    Adaptive entropy coefficient:
      entropy_target: None (default: `ent_coef` stays fixed), or a per-token entropy in nats
        (> 0) that the entropy bonus steers toward: `ent_coef` is then the starting
        coefficient, and after every iteration it moves by `entropy_coef_step`, up when the
        update's mean per-token entropy (`policy/entropy_avg`) was below the target, down
        otherwise, never below 0 (`jaxppo.update.shaping.adaptive_entropy_coef`; Skywork-OR1's
        adaptive entropy control). The coefficient is part of the run state (checkpointed)
        and reaches the loss as `RolloutBatch.entropy_coef`. entropy_coef_step: > 0.
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
    common_prefix: Optional[bool] = setting(None, on_resume="free")
    pack_sequences: bool = setting(False, on_resume="free")
    pack_streams: Optional[int] = setting(None, on_resume="free")
    pack_length: Optional[int] = setting(None, on_resume="free")

    def __post_init__(self):
        _check_sizes(self)
        if self.advantage_estimator not in ESTIMATORS:  # before the layers' configs, which ask the estimator
            _fail("advantage_estimator", self.advantage_estimator, "one of " + ", ".join(map(repr, ESTIMATORS)))
        _ = self.engine, self.loss, self.rollout  # each layer's config validates its own fields
        _check_algorithm(self)
        _check_numbers(self)

    @property
    def engine(self) -> EngineConfig:
        """What the update engine reads of this config (`jaxppo.update.engine.EngineConfig`):
        the sizes, epochs, accumulation and `target_kl`."""
        return EngineConfig(self.batch_size, self.mini_batch_size, self.ppo_epochs, self.gradient_accumulation_steps,
                            self.target_kl, owner="PPOConfig")

    @property
    def loss(self) -> LossConfig:
        """What the loss reads of this config (`jaxppo.update.objective.LossConfig`); its
        `uses_critic` is the estimator's."""
        return LossConfig(**{name: getattr(self, name) for name in _LOSS_FIELDS}, uses_critic=self.uses_critic,
                          owner="PPOConfig")

    @property
    def update(self) -> UpdateConfig:
        """What `train_step` reads of this config (`jaxppo.update.ppo.UpdateConfig`): the
        engine's and the loss's configs, and the registered estimator's advantages with
        this config's settings."""
        estimator = self.estimator
        return UpdateConfig(self.engine, self.loss, lambda rollout: estimator.compute(rollout, self))

    @property
    def rollout(self) -> RolloutConfig:
        """The rollout's own settings (`jaxppo.rollout.sampling.RolloutConfig`): sampling
        and the shaping of scores."""
        return RolloutConfig(**{name: getattr(self, name) for name in _ROLLOUT_FIELDS}, owner="PPOConfig")

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
        return self.loss.clip_low

    @property
    def clip_high(self) -> float:
        return self.loss.clip_high

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


# The fields each layer's config takes from a PPOConfig (the names are the same).
_LOSS_FIELDS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name not in ("uses_critic", "owner"))
_ROLLOUT_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutConfig) if f.name != "owner")


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
            f"batch_size: {divisors(c.batch_size)}."
        )


def _check_algorithm(c: "PPOConfig"):
    """What the estimator accepts, and its own settings (the loss's and the rollout's
    fields are their configs' to check)."""
    if c.grpo_scale not in GRPO_SCALES:
        _fail("grpo_scale", c.grpo_scale, "one of " + ", ".join(repr(v) for v in GRPO_SCALES))
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
    if not is_real(c.grpo_eps) or c.grpo_eps <= 0:
        _fail("grpo_eps", c.grpo_eps, "a finite real number > 0")
    for name in ("gamma", "lam"):
        value = getattr(c, name)
        if not is_real(value) or not 0.0 <= value <= 1.0:
            _fail(name, value, "a real number in [0, 1]")
    for name in ("whiten_advantages", "whiten_rewards"):
        value = getattr(c, name)
        if not isinstance(value, bool):
            _fail(name, value, "a bool (True or False)")


def _check_numbers(c: "PPOConfig"):
    """The adaptive entropy coefficient (the run's), and the packed streams against the
    micro-batch; a warning for a clip range of 0 (legal, almost surely a mistake)."""
    if c.cliprange == 0 and c.cliprange_low is None and c.cliprange_high is None:
        import warnings

        warnings.warn("PPOConfig.cliprange=0: the ratio is clipped to exactly 1, so every update after the first of "
                      "an iteration's mini-batches gets no policy gradient where the advantage pushes past it "
                      "(typical: 0.1 to 0.3)", UserWarning, stacklevel=4)
    if c.clip_low >= 1:
        import warnings

        which = "cliprange_low" if c.cliprange_low is not None else "cliprange"
        warnings.warn(f"PPOConfig.{which}={getattr(c, which)}: the ratio's lower clip 1 - {getattr(c, which)} is <= 0, "
                      "which no ratio reaches: the lower clip is gone, and an update may push a token's probability "
                      "down without limit where the advantage is negative (typical: 0.1 to 0.3)", UserWarning,
                      stacklevel=4)
    if c.entropy_target is not None and (not is_real(c.entropy_target) or c.entropy_target <= 0):
        _fail("entropy_target", c.entropy_target,
              "None (a fixed ent_coef) or a finite real number > 0 (nats per token)")
    if not is_real(c.entropy_coef_step) or c.entropy_coef_step <= 0:
        _fail("entropy_coef_step", c.entropy_coef_step, "a finite real number > 0")
    if c.pack_streams is not None and c.pack_streams > c.micro_batch_size:
        _fail("pack_streams", c.pack_streams,
              f"None (chosen per iteration by the Trainer) or an int in [1, micro_batch_size={c.micro_batch_size}] "
              "(streams per micro-batch)")
