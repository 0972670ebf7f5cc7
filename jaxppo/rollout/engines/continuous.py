"""Continuous batching: a sampler that decodes `num_slots` rows together and refills a
finished row's slot with the next pending request, until every request is done; and
`ContinuousEngine`, the built-in rollout engine that runs it.

    generate_continuous(model, params, prompt_ids (N, Q), prompt_mask, key,
                        response_length=R, num_slots=S) -> GenerationOutput (N, R)

Shapes are static throughout (one compile per N, Q, R, S): the KV cache holds S rows of
Q + R slots; each decode step runs all S rows, each at its own cache slot (a per-row cache
index); a refill prefills one request's prompt into the freed row. Request i samples from
`split(key, N)[i]` alone (step t from `fold_in` of it with t), exactly as the static
sampler's row i does, so its tokens do not depend on which slot it ran in or when, and
equal `generate`'s for the same key.

Why: with long-tailed response lengths, the static sampler keeps every row of the batch
in the decode until the longest one ends. Here a row that ends frees its slot at once, so
the decode runs S rows for about (total tokens) / S steps instead of N rows for the longest
response's steps.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxppo.models.decoding import (GenerationOutput, cap_positions, check_max_lengths, check_sampler_arguments,
                                    note_token, pick_tokens, prefill, seen_tokens, step_keys)
from jaxppo.models.model import Model
from jaxppo.models.sampling import Sampling
from jaxppo.models.vision import ImagePrompt
from jaxppo.models.vision.prompt import positions_like
from jaxppo.rollout.engines.base import BuiltinEngine, Capabilities
from jaxppo.rollout.engines.static import sampler_prompt
from jaxppo.models.transformer import default_positions

__all__ = ["generate_continuous", "continuous_jit", "generate_inflight", "ON_UPDATE", "ContinuousEngine"]


class _Requests(NamedTuple):
    """The requests and the sampling settings that are arrays: fixed for a generation."""

    prompt_ids: jax.Array  # (N, Q), left-padded
    prompt_mask: jax.Array  # (N, Q) int32
    keys: jax.Array  # (N,) request i's key: split(key, N)[i]
    first_position: jax.Array  # (N,) the position of each request's first response token
    max_lengths: Optional[jax.Array]  # (N,) budgets, or None: response_length
    sampling: Sampling  # checked (`Sampling.check`)
    images: Optional[ImagePrompt] = None  # a vision-language model's images of the requests (its ids None)

    def prompts(self, take):
        """The requests' prompts as the prefill takes them, `take` applied to each array
        (a slice of rows): the ids, or the `ImagePrompt` with its images."""
        ids = take(self.prompt_ids)
        return ids if self.images is None else jax.tree.map(take, self.images)._replace(ids=ids)


class _Slots(NamedTuple):
    """The engine's state: S rows of KV cache and what each holds."""

    cache: Any
    next_logits: jax.Array  # (S, V): the logits of each slot's next token
    kv_mask: jax.Array  # (S, Q + R): the valid cache slots
    req: jax.Array  # (S,) the request in each slot
    t: jax.Array  # (S,) tokens the slot's request has sampled
    active: jax.Array  # (S,) bool
    next_req: jax.Array  # the next pending request
    version: jax.Array  # (S,) the parameters' version behind each slot's next_logits
    seen: Optional[jax.Array]  # (S, V) bool: the tokens each slot's request holds (a repetition penalty), or None
    matched: Optional[jax.Array]  # (S, K): each slot's stop-string automata states, or None


class _Out(NamedTuple):
    tokens: jax.Array
    logprobs: jax.Array
    masks: jax.Array
    versions: jax.Array  # (N, R) int32: the version of the parameters each token was sampled from
    full_logprobs: Optional[jax.Array]  # (N, R): the policy's own log-probs where a filter or penalty is on, or None


