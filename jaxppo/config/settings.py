"""`jaxppo.Config`: every setting of a run, each in the one config its concern names, composed
into one frozen, hashable value; the rules that span two concerns are checked here, in one
function (`check_config`).

    config = jaxppo.Config(batch=jaxppo.BatchConfig(batch_size=64, mini_batch_size=16),
                           loss=jaxppo.LossConfig(cliprange=0.2),
                           optimizer=jaxppo.OptimizerConfig(learning_rate=1e-5))
    config = jaxppo.Config.for_algorithm("grpo", batch_size=64, learning_rate=1e-6)  # by name
    config.loss.cliprange, config.sampling.top_p, config.optimizer.learning_rate

Every setting has one name, unique across the concerns, which is also its flag
(`--mini-batch-size`) and its key in a `--config` file; `Config.from_settings` and
`Config.replace` take settings by that name and put each in its concern.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Mapping, Optional

from jaxppo.algorithms import ESTIMATORS
from jaxppo.algorithms.base import EstimatorConfig
from jaxppo.config.adapters import AdapterConfig
from jaxppo.config.algorithm import AdvantageConfig, KLConfig, LossConfig, RewardConfig
from jaxppo.config.fields import is_flag
from jaxppo.config.layout import LayoutConfig
from jaxppo.config.optimizer import OptimizerConfig
from jaxppo.config.renamed import DEPRECATED, translate
from jaxppo.config.run import DataConfig, EvalConfig, RunConfig
from jaxppo.config.sampling import EnvironmentConfig, SamplingConfig
from jaxppo.rollout.engines import inflight_missing
from jaxppo.update.checks import invalid
from jaxppo.update.minibatches import BatchConfig
from jaxppo.update.objective import Objective
from jaxppo.update.ppo import UpdateConfig

__all__ = ["Config", "CONCERNS", "SETTINGS", "check_config", "setting_field"]

# The concerns, in the order a reader meets them: the algorithm (the batch, advantages, the
# loss, the KL, rewards), sampling (and multi-turn episodes), the optimizer, the layout, and
# the run (its data, evaluation and output).
CONCERNS = {
    "batch": BatchConfig,
    "advantages": AdvantageConfig,
    "loss": LossConfig,
    "kl": KLConfig,
    "rewards": RewardConfig,
    "sampling": SamplingConfig,
    "environment": EnvironmentConfig,
    "optimizer": OptimizerConfig,
    "lora": AdapterConfig,
    "layout": LayoutConfig,
    "data": DataConfig,
    "evaluation": EvalConfig,
    "run": RunConfig,
}

# {setting name: the concern that holds it}; each name is in exactly one concern.
SETTINGS = {f.name: concern for concern, cls in CONCERNS.items() for f in dataclasses.fields(cls)}
assert len(SETTINGS) == sum(len(dataclasses.fields(cls)) for cls in CONCERNS.values()), "a setting in two concerns"


def setting_field(name: str) -> dataclasses.Field:
    """The dataclass field of setting `name` (its default, its type, whether it is free on
    resume and a flag)."""
    return {f.name: f for f in dataclasses.fields(CONCERNS[SETTINGS[name]])}[name]


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings of a run, by concern (each a frozen config documenting its fields):

      batch: `jaxppo.BatchConfig`, the batch and the update's mini-batch loop (sizes,
        epochs, accumulation, early stop on `target_kl`).
      advantages: `jaxppo.AdvantageConfig`, the estimator, the groups and PPO's critic.
      loss: `jaxppo.LossConfig`, the loss (clipping, the ratio, aggregation, the value and
        entropy terms, the sampler-mismatch correction).
      kl: `jaxppo.KLConfig`, the KL to the reference, in the reward or the loss, and its
        control.
      rewards: `jaxppo.RewardConfig`, how scores become rewards (shaping, non-finite scores,
        dynamic sampling).
      sampling: `jaxppo.SamplingConfig`, the behaviour policy, stops, the response budget,
        the rollout engine, how far sampling runs ahead of the update.
      environment: `jaxppo.EnvironmentConfig`, multi-turn episodes.
      optimizer: `jaxppo.OptimizerConfig`, learning rates, schedule, Adam, clipping, or an
        optax transformation.
      lora: `jaxppo.AdapterConfig`, which weights train: all, or LoRA adapters (rank,
        alpha, targets, an adapter to start from).
      layout: `jaxppo.LayoutConfig`, what changes speed and memory, not results (dtypes,
        scanned layers, remat, attention, prompts run once, packing, the mesh).
      data: `jaxppo.DataConfig`, the prompts: their length, rendering, streaming.
      evaluation: `jaxppo.EvalConfig`, evaluation during training.
      run: `jaxppo.RunConfig`, the seed, the length, the run directory, checkpoints,
        trackers, exports, resume.

    Frozen and hashable: `train_step` takes it as a static argument. A concern may be given
    as a dict of its settings. `for_algorithm` sets a published method's settings;
    `from_settings` and `replace` take settings by name.
    """

    batch: BatchConfig = dataclasses.field(default_factory=BatchConfig)
    advantages: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    kl: KLConfig = dataclasses.field(default_factory=KLConfig)
    rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    environment: EnvironmentConfig = dataclasses.field(default_factory=EnvironmentConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    evaluation: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def __post_init__(self):
        for concern, cls in CONCERNS.items():
            value = getattr(self, concern)
            if isinstance(value, Mapping):  # a concern given as a dict of its settings (a --config file's table)
                value = _concern_of(cls, value)
                object.__setattr__(self, concern, value)
            if not isinstance(value, cls):
                raise TypeError(f"Config.{concern} must be a jaxppo.{cls.__name__} (or a dict of its settings), got "
                                f"{type(value).__name__}")
        check_config(self)

    # ------------------------------------------------------------ what the layers read

    @property
    def estimator(self):
        """The `jaxppo.algorithms.AdvantageEstimator` of `advantages.advantage_estimator`."""
        return ESTIMATORS[self.advantages.advantage_estimator]

    @property
    def uses_critic(self) -> bool:
        """The algorithm has a critic (value model): its estimator says (of the built-in
        ones, only GAE)."""
        return self.estimator.uses_critic

    @property
    def needs_reference(self) -> bool:
        """The run scores the sampled tokens with a frozen model: a reference for a KL
        (`KLConfig.needs_reference`), or on-policy distillation's teacher (an estimator that
        `uses_reference`)."""
        return self.kl.needs_reference or self.estimator.uses_reference

    @property
    def keeps_ref_logprobs(self) -> bool:
        """The rollout carries the frozen model's log-probs (`ref_logprobs`): for a KL term
        in the loss, or for an estimator that reads them (the teacher's)."""
        return bool(self.kl.kl_loss_coef) or self.estimator.uses_reference

    @property
    def prompts_per_batch(self) -> int:
        """Prompts sampled per iteration: `batch_size // num_generations`."""
        return self.batch.batch_size // self.batch.num_generations

    @property
    def objective(self) -> Objective:
        """What the loss reads (`jaxppo.update.objective.Objective`): each of its fields is the
        setting of that name, read from its concern, and `uses_critic`, the estimator's."""
        names = (f.name for f in dataclasses.fields(Objective) if f.name != "uses_critic")
        return Objective(uses_critic=self.uses_critic,
                         **{name: getattr(getattr(self, SETTINGS[name]), name) for name in names})

    @property
    def update(self) -> UpdateConfig:
        """What `train_step` reads (`jaxppo.update.ppo.UpdateConfig`): the batch, the loss's
        view and the registered estimator's advantages with `advantages`' settings."""
        estimator, settings = self.estimator, EstimatorConfig(self.advantages, self.batch.num_generations)
        return UpdateConfig(self.batch, self.objective, lambda rollout: estimator.compute(rollout, settings))

    # ------------------------------------------------------------ settings by name

    @classmethod
    def from_settings(cls, settings: Optional[Mapping] = None, /, **more) -> "Config":
        """A config from settings by name (`settings` and `more`: {name: value}, as the
        command's flags and `--config` files give them), each put in its concern; a concern's
        name with a dict (or config) sets that concern. The names of 0.4 work for one more
        release (a `DeprecationWarning` names the new spelling); an unknown name is a
        `ValueError` naming the closest valid one."""
        given = translate({**(settings or {}), **more}, warn=True)
        return cls(**_by_concern(given, {}))

    @classmethod
    def for_algorithm(cls, name: str, /, **settings) -> "Config":
        """A config with the settings of the published method `name` (`jaxppo.algorithms`:
        "ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo"), then `settings`
        over them: by name, or a concern's name with a config or dict, which replaces that
        whole concern (the method's settings in it included)."""
        from jaxppo.algorithms import algorithm_defaults

        base = cls.from_settings(algorithm_defaults(name))
        return cls(**_by_concern(translate(settings, warn=True, base=base), base.concerns()))

    def replace(self, **changes) -> "Config":
        """A copy with `changes` applied: settings by name (`cliprange=0.1`), or a concern by
        its name (`loss=jaxppo.LossConfig(...)`); validated again. It takes the names of
        0.5 only (0.4's are translated where settings come in: `from_settings`,
        `for_algorithm`, the command, `--config` files)."""
        old = sorted(set(changes) & set(DEPRECATED))
        if old:
            raise ValueError(f"Config.replace({old[0]}=...): {old[0]!r} is a name before 0.5; give "
                             f"{DEPRECATED[old[0]]} (Config.from_settings still translates it)")
        return Config(**_by_concern(changes, self.concerns()))

    def concerns(self) -> dict:
        """{concern name: its config}."""
        return {concern: getattr(self, concern) for concern in CONCERNS}

    def settings(self) -> dict:
        """{setting name: value} of every setting, flat."""
        return {f.name: getattr(c, f.name) for c in self.concerns().values() for f in dataclasses.fields(c)}

    @classmethod
    def flags(cls) -> dict:
        """{setting name: its dataclass field} of the settings the command has flags for."""
        return {name: setting_field(name) for name in SETTINGS if is_flag(setting_field(name))}


def _concern_of(cls, value):
    """`value` (a dict of settings of the concern `cls`) as that concern's config."""
    if isinstance(value, cls):
        return value
    unknown = sorted(set(value) - set(cls.names()))
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting {unknown[0]!r}{_closest(unknown[0], cls.names())}; its "
                         f"settings: {', '.join(cls.names())}")
    return cls(**value)


