"""The static sampler: a batch of left-padded prompts, each row decoded to a fixed response
length with a KV cache, fully jitted, stopping early once every row has hit a stop token
and `StaticEngine`, the built-in rollout engine that runs it (`jaxppo.rollout.engines`).

    generate(model, params, prompt_ids (B, Q), prompt_mask, key, Sampling(response_length=R))
      -> GenerationOutput (B, R)

Multi-turn sampling that keeps each row's KV cache between turns (`first_turn`,
`next_turn`: the engine's `turn_cache`): a turn prefills only the tokens that are new since the last one (the previous turn's last token and the
observation that answered it), never the whole context again.

    out, state = first_turn(model, params, prompt_ids, prompt_mask, key, Sampling(response_length=R),
                            turn_length=L)
    # ... the host appends observations ...
    out, state = next_turn(model, params, state, new_tokens, new_start, new_lengths, key,
                           Sampling(response_length=R), turn_length=L)

The cache's layout: the left-padded prompt in slots [0, Q) (with `num_generations` G > 1,
once per group: a `GroupedKV`, so later turns read each group's prompt once too), then
each row's response region in order, response token j at slot Q + j (model turns and
observations alike: the region the rollout keeps), and L slots to spare, R + L response
slots in all. A turn's new tokens are written at their own slots (a per-row cache
index), so rows with different histories need no re-alignment; then the turn decodes
from each row's end (`jaxppo.models.decoding.decode_loop`). Slots past a row's end may
hold what a finished row decoded; they are masked until they are overwritten.

The first turn is `generate_jit`'s work itself (with its cache returned and widened), so it
samples exactly the single-turn sampler's tokens. A later turn samples the tokens that
re-prefilling the whole context would (the same keys and distributions); its log-probs
equal those up to float rounding (the keys and values of the context come from earlier
steps instead of one prefill).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.decoding import (GenerationOutput, Prefilled, cap_positions, check_groups, check_max_lengths,
                                    check_sampler_arguments, decode_loop, host_values, prefill, prefill_common,
                                    seen_tokens)
from jaxppo.models.model import Model
from jaxppo.models.transformer import GroupedKV
from jaxppo.models.vision.prompt import ImagePrompt
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.base import BuiltinEngine, Capabilities
from jaxppo.update.prefix import common_prefix_length

__all__ = ["generate", "generate_jit", "lower_generate", "effective_prefix", "shares_prefix", "check_common_prefix",
           "TurnCache", "TurnInput", "first_turn", "next_turn", "piece_width", "StaticEngine"]


@functools.partial(jax.jit, static_argnames=("model", "num_generations", "common_prefix"))
def generate_jit(model, params, prompt_ids, prompt_mask, key, sampling: Sampling, max_lengths=None, *,
                 num_generations=1, common_prefix: int = 0):
    """The compiled sampler behind `generate` (static: the model, the sizes and `sampling`'s
    switches; `sampling` checked, `Sampling.check`), for ahead-of-time lowering
    (`generate_jit.lower(...)`) and compile counts. `common_prefix` p > 0: the prompts'
    first p real tokens are the same in every row, prefilled once (`prefill_common`; one
    completion per prompt, no sliding-window layers, p < Q: `effective_prefix` says what
    applies)."""
    return _sample(model, params, prompt_ids, prompt_mask, key, sampling, max_lengths, num_generations,
                   common_prefix)[0]


def _sample(model, params, prompt_ids, prompt_mask, key, sampling: Sampling, max_lengths, num_generations: int,
            common_prefix: int = 0):
    """`generate_jit`'s work, traced: (output, the KV cache after the decode, the tokens
    each row holds or None), the last two for a next turn (`first_turn`)."""
    model, params = model.for_decoding(params)  # `Model.hoist_layers`
    prompt, prompt_ids = prompt_ids, getattr(prompt_ids, "ids", prompt_ids)  # an `ImagePrompt`: tokens and images
    b, q = prompt_ids.shape
    r = sampling.response_length
    if common_prefix:
        if effective_prefix(model, common_prefix, num_generations, q) != common_prefix:
            raise ValueError(f"generate_jit: common_prefix={common_prefix} does not apply here "
                             f"(num_generations={num_generations}, width {q}, sliding-window layers: "
                             f"{any(model.config.sliding_layers)}); pass effective_prefix(...)")
        cache, next_logits, kv_mask = prefill_common(model, params, prompt_ids, prompt_mask, q + r, common_prefix)
    else:
        kv_mask = jnp.concatenate([prompt_mask.astype(jnp.int32), jnp.zeros((b, r), jnp.int32)], axis=1)
        cache, next_logits = prefill(model, params, prompt, prompt_mask, q + r, num_generations)
    seen = None
    if sampling.repetition_penalty is not None:
        seen = seen_tokens(prompt_ids, prompt_mask, next_logits.shape[-1])
    next_position = getattr(prompt, "next_position", None)
    if next_position is None:  # text: positions count the real tokens
        next_position = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
    start = Prefilled(next_logits, kv_mask, q, next_position, jax.random.split(key, b))
    return decode_loop(model, params, cache, start, sampling, max_lengths, seen)


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
    values = host_values(prompt_ids, prompt_mask)
    return None if values is None else common_prefix_length(*values) >= prefix


def check_common_prefix(prompt_ids, prompt_mask, prefix):
    """ValueError unless `prefix` is an int >= 0 and, when it is > 0, every row's first
    `prefix` real tokens are the same (checked when the values are concrete)."""
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"common_prefix={prefix!r} must be an int >= 0 (the prompts' shared leading tokens)")
    if prefix and shares_prefix(prompt_ids, prompt_mask, prefix) is False:
        raise ValueError(f"common_prefix={prefix}: the prompts do not all begin with the same {prefix} real tokens "
                         "(or one is shorter); give their shared length "
                         "(`jaxppo.update.prefix.common_prefix_length`) or 0")


def generate(model: Model, params, prompt_ids, prompt_mask, key, sampling: Optional[Sampling] = None, *,
             num_generations: int = 1, max_lengths=None, common_prefix: int = 0, **settings) -> GenerationOutput:
    """Sample `sampling.response_length` tokens after left-padded prompts, with a KV cache.

    Args:
      model, params: a causal-LM `Model` ("causal_lm" or "causal_lm_value") and its params.
      prompt_ids, prompt_mask: int (B, Q), left-padded (mask 1 at real tokens; every row's
        last slot must be a real token). For a vision-language model, `prompt_ids` may be a
        `jaxppo.models.vision.ImagePrompt`: the ids with their images and rotary positions.
      key: PRNG key; the same key gives the same tokens.
      sampling: a `Sampling` (the budget R, temperature, filters, penalty, stops, greedy,
        early stopping; default `Sampling()`).
      settings: fields of `Sampling` that replace `sampling`'s (`generate(...,
        response_length=32, temperature=0.7)`).
      num_generations: G; rows come in groups of G consecutive rows with the same prompt
        (as a group-sampling trainer lays them out). Each group's prompt is prefilled
        once and its KV cache shared by its G rows, which then sample independently: the
        same tokens as G = 1 for the same key, with 1/G of the prefill work. The prompts
        must be equal within each group (checked when the arrays are concrete).
      max_lengths: optional int (B,): row i ends after max_lengths[i] tokens (at most
        R) if no stop token ended it before: per-request budgets.
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
    prompt, prompt_ids = sampler_prompt(model, prompt_ids, prompt_mask, common_prefix)
    sampling = check_sampler_arguments(model, prompt_ids, prompt_mask, Sampling.of(sampling, **settings), max_lengths)
    check_groups(prompt_ids, prompt_mask, num_generations)
    check_common_prefix(prompt_ids, prompt_mask, common_prefix)
    return generate_jit(
        model, params, prompt, jnp.asarray(prompt_mask, jnp.int32), key, sampling,
        check_max_lengths(max_lengths, prompt_ids.shape[0], sampling.response_length), num_generations=num_generations,
        common_prefix=effective_prefix(model, common_prefix, num_generations, prompt_ids.shape[1]))


def sampler_prompt(model: Model, prompt_ids, prompt_mask, common_prefix: int = 0):
    """(what the compiled sampler takes: the token ids, or the `ImagePrompt` with them on the
    device; the token ids). A model with a vision encoder samples from an `ImagePrompt`
    (text-only rows: plain ids without image tokens); other models from token ids."""
    prompt = prompt_ids
    if isinstance(prompt, ImagePrompt):
        if model.config.vision is None:
            raise ValueError(f"an ImagePrompt was given to a {model.config.model_type} model, which reads no images")
        if common_prefix:
            raise ValueError("common_prefix is not supported for prompts with images; pass 0")
        ids = jnp.asarray(prompt.ids, jnp.int32)
        return prompt._replace(ids=ids, images=jax.tree.map(jnp.asarray, prompt.images),
                               positions=jnp.asarray(prompt.positions, jnp.int32),
                               next_position=jnp.asarray(prompt.next_position, jnp.int32)), ids
    ids = jnp.asarray(prompt_ids, jnp.int32)
    image_token = model.config.image_token_id
    values = None if image_token is None else host_values(ids, prompt_mask)  # None where not known here
    if values is not None and np.any((values[0] == image_token) & (values[1] > 0)):
        raise ValueError(f"the prompts hold image tokens ({image_token}) but no images: pass a "
                         "jaxppo.models.vision.ImagePrompt (`image_prompt`) in place of the token ids")
    return ids, ids


def lower_generate(model: Model, params, prompt_ids, prompt_mask, key, sampling: Sampling, *, num_generations: int = 1):
    """`generate`'s program lowered for ahead-of-time compilation (`.compile()`), for
    parameters, prompts and a key given as shapes (`jax.ShapeDtypeStruct`s, placed where the
    program is to run: the devices of their shardings): nothing is read or checked but the
    sampling settings (`Sampling.check`; the usual layout: no common prefix)."""
    return generate_jit.lower(model, params, prompt_ids, prompt_mask, key, sampling.check(model), None,
                              num_generations=num_generations)


# Multi-turn sampling with the KV cache kept between turns.
class TurnCache(NamedTuple):
    """What a turn leaves for the next: the KV cache (see the module for its layout), the
    prompts' mask (B, Q), with a repetition penalty the tokens each row holds so far (B, V)
    bool (else None), and the position of each row's first response token (B,) (a row's
    real prompt tokens counted, or an `ImagePrompt`'s next positions)."""

    cache: Any
    prompt_mask: jax.Array
    seen: Optional[jax.Array] = None
    first_position: Optional[jax.Array] = None


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


class TurnInput(NamedTuple):
    """What the host gives a later turn: row i's `new_lengths[i]` tokens `new_tokens[i,
    :new_lengths[i]]` (int (B, N): the response tokens not yet in the cache, from response
    index `new_start[i]` on: the last turn's final token and the observation after it), and
    the turn's budgets `max_lengths` (B,) or None (`turn_length` each)."""

    new_tokens: jax.Array
    new_start: jax.Array
    new_lengths: jax.Array
    max_lengths: Optional[jax.Array] = None


@functools.partial(jax.jit, static_argnames=("model", "budget", "num_generations"))
def _first_turn_jit(model, params, prompt_ids, prompt_mask, key, sampling, max_lengths, *, budget, num_generations):
    out, cache, seen = _sample(model, params, prompt_ids, prompt_mask, key, sampling, max_lengths, num_generations)
    return out, _widen(cache, budget, _slot_axis(model)), seen


@functools.partial(jax.jit, static_argnames=("model", "piece"), donate_argnames=("cache",))
def _next_turn_jit(model, params, cache, prompt_rows, seen, turn: TurnInput, key, sampling, *, piece):
    """`prompt_rows`: (the prompts' mask (B, Q), each row's first response position (B,))."""
    model, params = model.for_decoding(params)
    prompt_mask, real = prompt_rows
    b, q = prompt_mask.shape
    prompt_mask = prompt_mask.astype(jnp.int32)
    grouped = isinstance(cache, GroupedKV) or isinstance(cache[0], GroupedKV)
    slots = jax.tree.leaves(cache)[-1].shape[_slot_axis(model)]  # the last layer's v: (..., B, slots, KV, D)
    response_slots = slots if grouped else slots - q
    new_start, new_lengths = turn.new_start, turn.new_lengths
    used = new_start + new_lengths  # each row's response tokens once the new ones are in
    # Every response token up to `used` is real (model turns and observations alike); the
    # causal mask keeps each new token from the ones after it.
    kv_mask = jnp.concatenate([prompt_mask, (jnp.arange(response_slots)[None, :] < used[:, None]).astype(jnp.int32)],
                              axis=1)

    def feed(carry, k):
        """The new tokens' k-th piece of `piece` tokens, at each row's own slots; a row whose
        new tokens ended before it writes pad at its end (masked, overwritten later)."""
        cache, hidden = carry
        tokens = jax.lax.dynamic_slice_in_dim(turn.new_tokens, k * piece, piece, axis=1)
        n = jnp.clip(new_lengths - k * piece, 0, piece)  # real tokens of each row in this piece
        at = jnp.minimum(new_start + k * piece, used)  # the response slot of the piece's first token
        offsets = jnp.minimum(jnp.arange(piece)[None, :], jnp.maximum(n - 1, 0)[:, None])  # pad: the last real one's
        positions = cap_positions(model, real[:, None] + at[:, None] + offsets)
        h, _, cache = model.module.apply(params, tokens, kv_mask, positions, cache, q + at, return_hidden=True)
        last = jnp.take_along_axis(h, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
        return (cache, jnp.where((n > 0)[:, None], last, hidden)), None

    pieces = turn.new_tokens.shape[1] // piece
    hidden = jnp.zeros((b, model.config.hidden_size), model.dtype)
    (cache, hidden), _ = jax.lax.scan(feed, (cache, hidden), jnp.arange(pieces))
    next_logits = model.lm_head(params).logits(hidden)
    if seen is not None:  # the new tokens join the ones the penalty sees
        seen = seen | seen_tokens(turn.new_tokens, jnp.arange(turn.new_tokens.shape[1])[None, :] < new_lengths[:, None],
                                  seen.shape[1])
    start = Prefilled(next_logits, kv_mask, q + used, real + used, jax.random.split(key, b))
    return decode_loop(model, params, cache, start, sampling, turn.max_lengths, seen)


def _turn_sampling(model, prompt_ids, prompt_mask, sampling: Sampling, turn_length: int) -> Sampling:
    """The checked `Sampling` of one turn: `turn_length` tokens (early stopping on) of a
    response budget of `sampling.response_length`."""
    budget = sampling.response_length
    if not isinstance(budget, int) or not isinstance(turn_length, int) or not 0 < turn_length <= budget:
        raise ValueError(f"turn_length={turn_length!r} and the response budget (response_length={budget!r}) must be "
                         "ints with 0 < turn_length <= response_length")
    checked = check_sampler_arguments(model, prompt_ids, prompt_mask, sampling, budget=budget)
    return dataclasses.replace(checked, response_length=turn_length, early_stop=True)


def first_turn(model, params, prompt_ids, prompt_mask, key, sampling: Optional[Sampling] = None, *, turn_length: int,
               num_generations: int = 1, max_lengths=None, **settings):
    """The first turn of multi-turn sampling: `generate`'s tokens for `turn_length` tokens
    (`max_lengths` the rows' budgets for this turn; `settings` as `generate`'s), and a
    `TurnCache` with room for `sampling.response_length` response tokens (R: every turn and
    observation of an episode) for `next_turn`. Returns (`GenerationOutput` (B, L),
    `TurnCache`)."""
    sampling = Sampling.of(sampling, **settings)
    prompt, prompt_ids = sampler_prompt(model, prompt_ids, prompt_mask)
    turn = _turn_sampling(model, prompt_ids, prompt_mask, sampling, turn_length)
    max_lengths = check_max_lengths(max_lengths, prompt_ids.shape[0], turn_length)
    prompt_mask = jnp.asarray(prompt_mask, jnp.int32)
    out, cache, seen = _first_turn_jit(model, params, prompt, prompt_mask, key, turn, max_lengths,
                                       budget=sampling.response_length, num_generations=num_generations)
    first = prompt.next_position if isinstance(prompt, ImagePrompt) else jnp.sum(prompt_mask, axis=1)
    return out, TurnCache(cache, prompt_mask, seen, first)


def piece_width(longest: int, turn_length: int) -> int:
    """The width of the pieces a turn's new tokens are fed in: a power of two >= 8 that
    covers the longest row's, at most the turn length (longer ones take several pieces),
    so that few shapes compile."""
    return min(turn_length, max(8, 1 << max(0, longest - 1).bit_length()))


def next_turn(model, params, state: TurnCache, turn: TurnInput, key, sampling: Optional[Sampling] = None, *,
              turn_length: int, place=lambda x: x, **settings):
    """A later turn: `turn`'s new tokens (a `TurnInput`: host arrays) are fed onto the
    cache, and then `turn_length` tokens are sampled after them (at most
    `turn.max_lengths[i]` for row i; `sampling` and `settings` as `first_turn`'s). `place`
    puts an array where the rows live (a mesh). The state passed in is consumed (its cache
    is donated). Returns (`GenerationOutput` (B, L), `TurnCache`)."""
    sampling = Sampling.of(sampling, **settings)
    new_tokens, new_start, new_lengths = (np.asarray(x, np.int32) for x in turn[:3])
    b, budget = new_tokens.shape[0], sampling.response_length
    if new_start.shape != (b,) or new_lengths.shape != (b,):
        raise ValueError(f"new_start {new_start.shape} and new_lengths {new_lengths.shape} must be ({b},)")
    used = new_start + new_lengths
    if (new_lengths < 0).any() or (new_start < 0).any() or (used > budget).any() or (
            new_lengths > new_tokens.shape[1]).any():
        raise ValueError(f"new tokens outside the response budget: starts {new_start.tolist()}, lengths "
                         f"{new_lengths.tolist()}, each start + length must be <= response_length={budget}")
    checked = _turn_sampling(model, state.prompt_mask, state.prompt_mask, sampling, turn_length)
    max_lengths = check_max_lengths(turn.max_lengths, b, turn_length)
    piece = piece_width(int(new_lengths.max(initial=0)), turn_length)
    pieces = max(1, -(-int(new_lengths.max(initial=0)) // piece))
    padded = np.full((b, pieces * piece), checked.pad_token_id, np.int32)
    width = min(new_tokens.shape[1], pieces * piece)
    padded[:, :width] = new_tokens[:, :width]
    placed = TurnInput(place(padded), place(new_start), place(new_lengths),
                       None if max_lengths is None else place(np.asarray(max_lengths)))
    first = state.first_position
    first = jnp.sum(jnp.asarray(state.prompt_mask, jnp.int32), axis=1) if first is None else first
    out, cache, seen = _next_turn_jit(model, params, state.cache, (state.prompt_mask, first), state.seen, placed, key,
                                      checked, piece=piece)
    return out, TurnCache(cache, state.prompt_mask, seen, first)


class StaticEngine(BuiltinEngine):
    """The static sampler (`generate`): every row decoded together until the last one
    stops, each group's prompt prefilled once; with `turn_cache`, multi-turn episodes keep
    each row's KV cache between turns (`first_turn`, `next_turn`)."""

    capabilities = Capabilities(multi_turn=True, turn_cache=True, meshes=True, exact_logprobs=True, images=True)

    def sample(self, prompt_ids, prompt_mask, key, *, num_generations: int, response_length: int,
               max_lengths=None, temperature: Optional[float] = None) -> GenerationOutput:
        return generate(self.spec.policy, self.params, prompt_ids, prompt_mask, key, self.sampling(temperature),
                        response_length=response_length, num_generations=num_generations, max_lengths=max_lengths,
                        common_prefix=self.prefix_of(prompt_ids, prompt_mask, num_generations))

    def prefix_of(self, prompt_ids, prompt_mask, num_generations: int) -> int:
        """The run's common prefix (`RolloutSpec.common_prefix`) where these prompts begin
        with it (the training batches do; an evaluation's prompts may not) and the sampler
        can prefill it once (`effective_prefix`), else 0 (always with images)."""
        if isinstance(prompt_ids, ImagePrompt):
            return 0
        prefix = effective_prefix(self.spec.policy, self.spec.common_prefix, num_generations, prompt_ids.shape[1])
        return prefix if prefix and shares_prefix(prompt_ids, prompt_mask, prefix) else 0

    def first_turn(self, prompt_ids, prompt_mask, key, *, num_generations: int, turn_length: int, max_lengths,
                   temperature: Optional[float] = None):
        """The first turn of multi-turn episodes, its KV cache kept (`first_turn`)."""
        return first_turn(self.spec.policy, self.params, prompt_ids, prompt_mask, key, self.sampling(temperature),
                          turn_length=turn_length, num_generations=num_generations, max_lengths=max_lengths)

    def next_turn(self, state, turn: TurnInput, key, *, turn_length: int, place, temperature: Optional[float] = None):
        """A later turn from the kept cache: only the tokens new since it are fed (`next_turn`)."""
        return next_turn(self.spec.policy, self.params, state, turn, key, self.sampling(temperature),
                         turn_length=turn_length, place=place)
