"""jaxppo: PPO for language models (RLHF) and its critic-free relatives (GRPO, Dr. GRPO,
DAPO, RLOO, REINFORCE++, GSPO) in JAX/Flax, with a compiled, shape-checked update loop.

The package in layers, as optax's is: this namespace holds the user's entry points (the
`Trainer`, the settings `Config` and its concerns, `train_step` with the `TrainState` and
`RolloutBatch` it takes, the algorithm registry `algorithms`, callbacks, the environments'
`StepResult`, the errors); the rest lives in its subpackage: `update` (the math, the
mini-batch loop, the loss, `train_step`'s pieces), `models` (the built-in transformers,
LoRA, Hugging Face import and export), `rollout` (prompts, sampling, rewards, the forward
pass, environments), `run` (the trainer's parts). Each part imports only those below it
(docs/architecture.md). Importing jaxppo starts no optional backend (vLLM's engine loads
when it is named).
"""

import warnings as _warnings

import jax as _jax

from jaxppo import algorithms, models, update
from jaxppo.config import (AdapterConfig, AdvantageConfig, BatchConfig, Config, DataConfig, EnvironmentConfig,
                           EvalConfig, KLConfig, LayoutConfig, LossConfig, OptimizerConfig, RewardConfig, RunConfig,
                           SamplingConfig)
from jaxppo.config.legacy import PPOConfig, TrainerConfig  # noqa: F401  deprecated: they warn when built
from jaxppo.errors import EpisodeError, RewardError, RunError, ToolCallError
from jaxppo.rollout.environments import StepResult
from jaxppo.run.callbacks import Callback, Control
from jaxppo.config.reward_model import RewardModelConfig
from jaxppo.run.reward_model import RewardTrainer
from jaxppo.run.trainer import PPOTrainer, Trainer  # noqa: F401  PPOTrainer: deprecated, warns when called
from jaxppo.update.batch import RolloutBatch
from jaxppo.update.minibatches import EngineConfig, TrainState  # noqa: F401  EngineConfig: deprecated, warns
from jaxppo.update.ppo import train_step
from jaxppo.version import UntestedJaxWarning, __version__, untested_jax  # noqa: F401

_untested = untested_jax(_jax.__version__)
if _untested:
    _warnings.warn(_untested, UntestedJaxWarning, stacklevel=2)

__all__ = [
    "Trainer",
    "Config",
    "BatchConfig",
    "AdvantageConfig",
    "LossConfig",
    "KLConfig",
    "RewardConfig",
    "SamplingConfig",
    "EnvironmentConfig",
    "OptimizerConfig",
    "AdapterConfig",
    "LayoutConfig",
    "DataConfig",
    "EvalConfig",
    "RunConfig",
    "RewardTrainer",
    "RewardModelConfig",
    "train_step",
    "TrainState",
    "RolloutBatch",
    "algorithms",
    "models",
    "update",
    "Callback",
    "Control",
    "StepResult",
    "RunError",
    "RewardError",
    "EpisodeError",
    "ToolCallError",
]


def __getattr__(name: str):  # the names moved in 0.5, with a DeprecationWarning naming the new path
    from jaxppo.deprecations import moved

    return moved(__name__, name)
