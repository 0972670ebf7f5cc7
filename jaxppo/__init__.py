"""jaxppo: PPO for language models (RLHF) and its critic-free relatives (GRPO, Dr. GRPO,
DAPO, RLOO, REINFORCE++, GSPO) in JAX/Flax, with a compiled, shape-checked update loop.

Layers (each imports only those below it; docs/architecture.md): statistics -> math ->
algorithms (the registry) -> config -> engine -> models -> rollout -> update (ppo) ->
the run (RunState, stages) -> the loop (Trainer). The update loop (`train_step`, `update_epochs`) is one compiled
program in which the number of mini-batch updates is part of the shape.
"""

from jaxppo.version import __version__  # noqa: F401
from jaxppo import math
from jaxppo.config import PPOConfig
from jaxppo.engine import Freeze, TrainState, minibatch_indices, update_epochs, update_epochs_fn
from jaxppo.rollout_types import Rollout, response_outputs
from jaxppo.ppo import check_rollout, compute_advantages, ppo_loss, train_step, train_step_fn
from jaxppo import algorithms, models, packing
from jaxppo.models import GenerationOutput, generate
from jaxppo.rollout import RolloutSpec, finish_rollout, sample_responses
from jaxppo.run_state import RunState
from jaxppo.trainer import PPOTrainer, RewardError, RunError, Trainer, TrainerConfig, load_prompts
from jaxppo.environments import EpisodeError, StepResult


__all__ = [
    "PPOConfig",
    "TrainState",
    "Freeze",
    "Rollout",
    "response_outputs",
    "update_epochs",
    "update_epochs_fn",
    "minibatch_indices",
    "train_step",
    "train_step_fn",
    "compute_advantages",
    "check_rollout",
    "ppo_loss",
    "math",
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
    "RunError",
    "RewardError",
    "RolloutSpec",
    "sample_responses",
    "finish_rollout",
    "StepResult",
    "EpisodeError",
]
