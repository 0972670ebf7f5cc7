"""`jaxppo.RewardModelConfig`: the settings of a reward-model run (`jaxppo.RewardTrainer`),
composed of the concerns a policy's run has (the batch, the optimizer, LoRA, the layout,
the run) and one of its own (`PairConfig`: the preference pairs and the loss).

    config = jaxppo.RewardModelConfig.from_settings(batch_size=32, mini_batch_size=8,
                                                    eval_fraction=0.1, lora_rank=16)
    config.batch.batch_size, config.pairs.epochs, config.run.output_dir

A setting has the name, flag and `--config` key it has in `jaxppo.Config`; a reward-model
run reads a part of each shared concern (`READS`), and a setting it would not read, changed
from its default, is refused rather than ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Mapping, Optional

from jaxppo.config.adapters import AdapterConfig
from jaxppo.config.fields import Concern, check_choice, check_counts, check_optional_real, check_real, is_free
from jaxppo.config.layout import LayoutConfig
from jaxppo.config.optimizer import OptimizerConfig
from jaxppo.config.run import RunConfig
from jaxppo.update.checks import invalid, is_int
from jaxppo.update.minibatches import BatchConfig

__all__ = ["RewardModelConfig", "PairConfig", "REWARD_CONCERNS", "READS", "REWARD_OPTIMIZER", "REWARD_RUN",
           "REWARD_BATCH", "EXPORT_DIR"]

# TRL 1.12's RewardConfig optimizer defaults (TrainingArguments': AdamW, linear decay,
# epsilon 1e-8, gradient clipping at 1.0; RewardConfig's learning rate 1e-4).
REWARD_OPTIMIZER = OptimizerConfig(learning_rate=1e-4, lr_schedule="linear", adam_eps=1e-8, max_grad_norm=1.0)
REWARD_BATCH = BatchConfig(batch_size=32, mini_batch_size=8, ppo_epochs=1)
REWARD_RUN = RunConfig(output_dir="runs/reward_model", checkpoint_every=10, report_to="jsonl")
EXPORT_DIR = "reward_model"  # under output_dir: the trained model, a ...ForSequenceClassification directory


@dataclasses.dataclass(frozen=True)
class PairConfig(Concern):
    """The preference pairs and the loss on them.

    Attributes:
      epochs: passes over the training pairs (> 0; a fraction allowed); the run has
        `ceil(epochs * pairs / batch_size)` steps.
      max_length: the longest sequence (tokens) a pair may have; None: no limit.
      overlong_pairs: "error" (a pair past `max_length` stops the run before it starts,
        naming it) or "drop" (such pairs are left out and counted, TRL's filter).
      eval_fraction: the share of the pairs held out for evaluation, in [0, 1) (chosen by
        the seed); 0 with no `eval_pairs`: no evaluation.
      eval_every: evaluate on the held-out pairs every this many steps (and after the
        last); 0: after the last only.
      center_rewards_coefficient: None, or >= 0: add this times mean((r_c + r_r)^2) to the
        loss (TRL's; 0.01 is its recommendation).
    """

    epochs: float = 1.0
    max_length: Optional[int] = 1024
    overlong_pairs: str = "error"
    eval_fraction: float = 0.0
    eval_every: int = 0
    center_rewards_coefficient: Optional[float] = None

    def __post_init__(self):
        check_real(self, "epochs", 0, low_open=True, note=" (passes over the training pairs)")
        if self.max_length is not None and not (is_int(self.max_length) and self.max_length > 0):
            raise invalid("PairConfig", "max_length", self.max_length, "None or a positive int (tokens)")
        check_choice(self, "overlong_pairs", ("error", "drop"))
        check_real(self, "eval_fraction", 0, 1, high_open=True)
        check_counts(self, ("eval_every",), least=0)
        check_optional_real(self, "center_rewards_coefficient", 0, none="None (0.01 is TRL's recommendation)")


# The concerns of a reward-model run, by name (as `jaxppo.Config`'s), and of the shared ones
# the settings the run reads; the others keep their defaults.
REWARD_CONCERNS = {"batch": BatchConfig, "pairs": PairConfig, "optimizer": OptimizerConfig, "lora": AdapterConfig,
                   "layout": LayoutConfig, "run": RunConfig}
READS = {"batch": ("batch_size", "mini_batch_size", "gradient_accumulation_steps"),
         "pairs": PairConfig.names(),
         "optimizer": tuple(f.name for f in dataclasses.fields(OptimizerConfig) if f.name != "critic_learning_rate"),
         "lora": ("lora_rank", "lora_alpha", "lora_targets"),
         "layout": ("dtype",),
         "run": ("seed", "output_dir", "log_every", "checkpoint_every", "keep_checkpoints", "resume", "resume_from",
                 "report_to", "progress", "plot")}
SETTINGS = {name: concern for concern in REWARD_CONCERNS for name in READS[concern]}
_NAMES = {name: concern for concern, cls in REWARD_CONCERNS.items() for name in cls.names()}  # read or not
_WHAT_ELSE = {"batch": "a step is one pass over its pairs", "layout": "reward models load in `dtype`",
              "run": "the run's length is PairConfig.epochs; it exports the reward model, not a policy",
              "lora": "the reward model starts from its own checkpoint"}


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """The settings of a reward-model run, by concern:

      batch: `jaxppo.BatchConfig`: `batch_size` pairs per step (one compiled call of the
        mini-batch loop), `mini_batch_size` pairs per optimizer update (TRL's per-device
        batch size times its accumulation steps), `gradient_accumulation_steps`.
      pairs: `jaxppo.config.PairConfig`: epochs, lengths, the held-out share, the loss's centring.
      optimizer: `jaxppo.OptimizerConfig` (default `REWARD_OPTIMIZER`, TRL's).
      lora: `jaxppo.AdapterConfig`: `lora_rank` > 0 trains adapters and the score head only.
      layout: `jaxppo.LayoutConfig`: `dtype`, the compute dtype (parameters stay float32,
        in `dtype` for a LoRA base).
      run: `jaxppo.RunConfig`: the seed (the pair order, the held-out split, a new score
        head and LoRA's A matrices), the run directory, checkpoints (`checkpoint_every`
        steps), trackers, resume.

    `from_settings` takes settings by name, as the command's flags and `--config` files do.
    """

    batch: BatchConfig = REWARD_BATCH
    pairs: PairConfig = dataclasses.field(default_factory=PairConfig)
    optimizer: OptimizerConfig = REWARD_OPTIMIZER
    lora: AdapterConfig = dataclasses.field(default_factory=AdapterConfig)
    layout: LayoutConfig = dataclasses.field(default_factory=LayoutConfig)
    run: RunConfig = REWARD_RUN

    def __post_init__(self):
        defaults = {"batch": REWARD_BATCH, "optimizer": REWARD_OPTIMIZER, "run": REWARD_RUN}
        for concern, cls in REWARD_CONCERNS.items():
            value = getattr(self, concern)
            if isinstance(value, Mapping):  # a --config file's table
                value = dataclasses.replace(defaults.get(concern) or cls(), **value)
                object.__setattr__(self, concern, value)
            if not isinstance(value, cls):
                raise TypeError(f"RewardModelConfig.{concern} must be a {cls.__name__} (or a dict of its "
                                f"settings), got {type(value).__name__}")
            base = defaults.get(concern) or cls()
            for name in cls.names():
                if name not in READS[concern] and getattr(value, name) != getattr(base, name):
                    raise ValueError(f"{cls.__name__}.{name}={getattr(value, name)!r} is not a setting of a reward-model "
                                     f"run ({_WHAT_ELSE.get(concern, 'it does not read it')}); leave it at "
                                     f"{getattr(base, name)!r}. It reads: {', '.join(READS[concern])}")

    @classmethod
    def from_settings(cls, settings: Optional[Mapping] = None, /, **more) -> "RewardModelConfig":
        """A config from settings by name (`jaxppo.Config`'s names; a concern's name with a
        dict or config sets that concern), over the defaults (TRL's); an unknown name is a
        `ValueError` naming the closest valid one."""
        given = {**(settings or {}), **more}
        unknown = [k for k in given if k not in _NAMES and k not in REWARD_CONCERNS]
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(SETTINGS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            moved = {"save_every": "checkpoint_every"}.get(unknown[0])  # its earlier name
            hint = f" (it is {moved!r} now)" if moved else hint
            raise ValueError(f"a reward-model run has no setting {unknown[0]!r}{hint}; its settings: "
                             f"{', '.join(SETTINGS)}")
        base = cls(**{k: v for k, v in given.items() if k in REWARD_CONCERNS})
        changes = {}
        for concern in REWARD_CONCERNS:
            mine = {k: v for k, v in given.items() if _NAMES.get(k) == concern}  # one not read: refused by the check
            if mine:
                changes[concern] = dataclasses.replace(getattr(base, concern), **mine)
        return dataclasses.replace(base, **changes)

    def replace(self, **settings) -> "RewardModelConfig":
        """A copy with settings changed by name (validated again)."""
        return self.from_settings({**{c: getattr(self, c) for c in REWARD_CONCERNS}, **settings})

    def settings(self, recorded: bool = False) -> dict:
        """The settings the run reads, by name, as JSON values (what the trackers get); with
        `recorded`, those a resumed run must match: the run's settings that may change on
        resume (its directory, cadences, trackers, progress bar, plot: `free` in
        `RunConfig`) left out, as in a policy run's record."""
        free = {f.name for f in dataclasses.fields(RunConfig) if is_free(f)} if recorded else set()
        out = {name: getattr(getattr(self, concern), name) for name, concern in SETTINGS.items() if name not in free}
        out.pop("transformation", None)
        return json.loads(json.dumps(out, default=str))
