"""The decoding primitives the samplers are made of (`jaxppo.rollout.engines`): prefill a
KV cache after left-padded prompts, the decode loop that feeds each sampled token back,
picking tokens (repetition penalty, temperature, top-k, min-p, top-p) with per-row keys,
stop strings matched token by token (`jaxppo.models.stops`), and the checks of a sampler's
arguments. What a sampler returns is a `GenerationOutput`.

The order a token is picked in (vLLM's): the repetition penalty on the raw logits (a logit of
a token already in the row's prompt or response is divided by the penalty when positive,
multiplied by it when negative: Hugging Face's and vLLM's rule), then the temperature, then
top-k and min-p (both keep a prefix of the tokens by probability, so their order does not
matter), then top-p over what is left (its mass renormalised); one draw from the result.
`GenerationOutput.logprobs` are of that distribution, the one the token was drawn from."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.family import family_of
from jaxppo.models.model import Model
from jaxppo.models.sampling import Sampling
from jaxppo.models.transformer import default_positions
from jaxppo.models.vision.prompt import ImagePrompt

__all__ = ["prefill", "decode_loop", "Prefilled", "cap_positions", "GenerationOutput", "Sampling", "filter_logits",
           "pick_tokens", "step_keys", "stop_step", "strings_completed", "seen_tokens", "mark_seen", "note_token",
           "penalize", "inverse_cdf_index", "check_sampler_arguments", "check_max_lengths", "check_groups",
           "host_values", "prefill_common"]


class GenerationOutput(NamedTuple):
    """tokens: int32 (B, R), the response, `pad_token_id` after the first stop token (or
      after the token that completed a stop string).
    logprobs: float32 (B, R), log-prob of each token under the distribution it was drawn
      from (the behaviour policy): softmax(logits / temperature), after the repetition
      penalty and the top-k, min-p and top-p filters when they are on; 0 where masked.
      With `greedy`: softmax(logits / temperature) at the argmax.
    mask: int32 (B, R), 1 up to and including the first stop token, 0 after.
    full_logprobs: None when nothing reshapes the distribution (then `logprobs` are the
      policy's own), else float32 (B, R): each token's log-prob under the unpenalised,
      unfiltered softmax(logits / temperature), the distribution the PPO loss computes
      (the old policy's when `old_logprobs` takes the sampler's)."""

    tokens: jax.Array
    logprobs: jax.Array
    mask: jax.Array
    full_logprobs: Optional[jax.Array] = None

    @property
    def policy_logprobs(self):
        """The log-probs under the policy's own temperature-scaled distribution."""
        return self.logprobs if self.full_logprobs is None else self.full_logprobs


def _largest_threshold(p, accepted):
    """Per row of `p` (B, V), float32 >= 0: the largest t with `accepted(p >= t)` true, where
    `accepted` maps the (B, V) mask to (B,) and holds at t = 0 and fails above the row's
    largest value. Found by bisection over the float's bit patterns (monotone for values
    >= 0): 32 passes over the row, exact (t is one of the row's values), and far cheaper
    on a CPU than a sort of the vocabulary (450 ms per step for 32 rows of 49152 here, where
    this takes a few)."""
    bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    lo = jnp.zeros(p.shape[:-1], jnp.int32)
    hi = jnp.max(bits, axis=-1) + 1

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = accepted(p >= jax.lax.bitcast_convert_type(mid, jnp.float32)[..., None])
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)[..., None]


def filter_logits(logits, top_k: Optional[int], top_p, min_p=None):
    """Set logits outside the top-k, below min-p and outside the top-p nucleus to the
    dtype's lowest value (probability 0). (B, V) -> (B, V).

    top-k keeps the k most likely tokens; min-p the tokens whose probability is at least
    min_p times the most likely one's; top-p, of what those two left, the smallest set of
    most likely tokens whose renormalised probability reaches top_p (the most likely token
    always stays). Each keeps every token as likely as the last one it keeps (ties stay
    together). The cut-offs are found by bisection on the probabilities, not by sorting the
    vocabulary (`_largest_threshold`)."""
    if top_k is None and top_p is None and min_p is None:
        return logits
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    keep = jnp.ones(p.shape, bool)
    if top_k is not None and top_k < logits.shape[-1]:
        keep = p >= _largest_threshold(p, lambda kept: jnp.sum(kept, axis=-1) >= top_k)
    if min_p is not None:
        keep = keep & (p >= min_p * jnp.max(p, axis=-1, keepdims=True))
    if top_p is not None:
        q = jnp.where(keep, p, 0.0)
        need = top_p * jnp.sum(q, axis=-1)
        keep = keep & (q >= _largest_threshold(q, lambda kept: jnp.sum(jnp.where(kept, q, 0.0), axis=-1) >= need))
    return jnp.where(keep, logits, jnp.finfo(logits.dtype).min)