def _by_concern(given: dict, base: dict) -> dict:
    """{concern: its config}: `base`'s concerns (or the defaults), with the settings in
    `given` (by setting name, or by concern name) applied."""
    whole = {k: v for k, v in given.items() if k in CONCERNS}
    unknown = sorted(k for k in given if k not in CONCERNS and k not in SETTINGS)
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}{_closest(unknown[0], list(SETTINGS) + list(CONCERNS))}"
                         + (f" (and {', '.join(map(repr, unknown[1:]))})" if unknown[1:] else "")
                         + "; `jaxppo --help` lists every setting, grouped by concern")
    out = {}
    for concern, cls in CONCERNS.items():
        changes = {k: v for k, v in given.items() if SETTINGS.get(k) == concern}
        current = base.get(concern)
        if concern in whole:
            current = _concern_of(cls, whole[concern])
        if changes:
            out[concern] = current.replace(**changes) if current is not None else cls(**changes)
        elif current is not None:
            out[concern] = current
    return out


def _closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _check_distillation(c: "Config", estimator):
    """On-policy distillation's settings: read by an estimator that reads them, the task's
    weight with groups, the teacher's top k with an unpacked loss."""
    a = c.advantages
    for name, default in (("task_reward_weight", 0), ("distill_top_k", 0), ("distill_divergence", "reverse")):
        if getattr(a, name) != default and name not in estimator.config_fields:
            raise invalid("AdvantageConfig", name, getattr(a, name),
                          f"{default!r} with advantage_estimator={a.advantage_estimator!r}, which does not read it "
                          "(on-policy distillation's 'distill' does: "
                          + ("the task rewards' weight beside the teacher)" if name == "task_reward_weight" else
                             "how the teacher's distribution is read)"))
    if a.task_reward_weight and c.batch.num_generations < 2:
        raise invalid("AdvantageConfig", "task_reward_weight", a.task_reward_weight,
                      f"0 with BatchConfig.num_generations={c.batch.num_generations}: the task's advantage is each "
                      "completion's score against its group's, and a group of one has none; set num_generations >= 2 "
                      "(and batch_size a multiple of it)")
    if a.distill_divergence != "reverse" and not a.distill_top_k:
        raise invalid("AdvantageConfig", "distill_divergence", a.distill_divergence,
                      "'reverse' with AdvantageConfig.distill_top_k=0: the divergence's direction is read by the "
                      "top-k loss term only (the sampled-token advantage is the reverse KL's estimate); set "
                      "distill_top_k > 0 for a forward KL")
    if a.distill_top_k and c.layout.pack_sequences:
        raise invalid("LayoutConfig", "pack_sequences", True,
                      f"False with AdvantageConfig.distill_top_k={a.distill_top_k}: the divergence to the teacher's "
                      "top k reads the student's log-probs of the teacher's tokens, which the packed forward does not "
                      "compute (set distill_top_k=0 to distil from the sampled tokens, which packs)")


