"""Multi-turn sampling that keeps each row's KV cache between turns: a turn prefills only
the tokens that are new since the last one (the previous turn's last token and the
observation that answered it), never the whole context again.

    out, state = first_turn(model, params, prompt_ids, prompt_mask, key,
                            turn_length=L, response_budget=R, ...)
    # ... the host appends observations ...
    out, state = next_turn(model, params, state, new_tokens, new_start, new_lengths, key,
                           turn_length=L, response_budget=R, ...)

The cache's layout: the left-padded prompt in slots [0, Q) (with `num_generations` G > 1,
once per group: a `GroupedKV`, so later turns read each group's prompt once too), then
each row's response region in order, response token j at slot Q + j (model turns and
observations alike: the region the rollout keeps), and L slots to spare, R + L response
slots in all. A turn's new tokens are written at their own slots (a per-row cache
index), so rows with different histories need no re-alignment; then the turn decodes
from each row's end (`jaxppo.models.decoding.decode_loop`). Slots past a row's end may
hold what a finished row decoded; they are masked until they are overwritten.

The first turn is `generate_jit` itself (with its cache returned and widened), so it
samples exactly the single-turn sampler's tokens. A later turn samples the tokens that
re-prefilling the whole context would (the same keys and distributions); its log-probs
equal those up to float rounding (the keys and values of the context come from earlier
steps instead of one prefill).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.decoding import (cap_positions, check_max_lengths, check_sampler_arguments, decode_loop, make_extra,
                                    seen_tokens)
from jaxppo.rollout.samplers.static import generate_jit
from jaxppo.models.transformer import GroupedKV

__all__ = ["TurnCache", "first_turn", "next_turn"]

_SAMPLER = ("model", "top_k", "use_top_p", "greedy", "stop_token_ids", "pad_token_id")


class TurnCache(NamedTuple):
    """What a turn leaves for the next: the KV cache (see the module for its layout), the
    prompts' mask (B, Q) (a row's positions count its real prompt tokens) and, with a
    repetition penalty, the tokens each row holds so far (B, V) bool (else None)."""

    cache: Any
    prompt_mask: jax.Array
    seen: Optional[jax.Array] = None


def _slot_axis(model) -> int:
    """The slot axis of the cache the sampler decodes with (`Model.for_decoding`)."""
    return 2 if model.scan_layers and not model.hoist_layers else 1


def _widen(cache, extra: int, axis: int):
    """The cache with `extra` zeroed response slots appended (a `GroupedKV`'s prompt part
    is kept as it is)."""
    pad = lambda x: jnp.pad(x, [(0, 0)] * axis + [(0, extra)] + [(0, 0)] * (x.ndim - axis - 1))
    grouped = lambda c: c._replace(k=pad(c.k), v=pad(c.v))
    if isinstance(cache, GroupedKV):
        return grouped(cache)
    if isinstance(cache, tuple) and cache and isinstance(cache[0], GroupedKV):
        return tuple(grouped(c) for c in cache)
    return jax.tree.map(pad, cache)


@functools.partial(jax.jit, static_argnames=_SAMPLER + ("turn_length", "extra", "num_generations"))
def _first_turn_jit(model, params, prompt_ids, prompt_mask, key, temperature, top_p, max_lengths, settings=None, *,
                    turn_length, extra, num_generations, **sampler):
    out, cache, seen = generate_jit(model, params, prompt_ids, prompt_mask, key, temperature, top_p, max_lengths,
                                    response_length=turn_length, early_stop=True, num_generations=num_generations,
                                    return_cache=True, extra=settings, **sampler)
    return out, _widen(cache, extra, _slot_axis(model)), seen


@functools.partial(jax.jit, static_argnames=_SAMPLER + ("turn_length", "piece"), donate_argnames=("cache",))
def _next_turn_jit(model, params, cache, prompt_mask, new_tokens, new_start, new_lengths, key, temperature, top_p,
                   max_lengths, settings=None, seen=None, *, turn_length, piece, **sampler):
    model, params = model.for_decoding(params)
    b, q = prompt_mask.shape
    prompt_mask = prompt_mask.astype(jnp.int32)
    grouped = isinstance(cache, GroupedKV) or isinstance(cache[0], GroupedKV)
    slots = jax.tree.leaves(cache)[-1].shape[_slot_axis(model)]  # the last layer's v: (..., B, slots, KV, D)
    response_slots = slots if grouped else slots - q
    used = new_start + new_lengths  # each row's response tokens once the new ones are in
    real = jnp.sum(prompt_mask, axis=1)
    # Every response token up to `used` is real (model turns and observations alike); the
    # causal mask keeps each new token from the ones after it.
    kv_mask = jnp.concatenate([prompt_mask, (jnp.arange(response_slots)[None, :] < used[:, None]).astype(jnp.int32)],
                              axis=1)

    def feed(carry, k):
        """The new tokens' k-th piece of `piece` tokens, at each row's own slots; a row whose
        new tokens ended before it writes pad at its end (masked, overwritten later)."""
        cache, hidden = carry
        tokens = jax.lax.dynamic_slice_in_dim(new_tokens, k * piece, piece, axis=1)
        n = jnp.clip(new_lengths - k * piece, 0, piece)  # real tokens of each row in this piece
        at = jnp.minimum(new_start + k * piece, used)  # the response slot of the piece's first token
        offsets = jnp.minimum(jnp.arange(piece)[None, :], jnp.maximum(n - 1, 0)[:, None])  # pad: the last real one's
        positions = cap_positions(model, real[:, None] + at[:, None] + offsets)
        h, _, cache = model.module.apply(params, tokens, kv_mask, positions, cache, q + at, return_hidden=True)
        last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
        return (cache, jnp.where((n > 0)[:, None], last, hidden)), None

    pieces = new_tokens.shape[1] // piece
    hidden = jnp.zeros((b, model.config.hidden_size), model.dtype)
    (cache, hidden), _ = jax.lax.scan(feed, (cache, hidden), jnp.arange(pieces))
    next_logits = model.lm_head(params).logits(hidden)
    if seen is not None:  # the new tokens join the ones the penalty sees
        seen = seen | seen_tokens(new_tokens, jnp.arange(new_tokens.shape[1])[None, :] < new_lengths[:, None],
                                  seen.shape[1])
    return decode_loop(model, params, cache, next_logits, kv_mask, q + used, real + used, jax.random.split(key, b),
                       temperature, top_p, max_lengths, response_length=turn_length, early_stop=True, extra=settings,
                       seen=seen, **sampler)


def _sampler_settings(model, prompt_ids, prompt_mask, turn_length, response_budget, temperature, top_k, top_p, greedy,
                      stop_token_ids, pad_token_id, max_lengths, min_p, repetition_penalty, stop_strings):
    if not isinstance(response_budget, int) or not isinstance(turn_length, int) or not 0 < turn_length <= response_budget:
        raise ValueError(f"turn_length={turn_length!r} and response_budget={response_budget!r} must be ints with "
                         "0 < turn_length <= response_budget")
    stop_token_ids, pad_token_id = check_sampler_arguments(model, prompt_ids, prompt_mask, response_budget, temperature,
                                                           top_k, top_p, stop_token_ids, pad_token_id, None, min_p,
                                                           repetition_penalty)
    return dict(top_k=top_k, use_top_p=top_p is not None, greedy=bool(greedy), stop_token_ids=stop_token_ids,
                pad_token_id=int(pad_token_id)), (jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p),
                                                  check_max_lengths(max_lengths, prompt_ids.shape[0], turn_length),
                                                  make_extra(min_p, repetition_penalty, stop_strings))


def first_turn(model, params, prompt_ids, prompt_mask, key, *, turn_length: int, response_budget: int,
               temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
               greedy: bool = False, stop_token_ids: Optional[Sequence[int]] = None,
               pad_token_id: Optional[int] = None, num_generations: int = 1, max_lengths=None,
               min_p: Optional[float] = None, repetition_penalty: Optional[float] = None, stop_strings=None):
    """The first turn of multi-turn sampling: `generate`'s tokens for `turn_length` tokens
    (the same arguments; `max_lengths` the rows' budgets for this turn), and a `TurnCache`
    with room for `response_budget` response tokens (R: every turn and observation of an
    episode) for `next_turn`. Returns (`GenerationOutput` (B, L), `TurnCache`)."""
    statics, (temperature, top_p, max_lengths, settings) = _sampler_settings(
        model, prompt_ids, prompt_mask, turn_length, response_budget, temperature, top_k, top_p, greedy,
        stop_token_ids, pad_token_id, max_lengths, min_p, repetition_penalty, stop_strings)
    prompt_ids, prompt_mask = jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32)
    out, cache, seen = _first_turn_jit(model, params, prompt_ids, prompt_mask, key, temperature, top_p, max_lengths,
                                       settings, turn_length=turn_length, extra=response_budget,
                                       num_generations=num_generations, **statics)
    return out, TurnCache(cache, prompt_mask, seen)


def piece_width(longest: int, turn_length: int) -> int:
    """The width of the pieces a turn's new tokens are fed in: a power of two >= 8 that
    covers the longest row's, at most the turn length (longer ones take several pieces),
    so that few shapes compile."""
    return min(turn_length, max(8, 1 << max(0, longest - 1).bit_length()))


def next_turn(model, params, state: TurnCache, new_tokens, new_start, new_lengths, key, *, turn_length: int,
              response_budget: int, temperature: float = 1.0, top_k: Optional[int] = None,
              top_p: Optional[float] = None, greedy: bool = False, stop_token_ids: Optional[Sequence[int]] = None,
              pad_token_id: Optional[int] = None, max_lengths=None, place=lambda x: x,
              min_p: Optional[float] = None, repetition_penalty: Optional[float] = None, stop_strings=None):
    """A later turn: row i's `new_lengths[i]` tokens `new_tokens[i, :new_lengths[i]]` (the
    response tokens not yet in the cache, from response index `new_start[i]` on: the last
    turn's final token and the observation after it) are fed onto the cache, and then
    `turn_length` tokens are sampled after them (at most `max_lengths[i]` for row i).
    `new_tokens` (B, N), `new_start`, `new_lengths` (B,) are host arrays; `place` puts an
    array where the rows live (a mesh). The state passed in is consumed (its buffers are
    donated). Returns (`GenerationOutput` (B, L), `TurnCache`)."""
    new_tokens, new_start, new_lengths = (np.asarray(x, np.int32) for x in (new_tokens, new_start, new_lengths))
    b = new_tokens.shape[0]
    if new_start.shape != (b,) or new_lengths.shape != (b,):
        raise ValueError(f"new_start {new_start.shape} and new_lengths {new_lengths.shape} must be ({b},)")
    used = new_start + new_lengths
    if (new_lengths < 0).any() or (new_start < 0).any() or (used > response_budget).any() or (
            new_lengths > new_tokens.shape[1]).any():
        raise ValueError(f"new tokens outside the response budget: starts {new_start.tolist()}, lengths "
                         f"{new_lengths.tolist()}, each start + length must be <= response_budget={response_budget}")
    statics, (temperature, top_p, max_lengths, settings) = _sampler_settings(
        model, state.prompt_mask, state.prompt_mask, turn_length, response_budget, temperature, top_k, top_p, greedy,
        stop_token_ids, pad_token_id, max_lengths, min_p, repetition_penalty, stop_strings)
    piece = piece_width(int(new_lengths.max(initial=0)), turn_length)
    pieces = max(1, -(-int(new_lengths.max(initial=0)) // piece))
    padded = np.full((b, pieces * piece), statics["pad_token_id"], np.int32)
    width = min(new_tokens.shape[1], pieces * piece)
    padded[:, :width] = new_tokens[:, :width]
    out, cache, seen = _next_turn_jit(model, params, state.cache, state.prompt_mask, place(padded), place(new_start),
                                      place(new_lengths), key, temperature, top_p,
                                      None if max_lengths is None else place(np.asarray(max_lengths)), settings,
                                      state.seen, turn_length=turn_length, piece=piece, **statics)
    return out, TurnCache(cache, state.prompt_mask, seen)
