"""The rollout engines by name: the built-in ones ("jaxppo": static, or continuous with
`SamplingConfig.num_slots`), the package's optional ones (vLLM's, loaded when first named)
and those registered with `register_rollout_engine`; and the one place a run's settings are
checked against its engine's `Capabilities` (`check_settings`)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from jaxppo.models.decoding import GenerationOutput
from jaxppo.rollout.engines.base import Capabilities, RolloutEngine
from jaxppo.rollout.engines.continuous import ContinuousEngine
from jaxppo.rollout.engines.static import StaticEngine

__all__ = ["BUILT_IN", "ROLLOUT_ENGINES", "PACKAGED", "register_rollout_engine", "rollout_engine_names", "engine_class",
           "check_engine_name", "check_settings", "inflight_missing", "takes_server_urls", "sample_responses"]

BUILT_IN = "jaxppo"  # the built-in engines' name: static, or continuous with num_slots


# The engines by `SamplingConfig.rollout_engine`, besides the built-in ones ("jaxppo").
ROLLOUT_ENGINES: dict = {}
# The package's optional engines, by the module that registers each: imported the first time
# the name is asked for, so that importing jaxppo loads no optional backend.
PACKAGED = {"vllm": "jaxppo.rollout.engines.vllm.inprocess", "vllm-server": "jaxppo.rollout.engines.vllm.server"}


def register_rollout_engine(name: str, engine: type, *, replace: bool = False) -> type:
    """Make `engine` (a `RolloutEngine` subclass) the one `SamplingConfig(rollout_engine=
    name)` runs. A name already registered is refused unless `replace`; "jaxppo" cannot be
    taken. Register before building the `jaxppo.Config`, in every process (and before
    resuming a run that used it)."""
    if not (isinstance(engine, type) and issubclass(engine, RolloutEngine)):
        raise TypeError(f"register_rollout_engine takes a RolloutEngine subclass, got {engine!r}")
    if not isinstance(engine.capabilities, Capabilities):
        raise TypeError(f"{engine.__name__}.capabilities must be a jaxppo.rollout.engines.Capabilities, got "
                        f"{engine.capabilities!r}")
    if not isinstance(name, str) or not name or name == BUILT_IN:
        raise ValueError(f"rollout engine name {name!r} is invalid: a non-empty name other than {BUILT_IN!r} (the "
                         "built-in engines)")
    if name in ROLLOUT_ENGINES and not replace and ROLLOUT_ENGINES[name] is not engine:
        raise ValueError(f"rollout engine {name!r} is already registered ({ROLLOUT_ENGINES[name].__name__}); pass "
                         "replace=True to replace it")
    ROLLOUT_ENGINES[name] = engine
    return engine


def rollout_engine_names() -> Tuple[str, ...]:
    """The valid values of `SamplingConfig.rollout_engine`: "jaxppo", the package's
    optional engines and the registered ones."""
    return (BUILT_IN, *dict.fromkeys([*PACKAGED, *ROLLOUT_ENGINES]))


def takes_server_urls(name: str) -> bool:
    """The engine `name` samples on servers at `SamplingConfig.vllm_urls`."""
    return name == "vllm-server"


def check_engine_name(name: str, where: str) -> None:
    """A `ValueError` naming `where` (the setting) unless `name` is a rollout engine's."""
    if name not in rollout_engine_names():
        raise ValueError(f"{where}={name!r} is invalid; valid: {BUILT_IN!r} (the built-in engines), "
                         + ", ".join(map(repr, rollout_engine_names()[1:]))
                         + " (jaxppo.rollout.engines.register_rollout_engine adds one)")


def engine_class(name: str, num_slots: Optional[int] = None) -> type:
    """The engine class of `SamplingConfig.rollout_engine` `name`: for "jaxppo" the static
    engine, or the continuous one with `num_slots`."""
    if name == BUILT_IN:
        return StaticEngine if num_slots is None else ContinuousEngine
    if name not in ROLLOUT_ENGINES and name in PACKAGED:
        import importlib

        importlib.import_module(PACKAGED[name])  # registers it
    if name not in ROLLOUT_ENGINES:
        raise ValueError(f"rollout engine {name!r} is unknown; valid: {', '.join(map(repr, rollout_engine_names()))} "
                         "(jaxppo.rollout.engines.register_rollout_engine adds one)")
    return ROLLOUT_ENGINES[name]


def inflight_missing(name: str, num_slots: Optional[int]) -> Optional[str]:
    """What in-flight updates (`SamplingConfig.inflight_updates`) lack with the engine `name`
    (and `num_slots`), or None: the built-in engines take weights while they decode with
    `num_slots` (the continuous sampler); another engine where its capabilities say so."""
    if engine_class(name, num_slots).capabilities.inflight_updates:
        return None
    if name == BUILT_IN:
        return "SamplingConfig.num_slots (the continuous sampler)"
    return f"a rollout engine that takes weights while it decodes ({engine_class(name, num_slots).__name__} does not)"


def check_settings(config, *, multi_turn: bool, mesh, processes: int = 1) -> type:
    """The run's engine class (`config`: a `jaxppo.Config`), after refusing what it cannot do
    (its `capabilities`, then its own `check`), before anything starts."""
    sampling = config.sampling
    cls = engine_class(sampling.rollout_engine, sampling.num_slots)
    caps, name = cls.capabilities, f"rollout_engine={sampling.rollout_engine!r} ({cls.__name__})"
    needs = [("multi_turn", multi_turn, "multi-turn episodes (environment= or tools=)"),
             ("inflight_updates", bool(sampling.inflight_updates), f"inflight_updates={sampling.inflight_updates!r}"),
             ("meshes", mesh is not None or processes > 1 or bool(config.layout.sampler_devices),
              "a mesh, several processes or sampler_devices")]
    for capability, needed, what in needs:
        if needed and not getattr(caps, capability):
            raise ValueError(f"{name} cannot run {what}: the engine does not declare {capability} (its capabilities: "
                             f"{_declared(caps)}); use rollout_engine={BUILT_IN!r}, or leave that setting off")
    cls.check(config, multi_turn=multi_turn, mesh=mesh)
    return cls


def _declared(caps: Capabilities) -> str:
    return ", ".join(f.name for f in dataclasses.fields(caps) if getattr(caps, f.name)) or "none"


def sample_responses(spec, params, prompt_ids, prompt_mask, key) -> GenerationOutput:
    """Sample `spec.response_length` tokens per prompt from the policy in the train
    `params` with the built-in engine of `spec` (continuous with `spec.num_slots`, else
    static): compiled, returns without waiting for the device."""
    engine = engine_class(BUILT_IN, spec.num_slots)(spec)
    engine.set_weights(spec.policy_params(params), None)
    return engine.sample(prompt_ids, prompt_mask, key, num_generations=spec.num_generations,
                         response_length=spec.response_length)
