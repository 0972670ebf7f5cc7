"""Deprecated since 0.5 (removed in 0.6): the forward pass that builds a rollout (its
log-probs, the reference's, values and scores) is `jaxppo.rollout.forward` ("scoring" now
names only the reward stage)."""

import warnings

from jaxppo.rollout.forward import finish_rollout  # noqa: F401

warnings.warn("jaxppo.rollout.scoring is deprecated since 0.5 and will be removed in 0.6: import "
              "jaxppo.rollout.forward (finish_rollout)", DeprecationWarning, stacklevel=2)