def _requests(prompt_ids, prompt_mask, key, max_lengths, sampling: Sampling) -> _Requests:
    """The requests of prompts `prompt_ids` (token ids, or an `ImagePrompt`: each first
    response token then at its row's next rotary position)."""
    mask = prompt_mask.astype(jnp.int32)
    if isinstance(prompt_ids, ImagePrompt):
        images, ids = prompt_ids._replace(ids=None), prompt_ids.ids
        return _Requests(ids, mask, jax.random.split(key, ids.shape[0]), images.next_position, max_lengths, sampling,
                         images)
    return _Requests(prompt_ids, mask, jax.random.split(key, prompt_ids.shape[0]), jnp.sum(mask, axis=1), max_lengths,
                     sampling)


def _row_state(reqs: _Requests, ids, mask, vocab: int):
    """(seen, matched) of rows starting on prompts `ids`/`mask`: None where off."""
    seen = None if reqs.sampling.repetition_penalty is None else seen_tokens(ids, mask, vocab)
    table = reqs.sampling.stop_table
    return seen, None if table is None else jnp.zeros((ids.shape[0], table.shape[0]), jnp.int32)


def _start(model, params, reqs: _Requests, version, num_slots: int):
    """The first S requests in the slots (one prefill) and empty outputs."""
    (n, q), r, s = reqs.prompt_ids.shape, reqs.sampling.response_length, num_slots
    cache, next_logits = prefill(model, params, reqs.prompts(lambda a: a[:s]), reqs.prompt_mask[:s], q + r)
    kv_mask = jnp.concatenate([reqs.prompt_mask[:s], jnp.zeros((s, r), jnp.int32)], axis=1)
    slots = _Slots(cache, next_logits, kv_mask, jnp.arange(s, dtype=jnp.int32), jnp.zeros((s,), jnp.int32),
                   jnp.ones((s,), bool), jnp.int32(s), jnp.full((s,), version, jnp.int32),
                   *_row_state(reqs, reqs.prompt_ids[:s], reqs.prompt_mask[:s], next_logits.shape[-1]))
    out = _Out(jnp.full((n, r), reqs.sampling.pad_token_id, jnp.int32), jnp.zeros((n, r), jnp.float32),
               jnp.zeros((n, r), jnp.int32), jnp.zeros((n, r), jnp.int32),
               jnp.zeros((n, r), jnp.float32) if reqs.sampling.two_logprobs else None)
    return slots, out


def _admit(model, params, reqs: _Requests, version, slots: _Slots) -> _Slots:
    """Prefill the next pending request into the first free slot."""
    q, r = reqs.prompt_ids.shape[1], reqs.sampling.response_length
    batch_axis = 1 if model.scan_layers else 0
    j = jnp.argmin(slots.active)  # the first free slot
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, slots.next_req, 1, axis=0)  # noqa: E731
    ids, mask = take(reqs.prompt_ids), take(reqs.prompt_mask)
    row_cache, row_logits = prefill(model, params, reqs.prompts(take), mask, q + r)
    cache = jax.tree.map(lambda buf, row: jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), j,
                                                                              axis=batch_axis), slots.cache, row_cache)
    next_logits = jax.lax.dynamic_update_slice_in_dim(slots.next_logits, row_logits.astype(slots.next_logits.dtype), j,
                                                      axis=0)
    row_mask = jnp.concatenate([mask, jnp.zeros((1, r), jnp.int32)], axis=1)
    kv_mask = jax.lax.dynamic_update_slice_in_dim(slots.kv_mask, row_mask, j, axis=0)
    row_seen, row_matched = _row_state(reqs, ids, mask, slots.next_logits.shape[-1])
    put = lambda buf, row: None if buf is None else jax.lax.dynamic_update_slice_in_dim(buf, row, j, axis=0)
    return _Slots(cache, next_logits, kv_mask, slots.req.at[j].set(slots.next_req), slots.t.at[j].set(0),
                  slots.active.at[j].set(True), slots.next_req + 1, slots.version.at[j].set(version),
                  put(slots.seen, row_seen), put(slots.matched, row_matched))


