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
- `batch`: the `Rollout` pytree and the forward that scores its responses;
  `packing`: packed sequences;
- `ppo`: every algorithm's loss and `train_step` (it reads `PPOConfig`, which validates
  against `jaxppo.algorithms`, which reads the math above: import it as
  `jaxppo.update.ppo`, or take `jaxppo.train_step`).

This namespace holds every pure math function of those modules under one name (what
`jaxppo.math` was: `from jaxppo import update; update.gae(...)`), the engine and the batch.
"""

from jaxppo.update import advantages, correction, kl, losses, shaping, stats
from jaxppo.update.advantages import *  # noqa: F401,F403
from jaxppo.update.batch import Rollout, response_outputs
from jaxppo.update.correction import *  # noqa: F401,F403
from jaxppo.update.engine import EngineConfig, Freeze, TrainState, minibatch_indices, update_epochs, update_epochs_fn
from jaxppo.update.kl import *  # noqa: F401,F403
from jaxppo.update.losses import *  # noqa: F401,F403
from jaxppo.update.shaping import *  # noqa: F401,F403
from jaxppo.update.stats import *  # noqa: F401,F403

MATH = [*stats.__all__, *kl.__all__, *advantages.__all__, *losses.__all__, *correction.__all__, *shaping.__all__]

__all__ = [*MATH, "EngineConfig", "Freeze", "TrainState", "minibatch_indices", "update_epochs", "update_epochs_fn",
           "Rollout", "response_outputs"]
