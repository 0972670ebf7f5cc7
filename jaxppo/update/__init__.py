"""The update: everything between a rollout and new parameters, knowing nothing of where
the rollout came from.

- `stats`: masked sums, means, variances, whitening, quantiles, running moments;
- `kl`: KL estimators, KL-shaped rewards, the KL controller;
- `advantages`: GAE, GRPO's, RLOO's and REINFORCE++'s advantages;
- `losses`: log-probs and entropies from logits, importance ratios, the clipped policy
  and value losses, the loss aggregation modes;
- `correction`: the sampler-mismatch correction; `shaping`: overlong punishment, the
  high-entropy token mask, the adaptive entropy coefficient;
- `engine`: the model-agnostic compiled loop (`TrainState`, `update_epochs`);
- `batch`: the `RolloutBatch` pytree and the forward that scores its responses;
  `packing`: packed sequences;
- `objective`: every algorithm's loss (`ppo_loss`) and what it reads (`LossConfig`);
  `ppo`: `train_step` and what it reads (`UpdateConfig`: the engine's and the loss's
  configs and an advantage function; a `jaxppo.PPOConfig` hands over its `.update`);
  `checks`: the value checks the configs share. Import them as `jaxppo.update.ppo`, ...,
  or take `jaxppo.train_step`.

Each function lives in its module (`jaxppo.update.advantages.gae`,
`jaxppo.update.stats.masked_whiten`, ...); this namespace holds the modules, the engine and
the batch.
"""

from jaxppo.update import advantages, correction, kl, losses, shaping, stats
from jaxppo.update.batch import RolloutBatch, response_outputs
from jaxppo.update.engine import EngineConfig, Freeze, TrainState, minibatch_indices, update_epochs, update_epochs_fn

__all__ = ["advantages", "correction", "kl", "losses", "shaping", "stats", "EngineConfig", "Freeze", "TrainState",
           "minibatch_indices", "update_epochs", "update_epochs_fn", "RolloutBatch", "response_outputs"]


def __getattr__(name: str):  # the names renamed in 0.5, with a DeprecationWarning
    from jaxppo.update.batch import renamed

    return renamed(__name__, name)
