"""The public names that moved or were renamed, each with its new path, served for one release
with a `DeprecationWarning` (as optax keeps its table of deprecations): a module's
`__getattr__` asks `moved(module, name)`. Removed in the release the table says.

`PPOConfig`, `TrainerConfig`, `EngineConfig` and `PPOTrainer` are not here: they stay
importable from `jaxppo` and warn when they are used (`jaxppo.config.legacy`,
`jaxppo.update.minibatches.EngineConfig`, `jaxppo.run.trainer.PPOTrainer`).
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["MOVED", "moved"]

_UPDATE = {name: f"jaxppo.update:{name}" for name in (
    "UpdateConfig", "Freeze", "response_outputs", "update_epochs", "update_epochs_fn", "minibatch_indices",
    "train_step_fn", "compute_advantages", "check_rollout", "packing")}
_ROLLOUT = {name: f"jaxppo.rollout:{name}" for name in (
    "generate", "load_prompts", "mix_prompts", "PromptStreamEnded", "RolloutSpec", "sample_responses",
    "finish_rollout")}

# {module: {old name: "new.module:name"}}; each removed in 0.6.
MOVED = {
    "jaxppo": {**_UPDATE, **_ROLLOUT, "GenerationOutput": "jaxppo.models:GenerationOutput",
               "ppo_loss": "jaxppo.update:total_loss",
               "RunState": "jaxppo.run:RunState", "Rollout": "jaxppo:RolloutBatch"},
    "jaxppo.update": {"Rollout": "jaxppo.update:RolloutBatch", "ppo_loss": "jaxppo.update:total_loss"},
    "jaxppo.update.batch": {"Rollout": "jaxppo.update.batch:RolloutBatch"},
    "jaxppo.update.ppo": {"Rollout": "jaxppo.update.ppo:RolloutBatch", "ppo_loss": "jaxppo.update:total_loss"},
}


def moved(module: str, name: str):
    """The object `module.name` stands for now, with a `DeprecationWarning` naming its new
    path; `AttributeError` for a name the table does not hold."""
    target = MOVED.get(module, {}).get(name)
    if target is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    path, attribute = target.split(":")
    new = f"{path}.{attribute}"
    warnings.warn(f"{module}.{name} is deprecated since jaxppo 0.5 and will be removed in 0.6: use {new}"
                  + (" (the same object)" if attribute == name or name == "Rollout" else ""),
                  DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(path), attribute)