def _sample_inverse_cdf(keys, logits):
    """One draw per row from softmax(logits) (B, V) by inverting the CDF with a single
    uniform per row, drawn from that row's key (`keys`: (B,) typed keys). Exact in
    distribution, and far cheaper than Gumbel-max, which needs a random number per
    vocabulary entry (V of them per row and step)."""
    probs = jax.nn.softmax(logits, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    return inverse_cdf_index(probs, u)


def _first_above(cdf, u):
    """Per row, the first index whose cdf (B, N) exceeds u (B,), or N if none does."""
    return jnp.sum((cdf <= u[:, None]).astype(jnp.int32), axis=-1)


def _last_positive(p):
    """Per row, the last index of p (B, N) that is > 0."""
    n = p.shape[-1]
    return n - 1 - jnp.argmax(p[:, ::-1] > 0, axis=-1)


def inverse_cdf_index(probs, u):
    """The index i of each row of probs (B, V) with cdf[i - 1] <= u * total < cdf[i] (u in
    [0, 1), one per row): a draw from probs by inverting its CDF; never an index of
    probability 0. In two levels, blocks of C ~ sqrt(V) entries and then the entries of the
    chosen block, so that no step takes a cumulative sum over the whole vocabulary (XLA
    lowers a cumsum to a windowed reduction: over a 8192-token vocabulary it cost 8x a
    softmax on this CPU, about a tenth of a small model's decode step). Where rounding
    puts u * total past the last boundary, the last index of positive probability."""
    b, v = probs.shape
    c = 128 * max(1, -(-(math.isqrt(v - 1) + 1) // 128))  # a multiple of 128 >= sqrt(V)
    nb = -(-v // c)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * c - v))).reshape(b, nb, c)
    mass = jnp.sum(blocks, axis=-1)  # (B, nb)
    ends = jnp.cumsum(mass, axis=-1)
    target = u * ends[:, -1]
    j = _first_above(ends, target)
    past = j == nb  # past the last block's end: the last index of positive probability
    j = jnp.where(past, _last_positive(mass), j)
    block = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # (B, C)
    before = jnp.take_along_axis(ends - mass, j[:, None], axis=1)[:, 0]
    i = _first_above(jnp.cumsum(block, axis=-1), target - before)
    # The block's own sum and its running sum round apart: an index past its end, or one of
    # probability 0 before its first positive entry, becomes the nearest positive one.
    chosen = jnp.take_along_axis(block, jnp.minimum(i, c - 1)[:, None], axis=1)[:, 0]
    i = jnp.where(past | (i == c), _last_positive(block), jnp.where(chosen > 0, i, jnp.argmax(block > 0, axis=-1)))
    return (j * c + i).astype(jnp.int32)


def seen_tokens(ids, mask, vocab: int):
    """(B, V) bool: the tokens of each row of `ids` (B, N) where `mask` is set."""
    b = ids.shape[0]
    marks = jnp.zeros((b, vocab), jnp.int8).at[jnp.arange(b)[:, None], ids].max(mask.astype(jnp.int8), mode="drop")
    return marks > 0


def mark_seen(seen, token, live):
    """`seen` (B, V) with each live row's `token` (B,) marked (one entry per row)."""
    rows = jnp.arange(seen.shape[0])
    return seen.at[rows, token].set(seen[rows, token] | live)


def note_token(sampling: Sampling, token, live, seen, matched):
    """The per-row state after each row's new `token` (B,): `seen` with the live rows'
    token marked, the stop strings' states `matched` stepped (each None when off), and
    (B,) whether the token completed a stop string."""
    completed = jnp.zeros(token.shape, bool)
    if matched is not None:
        matched, completed = stop_step(sampling.stop_table, matched, token)
    if seen is not None:
        seen = mark_seen(seen, token, live)
    return seen, matched, completed


def penalize(logits, seen, penalty):
    """The repetition penalty (Hugging Face's and vLLM's rule) on the logits of the tokens
    `seen` (B, V): divided by `penalty` where positive, multiplied where not."""
    if seen is None:
        raise ValueError("a repetition penalty needs `seen`, the tokens each row holds (seen_tokens)")
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)


def _take(logprobs, token):
    return jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def pick_tokens(next_logits, keys, sampling: Sampling, seen=None):
    """Each row's next token, its log-prob under the distribution it was drawn from (see
    the module for the order), and its log-prob under the policy's own
    softmax(logits / temperature), or None when the two are the same distribution (no
    penalty or filter; or greedy, whose log-prob is the policy's). `seen` (B, V): the
    row's tokens so far, for the repetition penalty. Row i's randomness comes from keys[i]
    alone, so a row's tokens do not depend on which other rows are decoded beside it."""
    s = sampling
    logits = next_logits.astype(jnp.float32)
    policy = jax.nn.log_softmax(logits / s.temperature, axis=-1)
    if s.repetition_penalty is not None:
        logits = penalize(logits, seen, s.repetition_penalty)
    if s.greedy:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return token, _take(policy, token), None
    filtered = filter_logits(logits / s.temperature, s.top_k, s.top_p, s.min_p)
    token = _sample_inverse_cdf(keys, filtered)
    if not s.two_logprobs:
        return token, _take(policy, token), None
    return token, _take(jax.nn.log_softmax(filtered, axis=-1), token), _take(policy, token)


def step_keys(row_keys, t):
    """The keys of decode step `t` (a scalar or (B,)), one per row: fold_in(row key, t)."""
    return jax.vmap(jax.random.fold_in)(row_keys, jnp.broadcast_to(t, row_keys.shape))


def prefill(model, params, prompt_ids, prompt_mask, max_len: int, num_generations: int = 1):
    """The KV cache of `max_len` slots after the left-padded prompts, and the logits of each
    row's next token, (B, V). With `num_generations` G > 1 the rows come in groups of G
    equal prompts (consecutive rows): each group's prompt is run once, and its slots are
    kept once and shared by its G rows (a `GroupedKV`: each decode step reads them once
    per group), beside each row's own response slots. `prompt_ids` may be an `ImagePrompt`
    (a vision-language model's rows with their images and rotary positions)."""
    prompt = prompt_ids if isinstance(prompt_ids, ImagePrompt) else None
    prompt_ids = prompt_ids if prompt is None else prompt.ids
    b, g = prompt_ids.shape[0], num_generations
    ids, mask = (prompt_ids, prompt_mask) if g == 1 else (prompt_ids[::g], prompt_mask[::g])
    positions, images = default_positions(mask), None
    if prompt is not None:  # the rows' own positions and images (each group's once)
        positions, images = jax.tree.map(lambda a: a[::g], (prompt.positions, prompt.images))
    width = max_len if g == 1 else ids.shape[1]  # groups: the prompt slots only
    cache = model.init_cache(ids.shape[0], width)
    kv_mask = jnp.concatenate([mask.astype(jnp.int32), jnp.zeros((ids.shape[0], width - ids.shape[1]), jnp.int32)],
                              axis=1)
    # The LM head runs at the last prompt position only.
    logits, cache = model.decode(params, ids, kv_mask, positions, cache, 0, last_only=True, images=images)
    if g > 1:
        cache = model.grouped_cache(cache, b, max_len - ids.shape[1])
        logits = jnp.repeat(logits, g, axis=0)
    assert logits.shape[0] == b
    # Left padding: the last slot holds every row's last prompt token.
    return cache, logits[:, -1]


def prefill_common(model, params, prompt_ids, prompt_mask, max_len: int, prefix: int):
    """`prefill` for prompts whose first `prefix` real tokens are the same in every row
    (a chat template's system prompt): the prefix is run once, for one row, and kept once
    (a `GroupedKV` of one group); each row's rest of the prompt then runs against it.
    p + B * (Q - p) prompt tokens instead of B * Q. Returns (cache, next-token logits
    (B, V), the cache's slot mask (B, max_len)), the slots laid out as

        [P P P P | pad pad S S S | response slots]

    (P: the prefix, S: the row's rest, left-padded to Q - p), so every row's next token
    takes slot Q, as after `prefill`; positions count real tokens, so each token keeps its
    position and attends to the same tokens. Needs 0 < prefix < Q and every row at least
    `prefix` real tokens; not for sliding-window layers (slots then measure the window)."""
    b, q = prompt_ids.shape
    if not 0 < prefix < q:
        raise ValueError(f"prefill_common: prefix={prefix} must be in [1, {q - 1}] (the prompts' width less one)")
    start = q - jnp.sum(prompt_mask[0] > 0).astype(jnp.int32)  # where row 0's real tokens begin
    prefix_ids = jax.lax.dynamic_slice_in_dim(prompt_ids[0], start, prefix)[None]
    ones = jnp.ones((1, prefix), jnp.int32)
    _, cache = model.decode(params, prefix_ids, ones, jnp.arange(prefix)[None], model.init_cache(1, prefix), 0,
                            last_only=True)
    cache = model.grouped_cache(cache, b, max_len - prefix)
    # Row i's rest sits at its prompt's columns p ... Q - 1 from its first real token on: a
    # region of Q - p slots, left-padded exactly as the prompt (`prompt_mask[:, :Q - p]`).
    rest_mask = prompt_mask[:, : q - prefix].astype(jnp.int32)
    kv_mask = jnp.concatenate([jnp.ones((b, prefix), jnp.int32), rest_mask,
                               jnp.zeros((b, max_len - q), jnp.int32)], axis=1)
    positions = default_positions(kv_mask[:, :q])[:, prefix:]
    # A prompt that is the prefix alone has no rest, and needs nothing of its own: its last
    # column is the prefix's last token, at position p - 1, attending to the prefix's slots
    # only (its own slots are masked), so its output there is the prefix's last one.
    logits, cache = model.decode(params, prompt_ids[:, prefix:], kv_mask, positions, cache, prefix, last_only=True)
    return cache, logits[:, -1], kv_mask


def cap_positions(model, positions):
    """`positions` held inside a learned position table (a family with
    `learned_positions`: GPT-2's), as they are otherwise.
    For tokens that are never read (pad a finished row decodes, pad fed after a row's new
    tokens): an index past the table would fill their cache slots with NaN, which reaches
    the output through 0 * NaN even where the slots are masked."""
    if not family_of(model.config).learned_positions:
        return positions
    return jnp.minimum(positions, model.config.max_position_embeddings - 1)


def stop_step(table, state, token):
    """One token through the stop strings' automata: `table` int32 (K, S, V) (state, token)
    -> next state, -1 where a string has just been completed (`jaxppo.models.stops`);
    `state` (B, K). Returns (next state (B, K), completed (B,) bool)."""
    nxt = table[jnp.arange(table.shape[0])[None, :], state, token[:, None]].astype(jnp.int32)
    return jnp.maximum(nxt, 0), jnp.any(nxt < 0, axis=1)


def strings_completed(table, tokens, mask):
    """(B,) bool: the tokens (B, R) where `mask` is set, read in order, complete a stop
    string of `table` (`stop_step`'s); tokens outside the mask are skipped."""
    def step(state, column):
        token, m = column
        nxt, done = stop_step(table, state, token)
        live = m > 0
        return jnp.where(live[:, None], nxt, state), done & live

    start = jnp.zeros((tokens.shape[0], table.shape[0]), jnp.int32)
    _, hits = jax.lax.scan(step, start, (tokens.T, mask.T))
    return jnp.any(hits, axis=0)


def scan_until(step, init, length: int, empty, finished):
    """`lax.scan(step, init, jnp.arange(length))` as a while loop that ends once
    `finished(carry)` holds. The outputs start as `empty` (a tuple of (length, ...) arrays:
    what the steps not taken would have emitted), so when those steps would change nothing
    the result equals the full scan's. Returns (carry, outputs)."""

    def cond(loop):
        t, carry, _ = loop
        return (t < length) & ~finished(carry)

    def body(loop):
        t, carry, outs = loop
        carry, emitted = step(carry, t)
        outs = tuple(jax.lax.dynamic_update_index_in_dim(o, e.astype(o.dtype), t, axis=0) for o, e in zip(outs, emitted))
        return t + 1, carry, outs

    _, carry, outs = jax.lax.while_loop(cond, body, (jnp.int32(0), init, empty))
    return carry, outs


class Prefilled(NamedTuple):
    """Where a decode starts, after a prefill.

    next_logits: (B, V), each row's next-token logits.
    kv_mask: (B, slots), the valid cache slots (the new tokens' are set as they are fed).
    first_slot: the cache slot of the first new token, an int (every row) or (B,) (each
      row its own).
    next_position: (B,), the first new token's position.
    row_keys: (B,) typed keys; row i samples step t from fold_in(row_keys[i], t)."""

    next_logits: jax.Array
    kv_mask: jax.Array
    first_slot: Any
    next_position: jax.Array
    row_keys: jax.Array


def decode_loop(model, params, cache, start: Prefilled, sampling: Sampling, max_lengths=None, seen=None):
    """Decode `sampling.response_length` tokens from a prefilled cache (traced; the samplers'
    shared loop), from `start` (`Prefilled`), picking tokens as `sampling` (a checked
    `Sampling`, `Sampling.check`) says; `max_lengths` (B,): each row's budget, or None;
    `seen` (B, V): each row's tokens so far, with a repetition penalty (else None). The
    stop strings are matched from this loop's first token. Returns (`GenerationOutput`,
    the cache, `seen` with the new tokens or None): every token but the last one decoded
    is in the cache (the last is sampled and not fed back)."""
    next_logits, kv_mask, first_slot, next_position, row_keys = start
    b, r, pad = next_logits.shape[0], sampling.response_length, sampling.pad_token_id
    per_row = jnp.ndim(first_slot) == 1
    stop_ids = jnp.asarray(sampling.stop_token_ids or (-1,), jnp.int32)
    table = sampling.stop_table
    matched = None if table is None else jnp.zeros((b, table.shape[0]), jnp.int32)
    two = sampling.two_logprobs

    def choose(next_logits, done, seen, matched, t):
        """Pick each row's next token; rows already done get pad (masked out, log-prob 0)."""
        token, logprob, policy = pick_tokens(next_logits, step_keys(row_keys, t), sampling, seen)
        live = ~done
        token = jnp.where(live, token, pad)
        logprob = jnp.where(live, logprob, 0.0)
        policy = None if policy is None else jnp.where(live, policy, 0.0)
        seen, matched, completed = note_token(sampling, token, live, seen, matched)
        ended = jnp.isin(token, stop_ids) | completed
        if max_lengths is not None:
            ended = ended | (t + 1 >= max_lengths)
        done = done | (live & ended)
        return token, logprob, policy, live, done, seen, matched

    def step(carry, t):
        cache, next_logits, kv_mask, done, seen, matched = carry
        token, logprob, policy, live, done, seen, matched = choose(next_logits, done, seen, matched, t)
        if per_row:
            kv_mask = kv_mask.at[jnp.arange(b), first_slot + t].set(live.astype(jnp.int32))
        else:
            kv_mask = jax.lax.dynamic_update_index_in_dim(kv_mask, live.astype(jnp.int32), first_slot + t, axis=1)
        positions = cap_positions(model, next_position + t)  # a finished row keeps decoding pad past its budget
        logits, cache = model.decode(params, token[:, None], kv_mask, positions[:, None], cache, first_slot + t)
        emitted = (token, logprob, live.astype(jnp.int32)) + ((policy,) if two else ())
        return (cache, logits[:, 0], kv_mask, done, seen, matched), emitted

    # R - 1 steps that feed their token back, then the last token, which needs no forward.
    init = (cache, next_logits, kv_mask, jnp.zeros((b,), bool), seen, matched)
    if not sampling.early_stop or r == 1:  # (R = 1: no step to take)
        (cache, last_logits, _, done, seen, matched), outs = jax.lax.scan(step, init, jnp.arange(r - 1))
    else:  # what a finished row emits (pad, log-prob 0, mask 0) fills the steps not taken
        empty = (jnp.full((r - 1, b), pad, jnp.int32), jnp.zeros((r - 1, b), jnp.float32),
                 jnp.zeros((r - 1, b), jnp.int32)) + ((jnp.zeros((r - 1, b), jnp.float32),) if two else ())
        (cache, last_logits, _, done, seen, matched), outs = scan_until(step, init, r - 1, empty,
                                                                         lambda carry: jnp.all(carry[3]))
    token, logprob, policy, live, _, seen, _ = choose(last_logits, done, seen, matched, r - 1)
    last = (token, logprob, live.astype(jnp.int32)) + ((policy,) if two else ())
    columns = [jnp.concatenate([o, e[None]], axis=0).T for o, e in zip(outs, last)]
    return GenerationOutput(*columns), cache, seen


def check_sampler_arguments(model, prompt_ids, prompt_mask, sampling: Optional[Sampling], max_lengths=None,
                            budget: Optional[int] = None) -> Sampling:
    """Errors in a sampler's arguments, before anything compiles; returns `sampling` checked
    (`Sampling.check`: the stop ids default to the model's EOS ids, the pad id to the
    config's pad, else the first EOS, else 0). `budget`: the response tokens a row may hold
    in all (default `sampling.response_length`; multi-turn episodes hold more than a turn).
    Learned positions (GPT-2) must cover the longest row: its real prompt tokens plus its
    budget (`max_lengths`, else the budget); when the mask is not concrete, the padded
    width plus the budget."""
    if not isinstance(model, Model) or not model.is_causal_lm:
        raise ValueError(f"generate needs a causal-LM jaxppo Model, got {model!r:.80}")
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a jaxppo.models.sampling.Sampling, got {sampling!r:.80}")
    sampling = sampling.check(model)
    budget = sampling.response_length if budget is None else budget
    if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must both be (batch, prompt_len)")
    total = prompt_ids.shape[1] + budget
    learned = family_of(model.config).learned_positions
    if learned and total > model.config.max_position_embeddings:
        total = _longest_row(prompt_mask, max_lengths, budget, total)
    if learned and total > model.config.max_position_embeddings:
        raise ValueError(
            f"prompt_len + response_length = {total} exceeds the model's "
            f"max_position_embeddings={model.config.max_position_embeddings}"
        )
    return sampling


def _longest_row(prompt_mask, max_lengths, response_length: int, default: int) -> int:
    """Real prompt tokens plus budget of the longest row, or `default` while tracing."""
    try:
        real = np.asarray(prompt_mask).astype(np.int64).sum(axis=1)
        budget = response_length if max_lengths is None else np.asarray(max_lengths).astype(np.int64)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return default
    return int(np.max(real + budget, initial=0))


def check_max_lengths(max_lengths, rows: int, response_length: int):
    """`max_lengths` as int32 (rows,), or None; ValueError for another shape or a length
    outside [1, response_length] (checked when the values are concrete)."""
    if max_lengths is None:
        return None
    lengths = jnp.asarray(max_lengths, jnp.int32)
    if lengths.shape != (rows,):
        raise ValueError(f"max_lengths has shape {lengths.shape}; expected ({rows},): one budget per row")
    try:
        low, high = int(lengths.min()), int(lengths.max())
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
        return lengths
    if low < 1 or high > response_length:
        raise ValueError(f"max_lengths range over [{low}, {high}]; each must be in [1, response_length="
                         f"{response_length}]")
    return lengths


def host_values(*arrays):
    """The arrays' values as numpy arrays, or None where they are not known on this host:
    traced (inside `jit`), or a multi-host array (each process holds part of the rows). The
    samplers' value checks run only where they are known."""
    if not all(getattr(a, "is_fully_addressable", True) for a in arrays):
        return None
    try:
        return tuple(np.asarray(a) for a in arrays)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_groups(prompt_ids, prompt_mask, g):
    """ValueError unless the rows form groups of `g` equal prompts (values are checked only
    when they are concrete, not while tracing)."""
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ValueError(f"num_generations={g!r} must be a positive int")
    if g == 1:
        return
    b = prompt_ids.shape[0]
    if b % g:
        raise ValueError(f"num_generations={g} must divide the batch of {b} prompt rows (groups of G equal prompts)")
    values = host_values(prompt_ids, prompt_mask)
    if values is None:  # traced, or a multi-host array: not known here
        return
    ids, mask = (a.reshape(b // g, g, -1) for a in values)
    unequal = np.flatnonzero(~((ids == ids[:, :1]).all(axis=(1, 2)) & (mask == mask[:, :1]).all(axis=(1, 2))))
    if unequal.size:
        raise ValueError(f"num_generations={g}: the prompts of group {int(unequal[0])} (rows {int(unequal[0]) * g} to "
                         f"{int(unequal[0]) * g + g - 1}) differ; with shared prefixes each group of {g} consecutive "
                         "rows must hold the same prompt")

