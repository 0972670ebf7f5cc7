"""Deprecated since 0.5 (removed in 0.6): the mini-batch loop is `jaxppo.update.minibatches`
("engine" now names only the rollout engines, `jaxppo.rollout.engines`)."""

import warnings

from jaxppo.update.minibatches import *  # noqa: F401,F403
from jaxppo.update.minibatches import __all__  # noqa: F401

warnings.warn("jaxppo.update.engine is deprecated since 0.5 and will be removed in 0.6: import "
              "jaxppo.update.minibatches (the same names; EngineConfig is BatchConfig)", DeprecationWarning,
              stacklevel=2)
