"""Rollout engines: what samples the policy's completions, behind one interface.

    engine = engine_class(name, num_slots).create(spec, params, config, query_width=Q, mesh=mesh)
    engine.set_weights(policy_params, version)       # take new weights
    gen = engine.sample(prompt_ids, prompt_mask, key, num_generations=G, response_length=R)
      # GenerationOutput: tokens, the behaviour policy's log-probs, mask; each (B, R)
    gen = engine.sample(..., temperature=0.0)      # an evaluation's own temperature (0: greedy)
    engine.close()

An engine declares what it can do (`Capabilities`); the trainer checks a run's settings
against them in one place (`check_settings`) before anything starts. The built-in engines
are `StaticEngine` (the static sampler, `jaxppo.rollout.samplers.static`) and
`ContinuousEngine` (continuous batching, `jaxppo.rollout.samplers.continuous`), both named
"jaxppo" (`SamplingConfig.num_slots` picks the continuous one); vLLM's is
`jaxppo.rollout.vllm.VLLMEngine` ("vllm", loaded when first named). An engine of your own is a subclass registered
by name (`register_rollout_engine`) and chosen with `SamplingConfig.rollout_engine`
(docs/architecture.md, "Adding a rollout engine").
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Optional, Tuple

import jax

from jaxppo.models.decoding import GenerationOutput
from jaxppo.rollout.samplers.continuous import generate_continuous, generate_inflight
from jaxppo.rollout.samplers.static import effective_prefix, generate, shares_prefix
from jaxppo.rollout.samplers.turns import first_turn, next_turn

__all__ = ["Capabilities", "RolloutEngine", "StaticEngine", "ContinuousEngine", "BUILT_IN", "ROLLOUT_ENGINES", "PACKAGED",
           "register_rollout_engine", "rollout_engine_names", "engine_class", "check_engine_name", "check_settings",
           "inflight_missing", "takes_server_urls",
           "sample_responses",
           "sampling_settings", "takes_temperature"]

BUILT_IN = "jaxppo"  # the built-in engines' name: static, or continuous with num_slots


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a rollout engine can do; the trainer refuses settings that need more, before
    anything starts.

    Attributes:
      continuous_batching: a row that ends frees its place for a waiting one (no effect on
        results; documentation and benchmarks).
      inflight_updates: takes new weights while it decodes (`RolloutEngine.sample_inflight`;
        `SamplingConfig.inflight_updates`).
      multi_turn: samples with a budget per row (`sample(..., max_lengths=...)`), which
        multi-turn episodes (an environment, tools) need.
      turn_cache: keeps each row's KV cache between turns (`first_turn`, `next_turn`;
        `EnvironmentConfig.turn_cache`); without it every turn samples its whole context again.
      meshes: samples from parameters sharded over a device mesh (a trainer with a mesh,
        several processes, or `sampler_devices`).
      exact_logprobs: its log-probs are the trainer's own forward's in float32 (the same
        code), so `old_logprobs="auto"` may take them as the old policy's.
    """

    continuous_batching: bool = False
    inflight_updates: bool = False
    multi_turn: bool = False
    turn_cache: bool = False
    meshes: bool = False
    exact_logprobs: bool = False


