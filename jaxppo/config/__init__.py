"""The settings of a run, each in the one config its concern names, and `Config`, which
composes them (`jaxppo.config.settings`):

    algorithm   BatchConfig (the batch and the mini-batch loop), AdvantageConfig, LossConfig,
                KLConfig, RewardConfig                      (jaxppo.config.algorithm)
    sampling    SamplingConfig, EnvironmentConfig           (jaxppo.config.sampling)
    optimizer   OptimizerConfig, and the optimizer it builds (jaxppo.config.optimizer)
    lora        AdapterConfig: which weights train               (jaxppo.config.adapters)
    layout      LayoutConfig                                 (jaxppo.config.layout)
    run         RunConfig, DataConfig, EvalConfig            (jaxppo.config.run)

and a reward-model run's `RewardModelConfig`, made of the same concerns and its own
`PairConfig` (jaxppo.config.reward_model).

Each validates its own fields when it is built; `Config` checks the rules that span two
(`check_config`). What a resumed run must match is `jaxppo.config.record`'s. The flat
`PPOConfig` and `TrainerConfig` of 0.4 still work, deprecated (`jaxppo.config.legacy`).
"""

from jaxppo.config.adapters import AdapterConfig
from jaxppo.config.algorithm import AdvantageConfig, KLConfig, LossConfig, RewardConfig
from jaxppo.config.fields import setting
from jaxppo.config.layout import LayoutConfig
from jaxppo.config.legacy import PPOConfig, TrainerConfig
from jaxppo.config.optimizer import OptimizerConfig, build_optimizer
from jaxppo.config.reward_model import PairConfig, RewardModelConfig
from jaxppo.config.run import DataConfig, EvalConfig, RunConfig
from jaxppo.config.sampling import EnvironmentConfig, SamplingConfig
from jaxppo.config.settings import CONCERNS, SETTINGS, Config, check_config
from jaxppo.update.minibatches import BatchConfig

__all__ = ["Config", "BatchConfig", "AdvantageConfig", "LossConfig", "KLConfig", "RewardConfig", "SamplingConfig",
           "EnvironmentConfig", "OptimizerConfig", "AdapterConfig", "LayoutConfig", "DataConfig", "EvalConfig", "RunConfig", "CONCERNS",
           "SETTINGS", "check_config", "build_optimizer", "setting", "PPOConfig", "TrainerConfig", "RewardModelConfig",
           "PairConfig"]
