"""Deprecated since 0.5 (removed in 0.6): `RolloutSpec` is `jaxppo.rollout.spec.RolloutSpec`
(built with `RolloutSpec.from_config(config, ...)`); 0.4's `RolloutConfig` is gone: its
settings are `jaxppo.SamplingConfig`'s and `jaxppo.LayoutConfig`'s."""

import warnings

from jaxppo.rollout.spec import RolloutSpec  # noqa: F401

warnings.warn("jaxppo.rollout.sampling is deprecated since 0.5 and will be removed in 0.6: import "
              "jaxppo.rollout.spec (RolloutSpec); RolloutConfig's settings are SamplingConfig's and LayoutConfig's",
              DeprecationWarning, stacklevel=2)