def _check_routing(c: "Config"):
    """Routing replay and the load-balancing loss read the policy's routing from the plain
    layout's forward: refused beside a layout that runs rows otherwise, and beside old
    log-probs from the sampler (no forward pass records the routing then)."""
    loss = c.loss
    asked = [f"{name}={getattr(loss, name)!r}" for name in ("routing_replay", "router_aux_loss_coef")
             if getattr(loss, name)]
    if not asked:
        return
    for name in ("share_prompts", "common_prefix", "pack_sequences"):
        if getattr(c.layout, name) is True:
            raise invalid("LayoutConfig", name, True,
                          f"False or None with LossConfig.{' and '.join(asked)}: the routing is recorded and replayed "
                          "in the plain layout, each row's own prompt and response")
    if c.sampling.old_logprobs == "sampler":
        raise invalid("SamplingConfig", "old_logprobs", "sampler",
                      f"'recompute' or 'auto' with LossConfig.{' and '.join(asked)}: the routing to replay is the "
                      "forward pass's, which old log-probs from the sampler skip")


def check_config(c: Config) -> None:
    """The rules that span two concerns, each error naming the settings involved (each
    concern has checked its own settings already)."""
    b, a, sampling = c.batch, c.advantages, c.sampling
    if a.advantage_estimator not in ESTIMATORS:
        raise invalid("AdvantageConfig", "advantage_estimator", a.advantage_estimator,
                      "one of " + ", ".join(map(repr, ESTIMATORS)))
    estimator = ESTIMATORS[a.advantage_estimator]
    if b.num_generations < estimator.min_generations:
        raise invalid("BatchConfig", "num_generations", b.num_generations,
                      f">= {estimator.min_generations} with advantage_estimator={a.advantage_estimator!r}, which "
                      "compares the completions of each prompt (a group of one has no baseline)")
    if c.loss.importance_ratio != "token" and estimator.per_token:
        raise invalid("LossConfig", "importance_ratio", c.loss.importance_ratio,
                      f"'token' with AdvantageConfig.advantage_estimator={a.advantage_estimator!r}: its advantages "
                      "vary along a completion, and a sequence-level ratio weighs one number per completion (use an "
                      "estimator with one advantage per completion: "
                      f"{', '.join(n for n, e in ESTIMATORS.items() if not e.per_token)})")
    _check_distillation(c, estimator)
    _check_routing(c)
    if a.shared_trunk and not estimator.uses_critic:
        raise ValueError(f"AdvantageConfig.shared_trunk=True puts a value head on the policy, but "
                         f"advantage_estimator={a.advantage_estimator!r} has no critic; set shared_trunk=False")
    if c.layout.pack_streams is not None and c.layout.pack_streams > b.micro_batch_size:
        raise invalid("LayoutConfig", "pack_streams", c.layout.pack_streams,
                      f"None (chosen per iteration by the Trainer) or an int in [1, micro_batch_size="
                      f"{b.micro_batch_size}] (streams per micro-batch; BatchConfig's mini_batch_size / "
                      "gradient_accumulation_steps)")
    budget = sampling.response_length
    if c.rewards.overlong_buffer is not None and c.rewards.overlong_buffer > budget:
        raise ValueError(f"RewardConfig.overlong_buffer={c.rewards.overlong_buffer} is longer than the response "
                         f"budget (SamplingConfig.response_length={budget}); it must be in [1, {budget}] (None: a "
                         "fifth of the budget)")
    if c.environment.turn_length is not None and c.environment.turn_length > budget:
        raise ValueError(f"EnvironmentConfig.turn_length={c.environment.turn_length!r} is invalid: turn_length must "
                         f"be None (a turn may use the rest of the budget) or an int in [1, SamplingConfig."
                         f"response_length={budget}]")
    if c.rewards.mask_truncated_completions and not sampling.stop_tokens:
        raise ValueError("RewardConfig.mask_truncated_completions=True needs a stop token, and SamplingConfig."
                         "stop_tokens=() has none: without one every completion is truncated and nothing would be "
                         "trained")
    _check_pipelining(c)
    _check_context(c)
    if c.rewards.dynamic_sampling and b.num_generations < 2:
        raise ValueError(f"RewardConfig.dynamic_sampling=True needs groups: BatchConfig.num_generations="
                         f"{b.num_generations}; give num_generations >= 2 (a group's scores must be able to differ), "
                         "or turn dynamic sampling off")
    if c.layout.attention == "cudnn":
        from jaxppo.models.model import check_cudnn_dtype

        check_cudnn_dtype("LayoutConfig", c.layout.dtype)


