"""jaxppo: PPO for language models (RLHF) and its critic-free relatives (GRPO, Dr. GRPO,
DAPO, RLOO, REINFORCE++, GSPO) in JAX/Flax, with a compiled, shape-checked update loop.

The package, from the bottom (each part imports only those before it; docs/architecture.md):
`update` (masked statistics, KL, advantages, losses, the engine, the `RolloutBatch`,
`train_step`), `algorithms` (the registry of advantage estimators and presets), `models`
(the built-in transformers, LoRA, Hugging Face import and export, the samplers), `config`
(`PPOConfig`, `TrainerConfig`), `rollout` (prompts, sampling, rewards, scoring,
environments, tools), `sharding` (meshes), and `run` (the `Trainer` and its stages).
The update loop (`train_step`, `update_epochs`) is one compiled program in which the number
of mini-batch updates is part of the shape.
"""

import warnings as _warnings

import jax as _jax

from jaxppo import algorithms, models, update
from jaxppo.config import PPOConfig
from jaxppo.errors import EpisodeError, RewardError, RunError, ToolCallError
from jaxppo.models import GenerationOutput
from jaxppo.rollout.samplers.static import generate
from jaxppo.rollout.environments import StepResult
from jaxppo.rollout.prompts import PromptStreamEnded, load_prompts, mix_prompts
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.rollout.scoring import finish_rollout
from jaxppo.run.callbacks import Callback, Control
from jaxppo.run.state import RunState
from jaxppo.run.trainer import PPOTrainer, Trainer
from jaxppo.trainer_config import TrainerConfig
from jaxppo.update import packing
from jaxppo.update.batch import RolloutBatch, response_outputs
from jaxppo.update.engine import EngineConfig, Freeze, TrainState, minibatch_indices, update_epochs, update_epochs_fn
from jaxppo.update.objective import LossConfig, ppo_loss
from jaxppo.update.ppo import UpdateConfig, check_rollout, compute_advantages, train_step, train_step_fn
from jaxppo.version import UntestedJaxWarning, __version__, untested_jax  # noqa: F401

_untested = untested_jax(_jax.__version__)
if _untested:
    _warnings.warn(_untested, UntestedJaxWarning, stacklevel=2)

__all__ = [
    "PPOConfig",
    "EngineConfig",
    "LossConfig",
    "UpdateConfig",
    "TrainState",
    "Freeze",
    "RolloutBatch",
    "response_outputs",
    "update_epochs",
    "update_epochs_fn",
    "minibatch_indices",
    "train_step",
    "train_step_fn",
    "compute_advantages",
    "check_rollout",
    "ppo_loss",
    "update",
    "algorithms",
    "models",
    "packing",
    "generate",
    "GenerationOutput",
    "Trainer",
    "PPOTrainer",
    "RunState",
    "TrainerConfig",
    "load_prompts",
    "mix_prompts",
    "PromptStreamEnded",
    "RunError",
    "RewardError",
    "EpisodeError",
    "ToolCallError",
    "RolloutSpec",
    "sample_responses",
    "finish_rollout",
    "StepResult",
    "Callback",
    "Control",
]



def __getattr__(name: str):  # the names renamed in 0.5, with a DeprecationWarning
    from jaxppo.update.batch import renamed

    return renamed(__name__, name)
