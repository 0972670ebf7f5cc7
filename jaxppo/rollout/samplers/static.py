"""The static sampler: a batch of left-padded prompts, each row decoded to a fixed response
length with a KV cache, fully jitted, stopping early once every row has hit a stop token
(the built-in static rollout engine's; `jaxppo.rollout.engines`).

    generate(model, params, prompt_ids (B, Q), prompt_mask, key, response_length=R)
      -> GenerationOutput (B, R)
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.decoding import (Extra, GenerationOutput, check_groups, check_max_lengths, check_sampler_arguments,
                                    decode_loop, make_extra, prefill, prefill_common, seen_tokens)
from jaxppo.models.model import Model
from jaxppo.update.prefix import common_prefix_length

__all__ = ["generate", "generate_jit", "lower_generate", "effective_prefix", "shares_prefix", "check_common_prefix"]


@functools.partial(
    jax.jit,
    static_argnames=("model", "response_length", "top_k", "use_top_p", "greedy", "stop_token_ids", "pad_token_id",
                     "early_stop", "num_generations", "return_cache", "common_prefix"),
)
def generate_jit(model, params, prompt_ids, prompt_mask, key, temperature, top_p, max_lengths=None, *,
                 response_length, top_k, use_top_p, greedy, stop_token_ids, pad_token_id, early_stop,
                 num_generations=1, return_cache=False, extra: Optional[Extra] = None, common_prefix: int = 0):
    """The compiled sampler behind `generate` (static: the model and every size and
    switch; `extra` is traced, its None fields static), for ahead-of-time lowering
    (`generate_jit.lower(...)`) and compile counts. With `return_cache`: (output, the KV
    cache after the decode, the tokens each row holds or None), for a next turn
    (`jaxppo.rollout.samplers.turns`). `common_prefix` p > 0: the prompts' first p real
    tokens are the same in every row, prefilled once (`prefill_common`; one completion per
    prompt, no sliding-window layers, p < Q: `effective_prefix` says what applies)."""
    model, params = model.for_decoding(params)  # `Model.hoist_layers`
    b, q = prompt_ids.shape
    r = response_length
    if common_prefix:
        if effective_prefix(model, common_prefix, num_generations, q) != common_prefix:
            raise ValueError(f"generate_jit: common_prefix={common_prefix} does not apply here "
                             f"(num_generations={num_generations}, width {q}, sliding-window layers: "
                             f"{any(model.config.sliding_layers)}); pass effective_prefix(...)")
        cache, next_logits, kv_mask = prefill_common(model, params, prompt_ids, prompt_mask, q + r, common_prefix)
    else:
        kv_mask = jnp.concatenate([prompt_mask.astype(jnp.int32), jnp.zeros((b, r), jnp.int32)], axis=1)
        cache, next_logits = prefill(model, params, prompt_ids, prompt_mask, q + r, num_generations)
    seen = None
    if extra is not None and extra.repetition_penalty is not None:
        seen = seen_tokens(prompt_ids, prompt_mask, next_logits.shape[-1])
    output, cache, seen = decode_loop(model, params, cache, next_logits, kv_mask, q,
                                      jnp.sum(prompt_mask.astype(jnp.int32), axis=1), jax.random.split(key, b),
                                      temperature, top_p, max_lengths, response_length=r, top_k=top_k,
                                      use_top_p=use_top_p, greedy=greedy, stop_token_ids=stop_token_ids,
                                      pad_token_id=pad_token_id, early_stop=early_stop, extra=extra, seen=seen)
    return (output, cache, seen) if return_cache else output


def effective_prefix(model: Model, common_prefix: int, num_generations: int, width: int) -> int:
    """The common prefix the static sampler prefills once for prompts that share
    `common_prefix` leading tokens: 0 with several completions per prompt (each group's
    prompt is prefilled once already), with sliding-window layers (the window is measured
    in cache slots, which `prefill_common`'s layout spaces out), else at most width - 1."""
    if not common_prefix or num_generations != 1 or any(model.config.sliding_layers):
        return 0
    return min(common_prefix, width - 1)


def shares_prefix(prompt_ids, prompt_mask, prefix: int):
    """Whether every row of the left-padded prompts begins with the same `prefix` real
    tokens (`common_prefix_length` at least `prefix`: `prefill_common`'s condition); None
    when the values are not known (traced, or a multi-host array)."""
    if not getattr(prompt_ids, "is_fully_addressable", True):
        return None
    try:
        ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    return common_prefix_length(ids, mask) >= prefix


def check_common_prefix(prompt_ids, prompt_mask, prefix):
    """ValueError unless `prefix` is an int >= 0 and, when it is > 0, every row's first
    `prefix` real tokens are the same (checked when the values are concrete)."""
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"common_prefix={prefix!r} must be an int >= 0 (the prompts' shared leading tokens)")
    if prefix and shares_prefix(prompt_ids, prompt_mask, prefix) is False:
        raise ValueError(f"common_prefix={prefix}: the prompts do not all begin with the same {prefix} real tokens "
                         "(or one is shorter); give their shared length "
                         "(`jaxppo.update.prefix.common_prefix_length`) or 0")