def _check_context(c: Config) -> None:
    """A context axis splits each row's positions in the forward passes: the rows' length
    must divide by it, and the layouts that run a prompt once through a cache (which the
    axis does not split) are refused beside it."""
    n = c.layout.context_size
    if n == 1:
        return
    width = c.data.query_length + c.sampling.response_length
    if width % n:
        raise invalid("LayoutConfig", "mesh_context", n,
                      f"a divisor of the rows' length, DataConfig.query_length + SamplingConfig.response_length = "
                      f"{c.data.query_length} + {c.sampling.response_length} = {width} (each device holds an equal "
                      f"block of every row's positions); or make that length a multiple of {n}")
    if c.layout.pack_sequences and c.layout.pack_length is not None and c.layout.pack_length % n:
        raise invalid("LayoutConfig", "pack_length", c.layout.pack_length,
                      f"a multiple of LayoutConfig.mesh_context={n} (each packed stream's positions split over it)")
    for name, why in (("share_prompts", "runs each group's prompt once through a cache"),
                      ("common_prefix", "runs the prompts' common prefix once through a cache")):
        if getattr(c.layout, name) is True:
            raise invalid("LayoutConfig", name, True,
                          f"None or False with a context axis (mesh_context={n}): that layout {why}, whose positions "
                          "the context axis does not split")


def _check_pipelining(c: Config) -> None:
    """Sampling ahead of the update: the sampler's devices, in-flight updates."""
    sampling = c.sampling
    if c.layout.sampler_devices and not sampling.max_staleness:
        raise ValueError(f"LayoutConfig.sampler_devices={c.layout.sampler_devices} gives the sampler devices of its "
                         "own, which only pays when sampling overlaps training: set SamplingConfig.max_staleness >= 1, "
                         "or sampler_devices=0 (sampler and trainer share the devices)")
    if sampling.inflight_updates is None:
        return
    engine = inflight_missing(sampling.rollout_engine, sampling.num_slots)
    needs = [what for what, missing in (
        ("SamplingConfig.max_staleness >= 1", not sampling.max_staleness),
        (engine, engine is not None),
        ("RewardConfig.dynamic_sampling=False", c.rewards.dynamic_sampling)) if missing]
    if needs:
        raise ValueError(f"SamplingConfig.inflight_updates={sampling.inflight_updates!r} takes new parameters between "
                         f"the rollout engine's decode steps while the trainer updates; it needs {', '.join(needs)}")

