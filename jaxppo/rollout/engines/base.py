"""What every rollout engine is: its declared abilities (`Capabilities`) and its interface
(`RolloutEngine`); `BuiltinEngine`, what the built-in engines share."""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, ClassVar, Optional, Tuple

import jax

from jaxppo.models.decoding import GenerationOutput
from jaxppo.models.sampling import Sampling

__all__ = ["Capabilities", "RolloutEngine", "BuiltinEngine", "takes_temperature"]


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
      images: samples from prompts with images (a vision-language policy's `ImagePrompt` in
        place of the prompt ids).
    """

    continuous_batching: bool = False
    inflight_updates: bool = False
    multi_turn: bool = False
    turn_cache: bool = False
    meshes: bool = False
    exact_logprobs: bool = False
    images: bool = False


class RolloutEngine(abc.ABC):
    """The interface of a rollout engine. A subclass sets `capabilities` and implements
    `create`, `set_weights` and `sample` (and `close` when it holds resources;
    `sample_inflight` with `inflight_updates`; `first_turn` / `next_turn` with `turn_cache`).

    An engine is built once per run, after the models (`create`), from the `RolloutSpec`
    (`spec`: the policy `Model`, `spec.sampling` the run's `Sampling` value (temperature,
    filters, penalty, stops, budget), `spec.num_generations`) and the train parameters. The
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


class BuiltinEngine(RolloutEngine):
    """What the built-in engines share: the policy's parameters held by reference (the
    samplers are compiled functions of them) and the spec's sampling settings."""

    def __init__(self, spec):
        self.spec, self.params = spec, None

    @classmethod
    def create(cls, spec, params, config=None, *, query_width: int = 0, mesh=None) -> "BuiltinEngine":
        return cls(spec)

    def set_weights(self, params, version=None) -> None:
        self.params = params

    def sampling(self, temperature: Optional[float] = None) -> Sampling:
        """The spec's `Sampling` (`RolloutSpec.sampling`), at `temperature` instead of the
        spec's where given (0: greedy)."""
        return self.spec.sampling.at_temperature(temperature)


def takes_temperature(engine_cls: type, method: str = "sample") -> bool:
    """Whether `engine_cls.method` accepts `temperature=` (every built-in engine's does;
    an engine written before it was part of the interface may not)."""
    import inspect

    fn = getattr(engine_cls, method, None)
    if fn is None:
        return False
    parameters = inspect.signature(fn).parameters
    return "temperature" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