class RolloutEngine(abc.ABC):
    """The interface of a rollout engine. A subclass sets `capabilities` and implements
    `create`, `set_weights` and `sample` (and `close` when it holds resources;
    `sample_inflight` with `inflight_updates`; `first_turn` / `next_turn` with `turn_cache`).

    An engine is built once per run, after the models (`create`), from the `RolloutSpec`
    (`spec`: the policy `Model`, the sampling settings `temperature`, `top_k`, `top_p`,
    `min_p`, `repetition_penalty`, `stop_token_ids`, `stop_strings`, `pad_token_id`,
    `response_length`, `num_generations`; `RolloutSpec.sampling()`) and the train
    parameters. The
    trainer then calls, from one thread at a time, `set_weights` with the policy's
    parameters before every batch it samples and `sample` for the batch. `sample` may
    return device arrays still being computed."""

    capabilities: ClassVar[Capabilities] = Capabilities()

    @classmethod
    def check(cls, config, *, multi_turn: bool, mesh) -> None:
        """Refuse, before anything starts, what this engine cannot run beyond what its
        `capabilities` say (those are checked by `check_settings`), from the run's
        `jaxppo.Config`. Default: nothing."""

    @classmethod
    @abc.abstractmethod
    def create(cls, spec, params, config, *, query_width: int, mesh=None) -> "RolloutEngine":
        """The engine of a run: `spec` a `RolloutSpec`, `params` the train parameters at the
        start (`spec.policy_params(params)` are the policy's), `config` the run's
        `jaxppo.Config`, `query_width` the prompts' padded width, `mesh` the trainer's mesh
        or None."""

    @abc.abstractmethod
    def set_weights(self, params, version: int) -> None:
        """Take the policy's parameters `params` (a pytree of the policy `Model`'s) of
        `version`: the iterations they are after (0: the initial policy; with pipelined
        iterations a stale one, `jaxppo.run.pipeline.version_of`). An engine holding
        its own copy loads them when the version changes."""

    @abc.abstractmethod
    def sample(self, prompt_ids, prompt_mask, key, *, num_generations: int, response_length: int,
               max_lengths=None, temperature: Optional[float] = None) -> GenerationOutput:
        """Sample `response_length` tokens after each left-padded prompt (int (B, Q)) from
        the weights last set. Rows come in groups of `num_generations` consecutive rows with
        the same prompt. `max_lengths`: None, or int (B,) budgets per row (`multi_turn`).
        `temperature`: None samples at the spec's; a value replaces it for this call (0:
        greedy, the argmax), as an evaluation asks (`EvalConfig.eval_temperature`; an
        engine whose `sample` lacks this keyword is refused eval_temperature before the run
        starts, and evaluates at the spec's).
        Returns a `GenerationOutput` of (B, R) tokens (pad after a stop token or the token
        that completed a stop string), the log-prob of each under the behaviour policy (the
        distribution it was drawn from: softmax(logits / temperature) after the spec's
        penalty and filters; 0 where masked), the mask (1 up to and including the stop
        token) and, where the engine can give them and they differ, `full_logprobs` under
        the unfiltered softmax(logits / temperature) (None otherwise)."""

    def sample_inflight(self, source: Callable, prompt_ids, prompt_mask, key, *, on_update: str,
                        steps: int) -> Tuple[GenerationOutput, jax.Array]:
        """With `inflight_updates`: sample while taking new weights between decode steps,
        `source()` -> (version, train params); returns (output, the version behind each
        token (B, R))."""
        raise NotImplementedError(f"{type(self).__name__} does not take weights while it decodes")

    def close(self) -> None:
        """Release what the engine holds; nothing samples afterwards. Default: nothing."""

    @property
    def closed(self) -> bool:
        return False


class _Builtin(RolloutEngine):
    """What the built-in engines share: the policy's parameters held by reference (the
    samplers are compiled functions of them) and the spec's sampling settings."""

    def __init__(self, spec):
        self.spec, self.params = spec, None

    @classmethod
    def create(cls, spec, params, config=None, *, query_width: int = 0, mesh=None) -> "_Builtin":
        return cls(spec)

    def set_weights(self, params, version=None) -> None:
        self.params = params

    def settings(self, temperature: Optional[float] = None) -> dict:
        """The sampling settings every sampler takes from the spec (`RolloutSpec.sampling`),
        with `temperature` instead of the spec's where given (0: greedy)."""
        return sampling_settings(self.spec, temperature)