def _step(model, params, reqs: _Requests, version, slots: _Slots, out: _Out):
    """One decode step of every slot, then the free slots refilled."""
    (n, q), r, s = reqs.prompt_ids.shape, reqs.sampling.response_length, slots.req.shape[0]
    stop_ids = jnp.asarray(reqs.sampling.stop_token_ids or (-1,), jnp.int32)
    token, logprob, policy = pick_tokens(slots.next_logits, step_keys(reqs.keys[slots.req], slots.t), reqs.sampling,
                                         slots.seen)
    # Write each active slot's token into its request's row (inactive slots write nowhere).
    rows, t = jnp.where(slots.active, slots.req, n), slots.t
    out = _Out(out.tokens.at[rows, t].set(token, mode="drop"), out.logprobs.at[rows, t].set(logprob, mode="drop"),
               out.masks.at[rows, t].set(1, mode="drop"), out.versions.at[rows, t].set(slots.version, mode="drop"),
               None if out.full_logprobs is None else out.full_logprobs.at[rows, t].set(policy, mode="drop"))
    budget = r if reqs.max_lengths is None else reqs.max_lengths[slots.req]
    seen, matched, completed = note_token(reqs.sampling, token, slots.active, slots.seen, slots.matched)
    finished = slots.active & (jnp.isin(token, stop_ids) | (t + 1 >= budget) | completed)
    going_on = slots.active & ~finished
    # Feed the token back for the rows that go on (the others' results are not read).
    kv_mask = slots.kv_mask.at[jnp.arange(s), q + jnp.minimum(t, r - 1)].set(going_on.astype(jnp.int32))
    positions = cap_positions(model, reqs.first_position[slots.req] + t)
    logits, cache = model.decode(params, token[:, None], kv_mask, positions[:, None], slots.cache,
                                 q + jnp.minimum(t, r - 1))
    slots = _Slots(cache, logits[:, 0], kv_mask, slots.req, t + 1, going_on, slots.next_req,
                   jnp.where(going_on, version, slots.version), seen, matched)
    slots = jax.lax.while_loop(lambda sl: ~jnp.all(sl.active) & (sl.next_req < n),
                               lambda sl: _admit(model, params, reqs, version, sl), slots)
    return slots, out


@functools.partial(jax.jit, static_argnames=("model", "num_slots"))
def continuous_jit(model, params, prompt_ids, prompt_mask, key, sampling: Sampling, max_lengths=None, *, num_slots):
    """The compiled engine behind `generate_continuous` (arguments checked there): the whole
    generation as one program."""
    reqs = _requests(prompt_ids, prompt_mask, key, max_lengths, sampling)
    model, params = model.for_decoding(params)  # `Model.hoist_layers`
    slots, out = _start(model, params, reqs, 0, num_slots)
    _, out = jax.lax.while_loop(lambda state: jnp.any(state[0].active),
                                lambda state: _step(model, params, reqs, 0, *state), (slots, out))
    return GenerationOutput(out.tokens, out.logprobs, out.masks, out.full_logprobs)


@functools.partial(jax.jit, static_argnames=("model", "num_slots"))
def _start_jit(model, params, reqs, version, *, num_slots):
    model, params = model.for_decoding(params)
    return _start(model, params, reqs, version, num_slots)


@functools.partial(jax.jit, static_argnames=("model",), donate_argnums=(4, 5))
def _steps_jit(model, params, reqs, version, slots, out, max_steps):
    """At most `max_steps` decode steps (fewer when every request is done)."""
    model, params = model.for_decoding(params)
    step = lambda state: (*_step(model, params, reqs, version, state[0], state[1]), state[2] + 1)
    slots, out, _ = jax.lax.while_loop(lambda state: jnp.any(state[0].active) & (state[2] < max_steps), step,
                                       (slots, out, jnp.int32(0)))
    return slots, out


