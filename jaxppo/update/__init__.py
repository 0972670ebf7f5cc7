"""The update: everything between a rollout and new parameters, knowing nothing of where
the rollout came from.

- `stats`: masked sums, means, variances, whitening, quantiles, running moments;
- `kl`: KL estimators, KL-shaped rewards, the KL controller;
- `advantages`: GAE, GRPO's, RLOO's and REINFORCE++'s advantages;
- `losses`: log-probs and entropies from logits, importance ratios, the clipped policy
  and value losses, the loss aggregation modes;
- `correction`: the sampler-mismatch correction; `shaping`: overlong punishment, the
  high-entropy token mask, the adaptive entropy coefficient;
- `minibatches`: the model-agnostic mini-batch loop (`BatchConfig`, `TrainState`,
  `update_epochs`; 0.4's `engine`);
- `batch`: the `RolloutBatch` pytree and the forward that scores its responses;
  `packing`: packed sequences; `prefix`: the common-prefix layout;
- `objective`: every algorithm's loss (`total_loss`) and what it reads (`Objective`, a
  `jaxppo.Config`'s view); `ppo`: `train_step` and what it reads (`UpdateConfig`: the batch,
  the objective and an advantage function; a `jaxppo.Config` hands over its `.update`);
  `checks`: the value checks the configs share.

Each function lives in its module (`jaxppo.update.advantages.gae`, ...); this namespace
holds the modules and the names a caller of `train_step` and `update_epochs` works with.
"""

from jaxppo.update import advantages, correction, kl, losses, packing, shaping, stats
from jaxppo.update.batch import RolloutBatch, response_outputs
from jaxppo.update.minibatches import (BatchConfig, EngineConfig, Freeze, TrainState, minibatch_indices,  # noqa: F401
                                       update_epochs, update_epochs_fn)
from jaxppo.update.objective import Objective, total_loss
from jaxppo.update.ppo import UpdateConfig, check_rollout, compute_advantages, train_step, train_step_fn

__all__ = ["advantages", "correction", "kl", "losses", "packing", "shaping", "stats", "BatchConfig", "Freeze",
           "TrainState", "minibatch_indices", "update_epochs", "update_epochs_fn", "RolloutBatch", "response_outputs",
           "Objective", "total_loss", "UpdateConfig", "check_rollout", "compute_advantages", "train_step",
           "train_step_fn"]


def __getattr__(name: str):  # the names moved in 0.5, with a DeprecationWarning
    from jaxppo.deprecations import moved

    return moved(__name__, name)
