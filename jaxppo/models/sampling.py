"""`Sampling`: how a sampler picks tokens and where a row ends, one frozen value passed whole
to every sampler (`jaxppo.rollout.engines`) and to the decode loop (`jaxppo.models.decoding`).

    sampling = Sampling(response_length=64, temperature=0.7, top_p=0.95)
    out = generate(model, params, prompt_ids, prompt_mask, key, sampling)
    out = generate(model, params, prompt_ids, prompt_mask, key, sampling, temperature=1.0)  # one field replaced

A run's value comes from its `jaxppo.SamplingConfig` (`RolloutSpec.sampling`). The value
is a pytree: the numbers (temperature, top-p, min-p, the penalty, the stop strings' automata)
are its leaves, traced inside a compiled sampler, so a new value does not recompile; the rest
(the budget, top-k, greedy, the stop and pad tokens, early stopping) is its structure, static.
A setting that is off is None, which is static too: turning it on compiles anew."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax
import numpy as np

from jaxppo.models.stops import StopStrings

__all__ = ["Sampling", "SAMPLING_FIELDS", "SAMPLING_OFF", "filter_on", "sampling_filters_on"]

# The sampling filters and penalty (`SamplingConfig`'s), each with the values that mean off.
SAMPLING_OFF = {"top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0)}

_TRACED = ("temperature", "top_p", "min_p", "repetition_penalty", "stop_strings")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are picked and where a row ends (hashable: a `RolloutSpec` holds one).

    Attributes:
      response_length: R, the tokens a row may generate (its budget; one compile per R).
      temperature: logits are divided by it before sampling and for the returned log-probs; > 0.
      top_k: keep only the k most likely tokens (None: all).
      top_p: nucleus sampling's mass in (0, 1] (None: off).
      min_p: keep only tokens at least min_p times as likely as the most likely one, in
        (0, 1) (None: off).
      repetition_penalty: > 0; a token already in the row's prompt or response has its logit
        divided by it where positive, multiplied where negative (None or 1: off).
      greedy: take the argmax instead of sampling (log-probs still temperature-scaled).
      stop_token_ids: tokens that end a row (None: the model config's EOS ids); the stop
        token is kept and masked in, everything after it is pad and masked out.
      stop_strings: a `jaxppo.models.stops.StopStrings` (built with the tokenizer), or None:
        a row also ends at the token that completes one of its strings.
      pad_token_id: the token written after a stop (None: the config's pad, else its first
        EOS, else 0).
      early_stop: stop decoding once every row has ended (a `lax.while_loop`; the same
        outputs as False, which always runs R steps as a `lax.scan`).

    The order a token is picked in is vLLM's (`jaxppo.models.decoding`)."""

    response_length: int = 32
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    greedy: bool = False
    stop_token_ids: Optional[Tuple[int, ...]] = None
    stop_strings: Optional[StopStrings] = None
    pad_token_id: Optional[int] = None
    early_stop: bool = True

    @classmethod
    def of(cls, sampling: Optional["Sampling"] = None, **settings) -> "Sampling":
        """`sampling` (default: `Sampling()`) with the fields named in `settings` replaced; a
        TypeError names a setting that is not a field."""
        unknown = sorted(set(settings) - set(SAMPLING_FIELDS))
        if unknown:
            raise TypeError(f"unknown sampling setting(s) {unknown}; valid: {', '.join(SAMPLING_FIELDS)}")
        if sampling is not None and not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a jaxppo.models.sampling.Sampling or None, got {sampling!r:.80}")
        return dataclasses.replace(sampling or cls(), **settings)

    def at_temperature(self, temperature: Optional[float]) -> "Sampling":
        """This value at `temperature` instead (None: unchanged); 0 is greedy decoding (the
        argmax; log-probs at temperature 1), as an evaluation may ask."""
        if temperature is None:
            return self
        return dataclasses.replace(self, temperature=float(temperature) or 1.0, greedy=float(temperature) == 0.0)

    @property
    def reshapes(self) -> bool:
        """The penalty or min-p is on (the sampled distribution is not the policy's)."""
        return self.min_p is not None or self.repetition_penalty is not None

    @property
    def two_logprobs(self) -> bool:
        """The distribution sampled from differs from the policy's own (a filter or the
        penalty, and not greedy): a second log-prob per token, the policy's, is kept."""
        return not self.greedy and (self.reshapes or self.top_k is not None or self.top_p is not None)

    @property
    def stop_table(self):
        """The stop strings' automata, int (K, S, V), or None."""
        return None if self.stop_strings is None else self.stop_strings.table

    def check(self, model) -> "Sampling":
        """ValueError for a setting out of range, before anything compiles. Returns the value
        ready for a compiled sampler: the stop and pad tokens filled in from `model`'s
        config, a penalty of 1 as None, and the numbers as float32 (strongly typed, so that
        a bfloat16 model's logits are divided in float32)."""
        r = self.response_length
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0:
            raise ValueError(f"response_length={r!r} must be a positive int")
        if not (isinstance(self.temperature, (int, float, np.floating)) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be > 0")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer))
                                       or self.top_k <= 0):
            raise ValueError(f"top_k={self.top_k!r} must be None or a positive int")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be None or in (0, 1]")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float, np.floating)) and 0.0 < self.min_p < 1.0):
            raise ValueError(f"min_p={self.min_p!r} must be None or in (0, 1)")
        penalty = self.repetition_penalty
        if penalty is not None and not (isinstance(penalty, (int, float, np.floating)) and 0.0 < penalty < math.inf):
            raise ValueError(f"repetition_penalty={penalty!r} must be None or a finite number > 0 (1: none)")
        if self.stop_strings is not None and not isinstance(self.stop_strings, StopStrings):
            raise ValueError(f"stop_strings={self.stop_strings!r:.80} must be None or a jaxppo.models.stops.StopStrings "
                             "(StopStrings.build(strings, tokenizer, vocab_size))")
        stops = model.config.eos_token_ids if self.stop_token_ids is None else self.stop_token_ids
        pad = self.pad_token_id
        if pad is None:
            pad = model.config.pad_token_id
            if pad is None:
                pad = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
        f32 = lambda x: None if x is None else np.float32(x)
        return dataclasses.replace(
            self, response_length=int(r), temperature=np.float32(self.temperature),
            top_k=None if self.top_k is None else int(self.top_k), top_p=f32(self.top_p), min_p=f32(self.min_p),
            repetition_penalty=None if penalty in (None, 1, 1.0) else np.float32(penalty), greedy=bool(self.greedy),
            stop_token_ids=tuple(int(t) for t in stops), pad_token_id=int(pad), early_stop=bool(self.early_stop))


def filter_on(name: str, value):
    """A filter's or the penalty's value as the samplers take it: None where it is off."""
    return None if value in SAMPLING_OFF[name] else (value if name == "top_k" else float(value))


def sampling_filters_on(settings) -> dict:
    """{name: value} of the filters and the penalty that are on, of `settings` (a
    `SamplingConfig` or a `Sampling`)."""
    return {name: getattr(settings, name) for name in SAMPLING_OFF
            if filter_on(name, getattr(settings, name)) is not None}


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling))
jax.tree_util.register_dataclass(Sampling, data_fields=list(_TRACED),
                                 meta_fields=[f for f in SAMPLING_FIELDS if f not in _TRACED])