def generate(model: Model, params, prompt_ids, prompt_mask, key, *, response_length: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None, greedy: bool = False,
             stop_token_ids: Optional[Sequence[int]] = None, pad_token_id: Optional[int] = None,
             early_stop: bool = True, num_generations: int = 1, max_lengths=None, min_p: Optional[float] = None,
             repetition_penalty: Optional[float] = None, stop_strings=None, common_prefix: int = 0) -> GenerationOutput:
    """Sample `response_length` tokens after left-padded prompts, with a KV cache.

    Args:
      model, params: a causal-LM `Model` ("causal_lm" or "causal_lm_value") and its params.
      prompt_ids, prompt_mask: int (B, Q), left-padded (mask 1 at real tokens; every row's
        last slot must be a real token).
      key: PRNG key; the same key gives the same tokens.
      response_length: R, tokens generated per row (fixed: one compile per shape).
      temperature: logits are divided by it before sampling and for the returned log-probs.
      top_k: keep only the k most likely tokens (None: all).
      top_p: nucleus sampling threshold in (0, 1] (None: off).
      min_p: keep only tokens at least min_p times as likely as the most likely one, in
        (0, 1) (None: off).
      repetition_penalty: > 0; a token already in the row's prompt or response has its
        logit divided by it where positive, multiplied where negative (None or 1: off).
        (The order of these: `jaxppo.models.decoding`.)
      greedy: take the argmax instead of sampling (log-probs still temperature-scaled).
      stop_token_ids: tokens that end a row (default: the model config's EOS ids); the
        stop token itself is kept and masked in, everything after is pad and masked out.
      stop_strings: a `jaxppo.models.stops.StopStrings` (built with the tokenizer): a row
        also ends at the token that completes one of its strings (kept and masked in).
      pad_token_id: token written after a stop (default: config pad, else first EOS, else 0).
      early_stop: stop decoding once every row has hit a stop token (a `lax.while_loop`;
        the outputs equal those of `early_stop=False`, which always runs all R steps as a
        `lax.scan`). Rollouts whose responses end early then cost less.
      num_generations: G; rows come in groups of G consecutive rows with the same prompt
        (as a group-sampling trainer lays them out). Each group's prompt is prefilled
        once and its KV cache shared by its G rows, which then sample independently: the
        same tokens as G = 1 for the same key, with 1/G of the prefill work. The prompts
        must be equal within each group (checked when the arrays are concrete).
      max_lengths: optional int (B,): row i ends after max_lengths[i] tokens (at most
        `response_length`) if no stop token ended it before: per-request budgets.
      common_prefix: p > 0 says every prompt begins with the same p real tokens (a chat
        template's system prompt; `jaxppo.update.prefix.common_prefix_length` measures it,
        checked here when the arrays are concrete): the prefix is prefilled once and
        shared by every row, p + B * (Q - p) prompt tokens instead of B * Q. The same tokens
        as p = 0 for the same key, up to float rounding. Applies with one completion per
        prompt and no sliding-window layers (`effective_prefix`); elsewhere ignored.

    Returns:
      `GenerationOutput(tokens, logprobs, mask, full_logprobs)`, each (B, R) (`logprobs`
      under the distribution sampled from; `full_logprobs` under softmax(logits /
      temperature), None when that is the same one).
    """
    stop_token_ids, pad_token_id = check_sampler_arguments(model, prompt_ids, prompt_mask, response_length, temperature,
                                                           top_k, top_p, stop_token_ids, pad_token_id, max_lengths,
                                                           min_p, repetition_penalty)
    check_groups(prompt_ids, prompt_mask, num_generations)
    check_common_prefix(prompt_ids, prompt_mask, common_prefix)
    return generate_jit(
        model, params, jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32), key,
        jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p),
        check_max_lengths(max_lengths, prompt_ids.shape[0], response_length),
        **_switches(response_length, top_k, top_p, greedy, stop_token_ids, pad_token_id, early_stop, num_generations,
                    min_p, repetition_penalty, stop_strings),
        common_prefix=effective_prefix(model, common_prefix, num_generations, prompt_ids.shape[1]),
    )


def _switches(response_length, top_k, top_p, greedy, stop_token_ids, pad_token_id, early_stop, num_generations, min_p,
              repetition_penalty, stop_strings) -> dict:
    """`generate_jit`'s static switches and its traced extras, from `generate`'s arguments."""
    return dict(response_length=response_length, top_k=top_k, use_top_p=top_p is not None, greedy=bool(greedy),
                stop_token_ids=tuple(stop_token_ids), pad_token_id=int(pad_token_id), early_stop=bool(early_stop),
                num_generations=num_generations, extra=make_extra(min_p, repetition_penalty, stop_strings))


def lower_generate(model: Model, params, prompt_ids, prompt_mask, key, *, response_length: int,
                   temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   greedy: bool = False, stop_token_ids: Sequence[int] = (), pad_token_id: int = 0,
                   early_stop: bool = True, num_generations: int = 1, min_p: Optional[float] = None,
                   repetition_penalty: Optional[float] = None, stop_strings=None):
    """`generate`'s program lowered for ahead-of-time compilation (`.compile()`), for
    parameters, prompts and a key given as shapes (`jax.ShapeDtypeStruct`s, placed where the
    program is to run: the devices of their shardings): nothing is read or checked. The
    arguments are `generate`'s (the usual layout: no common prefix)."""
    del temperature  # traced: its value does not change the program
    scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=getattr(key, "sharding", None))
    return generate_jit.lower(model, params, prompt_ids, prompt_mask, key, scalar, scalar, None,
                              **_switches(response_length, top_k, top_p, greedy, stop_token_ids, pad_token_id,
                                          early_stop, num_generations, min_p, repetition_penalty, stop_strings))