class StaticEngine(_Builtin):
    """The static sampler (`jaxppo.rollout.samplers.static.generate`): every row decoded
    together until the last one stops, each group's prompt prefilled once; with
    `turn_cache`, multi-turn episodes keep each row's KV cache between turns."""

    capabilities = Capabilities(multi_turn=True, turn_cache=True, meshes=True, exact_logprobs=True)

    def sample(self, prompt_ids, prompt_mask, key, *, num_generations: int, response_length: int,
               max_lengths=None, temperature: Optional[float] = None) -> GenerationOutput:
        return generate(self.spec.policy, self.params, prompt_ids, prompt_mask, key, response_length=response_length,
                        num_generations=num_generations, max_lengths=max_lengths, **self.settings(temperature),
                        common_prefix=self.prefix_of(prompt_ids, prompt_mask, num_generations))

    def prefix_of(self, prompt_ids, prompt_mask, num_generations: int) -> int:
        """The run's common prefix (`RolloutSpec.common_prefix`) where these prompts begin
        with it (the training batches do; an evaluation's prompts may not) and the sampler
        can prefill it once (`samplers.static.effective_prefix`), else 0."""
        prefix = effective_prefix(self.spec.policy, self.spec.common_prefix, num_generations, prompt_ids.shape[1])
        return prefix if prefix and shares_prefix(prompt_ids, prompt_mask, prefix) else 0

    def first_turn(self, prompt_ids, prompt_mask, key, *, num_generations: int, turn_length: int, max_lengths,
                   temperature: Optional[float] = None):
        """The first turn of multi-turn episodes, its KV cache kept (`samplers.turns`)."""
        return first_turn(self.spec.policy, self.params, prompt_ids, prompt_mask, key, num_generations=num_generations,
                          turn_length=turn_length, response_budget=self.spec.response_length,
                          max_lengths=max_lengths, **self.settings(temperature))

    def next_turn(self, state, new_tokens, new_start, new_lengths, key, *, turn_length: int, max_lengths, place,
                  temperature: Optional[float] = None):
        """A later turn from the kept cache: only the tokens new since it are fed."""
        return next_turn(self.spec.policy, self.params, state, new_tokens, new_start, new_lengths, key, place=place,
                         turn_length=turn_length, response_budget=self.spec.response_length,
                         max_lengths=max_lengths, **self.settings(temperature))


class ContinuousEngine(_Builtin):
    """Continuous batching (`jaxppo.rollout.samplers.continuous`): `spec.num_slots` rows
    decode together and a row that ends frees its slot for the next request; the same
    tokens as the static sampler for the same key. Takes new weights while it decodes
    (`sample_inflight`)."""

    capabilities = Capabilities(continuous_batching=True, inflight_updates=True, multi_turn=True, meshes=True,
                                exact_logprobs=True)

    def sample(self, prompt_ids, prompt_mask, key, *, num_generations: int, response_length: int,
               max_lengths=None, temperature: Optional[float] = None) -> GenerationOutput:
        return generate_continuous(self.spec.policy, self.params, prompt_ids, prompt_mask, key,
                                   num_slots=self.spec.num_slots, response_length=response_length,
                                   max_lengths=max_lengths, **self.settings(temperature))

    def sample_inflight(self, source, prompt_ids, prompt_mask, key, *, on_update: str, steps: int):
        spec = self.spec

        def policy_source():
            version, params = source()
            return version, spec.policy_params(params)

        return generate_inflight(spec.policy, policy_source, prompt_ids, prompt_mask, key,
                                 response_length=spec.response_length, num_slots=spec.num_slots,
                                 steps_per_check=steps, on_update=on_update, **self.settings())


# The engines by `SamplingConfig.rollout_engine`, besides the built-in ones ("jaxppo").
ROLLOUT_ENGINES: dict = {}
# The package's optional engines, by the module that registers each: imported the first time
# the name is asked for, so that importing jaxppo loads no optional backend.
PACKAGED = {"vllm": "jaxppo.rollout.vllm", "vllm-server": "jaxppo.rollout.vllm_server"}


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


def sampling_settings(spec, temperature: Optional[float] = None) -> dict:
    """`spec.sampling()` (a `RolloutSpec`'s settings), at `temperature` instead of the
    spec's where it is given: 0 is greedy decoding (the argmax; log-probs at temperature 1)."""
    settings = spec.sampling()
    if temperature is None:
        return settings
    return {**settings, "temperature": float(temperature) or 1.0, "greedy": float(temperature) == 0.0}


def takes_temperature(engine_cls: type, method: str = "sample") -> bool:
    """Whether `engine_cls.method` accepts `temperature=` (every built-in engine's does;
    an engine written before it was part of the interface may not)."""
    import inspect

    fn = getattr(engine_cls, method, None)
    if fn is None:
        return False
    parameters = inspect.signature(fn).parameters
    return "temperature" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def sample_responses(spec, params, prompt_ids, prompt_mask, key) -> GenerationOutput:
    """Sample `spec.response_length` tokens per prompt from the policy in the train
    `params` with the built-in engine of `spec` (continuous with `spec.num_slots`, else
    static): compiled, returns without waiting for the device."""
    engine = engine_class(BUILT_IN, spec.num_slots)(spec)
    engine.set_weights(spec.policy_params(params), None)
    return engine.sample(prompt_ids, prompt_mask, key, num_generations=spec.num_generations,
                         response_length=spec.response_length)