@functools.partial(jax.jit, static_argnames=("model",), donate_argnums=(4,))
def _recompute_jit(model, params, reqs, version, slots: _Slots, out: _Out):
    """Every active slot's KV cache and next logits computed again with `params`: its
    prompt and the tokens it sampled, in the engine's own layout (prompt slots, then
    response token j at slot Q + j), one forward over the whole width."""
    model, params = model.for_decoding(params)
    q, r = reqs.prompt_ids.shape[1], reqs.sampling.response_length
    rows = slots.req
    ids = jnp.concatenate([reqs.prompt_ids[rows], out.tokens[rows]], axis=1)
    after = reqs.first_position[rows][:, None] + jnp.arange(r)[None]
    images = None
    if reqs.images is None:
        positions = jnp.concatenate([default_positions(reqs.prompt_mask[rows]), after], axis=1)
    else:  # the prompt's positions, then the responses' (equal on the three axes of 3-D ones)
        prompt_positions = reqs.images.positions[rows]
        positions = jnp.concatenate([prompt_positions, positions_like(after, prompt_positions.ndim)], axis=1)
        images = jax.tree.map(lambda a: a[rows], reqs.images.images)
    cache = model.init_cache(ids.shape[0], q + r)
    hidden, _, cache = model.module.apply(params, ids, slots.kv_mask, cap_positions(model, positions), cache, 0,
                                          return_hidden=True, images=images)
    at = q + slots.t - 1  # each row's last fed token: its last prompt token when it has sampled none
    logits = model.lm_head(params).logits(jnp.take_along_axis(hidden, at[:, None, None], axis=1))[:, 0]
    cache_axis = 1 if model.scan_layers else 0  # the slot axis: behind the stacked layers' when scanned
    return slots._replace(cache=_where_rows(slots.active, cache, slots.cache, cache_axis),
                          next_logits=_where_rows(slots.active, logits.astype(slots.next_logits.dtype),
                                                  slots.next_logits),
                          version=jnp.where(slots.active, version, slots.version))


def _where_rows(rows, new, old, axis: int = 0):
    """The tree `new` at the slots where `rows` (S,) is true (slots along `axis`), `old`
    elsewhere."""

    def pick(a, b):
        shape = [1] * a.ndim
        shape[axis] = rows.shape[0]
        return jnp.where(rows.reshape(shape), a, b.astype(a.dtype))

    return jax.tree.map(pick, new, old)


ON_UPDATE = ("keep", "recompute")


def generate_inflight(model: Model, params_source: Callable, prompt_ids, prompt_mask, key,
                      sampling: Optional[Sampling] = None, *, num_slots: int, steps_per_check: int = 8,
                      on_update: str = "keep", **settings):
    """The continuous sampler taking new parameters while it generates: in-flight
    weight updates (`sampling` and `settings` as `generate_continuous`'s).

    `params_source()` -> (version: int, params) is asked before the first step and after
    every `steps_per_check` decode steps; when its version differs from the one in use,
    the engine continues with the new parameters. `on_update`: "keep" (each row's KV
    cache stays as it was computed, by the parameters of its time: the next token of each
    row is still drawn from logits of the old parameters, every later one from the new
    parameters over the kept cache) or "recompute" (every active row's cache and next
    logits are computed again with the new parameters over its prompt and the tokens it
    sampled, one forward of the S slots: every later token is drawn from the new policy
    given its whole context).

    Returns (`GenerationOutput`, versions): versions int32 (N, R) holds the version of the
    parameters whose logits each token was drawn from (0 where masked). Without an update
    the tokens are `generate_continuous`'s (and so `generate`'s) for the same key."""
    if on_update not in ON_UPDATE:
        raise ValueError(f"on_update={on_update!r} is invalid; valid: 'keep' (each row's KV cache kept) or "
                         "'recompute' (every active row's cache computed again with the new parameters)")
    if isinstance(steps_per_check, bool) or not isinstance(steps_per_check, int) or steps_per_check < 1:
        raise ValueError(f"steps_per_check={steps_per_check!r} must be a positive int (decode steps between "
                         "checks for new parameters)")
    _check_slots(num_slots)
    prompt, prompt_ids = sampler_prompt(model, prompt_ids, prompt_mask)
    sampling = check_sampler_arguments(model, prompt_ids, prompt_mask, Sampling.of(sampling, **settings))
    n = prompt_ids.shape[0]
    reqs = _requests(prompt, jnp.asarray(prompt_mask, jnp.int32), key, None, sampling)
    version, params = params_source()
    slots, out = _start_jit(model, params, reqs, jnp.int32(version), num_slots=min(num_slots, n))
    while True:
        slots, out = _steps_jit(model, params, reqs, jnp.int32(version), slots, out, jnp.int32(steps_per_check))
        if not bool(jnp.any(slots.active)):
            break
        new_version, new_params = params_source()
        if new_version != version:
            version, params = new_version, new_params
            if on_update == "recompute":
                slots = _recompute_jit(model, params, reqs, jnp.int32(version), slots, out)
    return GenerationOutput(out.tokens, out.logprobs, out.masks, out.full_logprobs), out.versions


