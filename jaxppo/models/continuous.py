"""Continuous batching: a slot engine that decodes `num_slots` rows together and refills a
finished row's slot with the next pending request, until every request is done.

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
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxppo.models.generate import (GenerationOutput, check_max_lengths, check_sampler_arguments, pick_tokens, prefill,
                                    step_keys)
from jaxppo.models.model import Model

__all__ = ["generate_continuous", "continuous_jit"]


@functools.partial(jax.jit, static_argnames=("model", "response_length", "num_slots", "top_k", "use_top_p", "greedy",
                                             "stop_token_ids", "pad_token_id"))
def continuous_jit(model, params, prompt_ids, prompt_mask, key, temperature, top_p, max_lengths=None, *,
                   response_length, num_slots, top_k, use_top_p, greedy, stop_token_ids, pad_token_id):
    """The compiled engine behind `generate_continuous`."""
    model, params = model.for_decoding(params)  # `Model.hoist_layers`
    n, q = prompt_ids.shape
    r, s = response_length, num_slots
    prompt_mask = prompt_mask.astype(jnp.int32)
    req_keys = jax.random.split(key, n)
    first_position = jnp.sum(prompt_mask, axis=1)  # the position of each request's first response token
    stop_ids = jnp.asarray(stop_token_ids if stop_token_ids else (-1,), jnp.int32)
    batch_axis = 1 if model.scan_layers else 0

    # The first S requests fill the slots with one prefill.
    cache, next_logits = prefill(model, params, prompt_ids[:s], prompt_mask[:s], q + r)
    kv_mask = jnp.concatenate([prompt_mask[:s], jnp.zeros((s, r), jnp.int32)], axis=1)
    slot_req = jnp.arange(s, dtype=jnp.int32)
    slot_t = jnp.zeros((s,), jnp.int32)
    active = jnp.ones((s,), bool)
    outputs = (jnp.full((n, r), pad_token_id, jnp.int32), jnp.zeros((n, r), jnp.float32), jnp.zeros((n, r), jnp.int32))

    def admit(state):
        """Prefill the next pending request into the first free slot."""
        cache, next_logits, kv_mask, slot_req, slot_t, active, next_req = state
        j = jnp.argmin(active)  # the first free slot
        ids = jax.lax.dynamic_slice_in_dim(prompt_ids, next_req, 1, axis=0)
        mask = jax.lax.dynamic_slice_in_dim(prompt_mask, next_req, 1, axis=0)
        row_cache, row_logits = prefill(model, params, ids, mask, q + r)
        cache = jax.tree.map(lambda buf, row: jax.lax.dynamic_update_slice_in_dim(buf, row.astype(buf.dtype), j,
                                                                                  axis=batch_axis), cache, row_cache)
        next_logits = jax.lax.dynamic_update_slice_in_dim(next_logits, row_logits.astype(next_logits.dtype), j, axis=0)
        row_mask = jnp.concatenate([mask, jnp.zeros((1, r), jnp.int32)], axis=1)
        kv_mask = jax.lax.dynamic_update_slice_in_dim(kv_mask, row_mask, j, axis=0)
        return (cache, next_logits, kv_mask, slot_req.at[j].set(next_req), slot_t.at[j].set(0),
                active.at[j].set(True), next_req + 1)

    def body(state):
        (cache, next_logits, kv_mask, slot_req, slot_t, active, next_req), (tokens, logprobs, masks) = state
        token, logprob = pick_tokens(next_logits, step_keys(req_keys[slot_req], slot_t), temperature, top_k,
                               top_p if use_top_p else None, greedy)
        # Write each active slot's token into its request's row (inactive slots write nowhere).
        rows = jnp.where(active, slot_req, n)
        tokens = tokens.at[rows, slot_t].set(token, mode="drop")
        logprobs = logprobs.at[rows, slot_t].set(logprob, mode="drop")
        masks = masks.at[rows, slot_t].set(1, mode="drop")
        budget = r if max_lengths is None else max_lengths[slot_req]
        finished = active & (jnp.isin(token, stop_ids) | (slot_t + 1 >= budget))
        going_on = active & ~finished
        # Feed the token back for the rows that go on (the others' results are not read).
        kv_mask = kv_mask.at[jnp.arange(s), q + jnp.minimum(slot_t, r - 1)].set(going_on.astype(jnp.int32))
        positions = first_position[slot_req] + slot_t
        logits, cache = model.decode(params, token[:, None], kv_mask, positions[:, None], cache,
                                     q + jnp.minimum(slot_t, r - 1))
        next_logits = logits[:, 0]
        slot_t = slot_t + 1
        state = (cache, next_logits, kv_mask, slot_req, slot_t, going_on, next_req)
        state = jax.lax.while_loop(lambda st: ~jnp.all(st[5]) & (st[6] < n), admit, state)
        return state, (tokens, logprobs, masks)

    init = ((cache, next_logits, kv_mask, slot_req, slot_t, active, jnp.int32(s)), outputs)
    _, (tokens, logprobs, masks) = jax.lax.while_loop(lambda st: jnp.any(st[0][5]), body, init)
    return GenerationOutput(tokens, logprobs, masks)


def generate_continuous(
    model: Model,
    params,
    prompt_ids,
    prompt_mask,
    key,
    *,
    response_length: int,
    num_slots: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    greedy: bool = False,
    stop_token_ids: Optional[Sequence[int]] = None,
    pad_token_id: Optional[int] = None,
    max_lengths=None,
) -> GenerationOutput:
    """Sample `response_length` tokens for each of N left-padded prompts with a slot engine
    of `num_slots` rows (continuous batching; see the module). The arguments and the
    result are `jaxppo.models.generate`'s, and so are the tokens for the same key; only
    `num_slots` is new (capped at N). Rows end at a stop token (kept, masked in), at
    `response_length`, or at their `max_lengths` entry (optional (N,) budgets); after that a
    row is pad, log-prob 0, mask 0."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots={num_slots!r} must be a positive int (rows decoded together)")
    stop_token_ids, pad_token_id = check_sampler_arguments(model, prompt_ids, prompt_mask, response_length, temperature,
                                                    top_k, top_p, stop_token_ids, pad_token_id, max_lengths)
    return continuous_jit(
        model, params, jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32), key,
        jnp.float32(temperature), jnp.float32(1.0 if top_p is None else top_p),
        check_max_lengths(max_lengths, prompt_ids.shape[0], response_length), response_length=response_length,
        num_slots=min(num_slots, prompt_ids.shape[0]), top_k=top_k, use_top_p=top_p is not None,
        greedy=bool(greedy), stop_token_ids=stop_token_ids, pad_token_id=int(pad_token_id))
