"""The flat configs of 0.4, kept for one release (removed in 0.6) with a `DeprecationWarning`
that names the new place of their settings: `PPOConfig` and `TrainerConfig` (every field
keeps its name, now in one concern of `jaxppo.Config`; the settings that said one thing
twice are translated by `jaxppo.config.renamed`, whose docstring lists them).

(The `Trainer` keywords that became settings, `dtype` or `optimizer` say, are translated by
the `Trainer`: `optimizer` is a concern's name here.)

`translate` turns settings by name, old spellings included, into the new names; the run
settings of a directory written by 0.4 are read through it too (`jaxppo.config.record`).
"""

from __future__ import annotations

import warnings
from typing import Optional

from jaxppo.config.renamed import OLD_DEFAULTS, translate
from jaxppo.config.settings import SETTINGS, Config

__all__ = ["PPOConfig", "TrainerConfig", "PPO_FIELDS", "TRAINER_FIELDS", "joined"]

# The flat configs' fields (0.4 and 0.5-dev), with the defaults their deprecated names had.
PPO_FIELDS = (
    "batch_size", "mini_batch_size", "ppo_epochs", "gradient_accumulation_steps", "cliprange", "cliprange_value",
    "vf_coef", "ent_coef", "gamma", "lam", "whiten_advantages", "whiten_rewards", "temperature", "target_kl", "kl_coef",
    "advantage_estimator", "num_generations", "grpo_scale", "grpo_eps", "loss_aggregation", "cliprange_low",
    "cliprange_high", "dual_clip", "importance_ratio", "kl_loss_coef", "kl_loss_estimator", "rollout_correction",
    "rollout_correction_cap", "top_entropy_quantile", "overlong_penalty_factor", "overlong_buffer",
    "mask_truncated_completions", "entropy_target", "entropy_coef_step", "loss_norm_length", "kl_loss_bias_correction",
    "share_prompts", "common_prefix", "pack_sequences", "pack_streams", "pack_length")
TRAINER_FIELDS = (
    "seed", "iterations", "total_episodes", "query_length", "response_length", "truncate_prompts", "overlong_prompts",
    "stream_prompts", "kl_estimator", "kl_target", "kl_horizon", "missing_eos_penalty", "normalize_scores",
    "score_clip", "stop_token_id", "stop_token_ids", "stop_strings", "top_k", "top_p", "min_p", "repetition_penalty",
    "learning_rate", "critic_learning_rate", "lr_schedule", "warmup_updates", "max_grad_norm", "adam_eps",
    "adam_beta1", "adam_beta2", "weight_decay", "weight_decay_mask", "min_lr_ratio", "warmup_ratio", "shared_trunk",
    "output_dir", "log_every", "sample_every", "num_samples", "checkpoint_every", "keep_checkpoints", "resume",
    "resume_from", "report_to", "tensorboard", "progress", "export_final", "plot", "save_hf_every", "keep_hf",
    "best_metric", "best_metric_mode", "skip_nonfinite_scores", "eval_every", "eval_before_training",
    "eval_generations", "eval_temperature", "num_slots", "max_turns", "turn_length", "turn_cache",
    "environment_timeout", "environment_errors", "environment_workers", "dynamic_sampling", "dynamic_sampling_rounds",
    "rollout_engine", "attention", "hoist_layers", "old_logprobs", "max_staleness", "sampler_devices",
    "inflight_updates", "inflight_steps")

class _Flat:
    """A 0.4 flat config: the settings given by their flat names, read back by the same names,
    and the `jaxppo.Config` they make (`.config`), to which everything else is handed on."""

    _FIELDS: tuple = ()
    _NEW = "jaxppo.Config"

    def __init__(self, **settings):
        unknown = sorted(set(settings) - set(self._FIELDS))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {unknown} (deprecated: "
                            f"{self._NEW} takes every setting, by concern)")
        named = translate({k: v for k, v in settings.items() if k != "total_episodes"})  # it needs the batch size
        places = sorted({SETTINGS[n] for n in named if n in SETTINGS} | ({"run"} if "total_episodes" in settings else set()))
        warnings.warn(f"jaxppo.{type(self).__name__} is deprecated since 0.5 and will be removed in 0.6: use "
                      f"jaxppo.Config, whose concerns hold these settings under the same names ("
                      f"{', '.join(f'Config.{p}' for p in places) or 'its defaults'}); "
                      "jaxppo.Config.from_settings(...) takes the same keywords", DeprecationWarning, stacklevel=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # warned once, above
            object.__setattr__(self, "_given", dict(settings))
            object.__setattr__(self, "config", self._make(settings))

    @classmethod
    def _make(cls, settings):
        return Config.from_settings(settings)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        given = object.__getattribute__(self, "_given")
        if name in OLD_DEFAULTS and name in self._FIELDS:
            return given.get(name, OLD_DEFAULTS[name])
        config = object.__getattribute__(self, "config")
        if name in SETTINGS:
            return getattr(getattr(config, SETTINGS[name]), name)
        for owner in (config, config.batch, config.loss, config.run):  # derived values: counts, clip_low, trackers
            if hasattr(owner, name):
                return getattr(owner, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is frozen")

    def __eq__(self, other):
        return type(other) is type(self) and other.config == self.config

    def __hash__(self):
        return hash((type(self).__name__, self.config))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def replace(self, **changes):
        """A copy with `changes` applied (validated again)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return type(self)(**{**self._given, **changes})

    @property
    def engine(self):
        """0.4's engine config: the `jaxppo.BatchConfig`."""
        return self.config.batch


class PPOConfig(_Flat):
    """Deprecated since 0.5 (removed in 0.6): `jaxppo.Config`. 0.4's flat config of the
    update: the same keywords, each now in its concern (`Config.from_settings` takes them
    as they are); accepted wherever a `Config` is (`train_step`, `Trainer`)."""

    _FIELDS = PPO_FIELDS

    @classmethod
    def for_algorithm(cls, name: str, **overrides) -> "PPOConfig":
        """A config with the defaults of algorithm `name`, then `overrides`."""
        from jaxppo.algorithms import algorithm_defaults

        return cls(**{**algorithm_defaults(name), **overrides})

    @property
    def update(self):
        return self.config.update


class TrainerConfig(_Flat):
    """Deprecated since 0.5 (removed in 0.6): `jaxppo.Config`. 0.4's flat config of the loop
    around the update: the same keywords, each now in its concern."""

    _FIELDS = TRAINER_FIELDS

    @classmethod
    def _make(cls, settings):
        # total_episodes needs the batch size, which a TrainerConfig does not hold: it is
        # checked and turned into iterations when the trainer joins the two.
        return Config.from_settings({k: v for k, v in settings.items() if k != "total_episodes"})

    @property
    def overlong(self) -> str:
        return self.config.data.overlong_prompts


def joined(ppo: Optional[PPOConfig], trainer: Optional[TrainerConfig]):
    """The `jaxppo.Config` of a 0.4 pair (`Trainer(ppo_config, trainer_config, ...)`)."""
    settings = {**(ppo._given if ppo is not None else {}), **(trainer._given if trainer is not None else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # each config warned when it was built
        return Config.from_settings(settings)
