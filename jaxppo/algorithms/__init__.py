"""The algorithms, as values, and their registry.

Each algorithm is an advantage estimator plus a loss on the same compiled engine. An
`AdvantageEstimator` says how advantages (and a critic's returns) come from a rollout,
whether it needs a critic, how many completions per prompt it compares and which metrics
it adds; an `Algorithm` preset holds the settings that define a published method and where
they come from. `jaxppo.Config` validates its estimator against this registry, and the
command line, the demo and the docs read it.

    jaxppo.Config.for_algorithm("grpo", batch_size=64, mini_batch_size=16)
    jaxppo --algorithm dapo --cliprange-high 0.3 ...

Adding an estimator: one file in this package defining an `AdvantageEstimator`, and one row
in `ESTIMATORS` below (and a preset row in `presets.py` if it is a named method); or, from
your own code at run time, `register_estimator(estimator)`.
"""

from __future__ import annotations

from jaxppo.algorithms import distill, gae, grpo, reinforce_pp, rloo
from jaxppo.algorithms.base import Advantages, AdvantageEstimator, Algorithm, loss_terms, sequence_scores
from jaxppo.algorithms.presets import PRESETS

__all__ = ["ESTIMATORS", "REGISTRY", "ALGORITHMS", "Advantages", "AdvantageEstimator", "Algorithm",
           "algorithm_defaults", "get_algorithm", "get_estimator", "loss_terms", "register_estimator",
           "sequence_scores"]

# The advantage estimators by `AdvantageConfig.advantage_estimator`.
ESTIMATORS = {e.name: e for e in (
    gae.ESTIMATOR,
    grpo.ESTIMATOR,
    rloo.ESTIMATOR,
    reinforce_pp.ESTIMATOR,
    reinforce_pp.BASELINE,
    distill.ESTIMATOR,
)}

_BUILT_IN = tuple(ESTIMATORS)

# The named methods (presets) by name, with their sources.
REGISTRY = {a.name: a for a in PRESETS}

# {name: the settings it sets, by name} (a read-only view of the presets' settings).
ALGORITHMS = {name: dict(a.settings) for name, a in REGISTRY.items()}


def register_estimator(estimator: AdvantageEstimator, *, replace: bool = False) -> AdvantageEstimator:
    """Add `estimator` to the registry at run time, so that `AdvantageConfig(advantage_estimator=
    estimator.name)` validates in a `jaxppo.Config` and `train_step` uses it. A name already registered is
    refused unless `replace` (a built-in one cannot be replaced). Register before building
    configs that name it, in every process (and before resuming a run that used it)."""
    if not isinstance(estimator, AdvantageEstimator):
        raise TypeError(f"register_estimator takes a jaxppo.algorithms.AdvantageEstimator, got "
                        f"{type(estimator).__name__}")
    if not isinstance(estimator.name, str) or not estimator.name or not callable(estimator.compute):
        raise ValueError(f"AdvantageEstimator needs a non-empty name and a callable compute; got name="
                         f"{estimator.name!r}, compute={estimator.compute!r}")
    if estimator.name in _BUILT_IN:
        raise ValueError(f"advantage estimator {estimator.name!r} is built in and cannot be replaced; choose "
                         f"another name (built in: {', '.join(_BUILT_IN)})")
    if estimator.name in ESTIMATORS and not replace:
        raise ValueError(f"advantage estimator {estimator.name!r} is already registered; pass replace=True to "
                         "replace it")
    ESTIMATORS[estimator.name] = estimator
    return estimator


def get_estimator(name: str) -> AdvantageEstimator:
    """The `AdvantageEstimator` called `name`; ValueError listing the valid names."""
    if name not in ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is unknown; valid: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def get_algorithm(name: str) -> Algorithm:
    """The `Algorithm` preset called `name`; ValueError listing the valid names."""
    if name not in REGISTRY:
        raise ValueError(f"algorithm {name!r} is unknown; valid: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def algorithm_defaults(name: str) -> dict:
    """The settings (by name) that algorithm `name` sets (a copy)."""
    return dict(get_algorithm(name).settings)