def _check_slots(num_slots):
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots={num_slots!r} must be a positive int (rows decoded together)")


def generate_continuous(model: Model, params, prompt_ids, prompt_mask, key, sampling: Optional[Sampling] = None, *,
                        num_slots: int, max_lengths=None, **settings) -> GenerationOutput:
    """Sample `sampling.response_length` tokens for each of N left-padded prompts with a
    slot loop of `num_slots` rows (continuous batching; see the module). The arguments
    (`settings`: fields of `Sampling` that replace `sampling`'s) and the result are
    `jaxppo.rollout.engines.static.generate`'s, and so are the tokens for the same key;
    only `num_slots` is new (capped at N). Rows end at a stop token (kept, masked in), at
    the response length, or at their `max_lengths` entry (optional (N,) budgets); after
    that a row is pad, log-prob 0, mask 0. `prompt_ids` may be a vision-language model's
    `ImagePrompt` (each request prefilled with its images when it takes a slot)."""
    _check_slots(num_slots)
    prompt, prompt_ids = sampler_prompt(model, prompt_ids, prompt_mask)
    sampling = check_sampler_arguments(model, prompt_ids, prompt_mask, Sampling.of(sampling, **settings), max_lengths)
    return continuous_jit(
        model, params, prompt, jnp.asarray(prompt_mask, jnp.int32), key, sampling,
        check_max_lengths(max_lengths, prompt_ids.shape[0], sampling.response_length),
        num_slots=min(num_slots, prompt_ids.shape[0]))


class ContinuousEngine(BuiltinEngine):
    """Continuous batching (`generate_continuous`): `spec.num_slots` rows
    decode together and a row that ends frees its slot for the next request; the same
    tokens as the static sampler for the same key. Takes new weights while it decodes
    (`sample_inflight`)."""

    capabilities = Capabilities(continuous_batching=True, inflight_updates=True, multi_turn=True, meshes=True,
                                exact_logprobs=True, images=True)

    def sample(self, prompt_ids, prompt_mask, key, *, num_generations: int, response_length: int,
               max_lengths=None, temperature: Optional[float] = None) -> GenerationOutput:
        return generate_continuous(self.spec.policy, self.params, prompt_ids, prompt_mask, key,
                                   self.sampling(temperature), num_slots=self.spec.num_slots,
                                   max_lengths=max_lengths, response_length=response_length)

    def sample_inflight(self, source, prompt_ids, prompt_mask, key, *, on_update: str, steps: int):
        spec = self.spec

        def policy_source():
            version, params = source()
            return version, spec.policy_params(params)

        return generate_inflight(spec.policy, policy_source, prompt_ids, prompt_mask, key, self.sampling(),
                                 num_slots=spec.num_slots, steps_per_check=steps, on_update=on_update)


