"""Packed sequences: a batch's rows of real tokens laid end to end in a few fixed-length
streams, so that the forward pass and the loss run on real tokens instead of padding.

A row is its prompt's real tokens followed by its response region's real tokens
(`response_attention`: the policy's and, in a multi-turn episode, the environment's). Rows
are placed first-fit decreasing (longest first, ties in row order, each into the first
stream with room) into `streams` streams of `length` tokens. Each row is a segment: its
tokens attend only to earlier tokens of the same segment and its positions restart at 0,
so every row sees exactly what it sees padded. Response token t of a row is read at the
stream position that predicts it, giving the same (M, R) log-probs, entropies and values
as the padded forward, up to float rounding.

Shapes are static: `streams` and `length` are part of the compiled program. When the
rows of a batch do not fit (they need more streams than given), that batch runs padded
instead (both forwards are compiled, one runs; the results are the same either way) and
the fallback is counted (`packing/overflow` in `train_step`'s metrics). `streams_needed`
computes, on the host, how many streams a set of rows takes, and the `Trainer` chooses the
streams of every iteration with it, so that nothing falls back.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.update.batch import model_method, response_attention
from jaxppo.update.batch import response_outputs as padded_outputs

__all__ = ["Packed", "plan", "pack", "packer", "response_outputs", "response_outputs_and_fit", "streams_needed", "row_lengths",
           "minibatch_streams", "round_streams", "host_row_lengths", "stream_length"]


class Packed(NamedTuple):
    """A batch of M rows packed into S streams of T tokens.

    tokens, segment_ids, positions, targets: (S, T) int32. segment_ids is 1 + the row
      index at a row's tokens and 0 at the unused tail of a stream; positions restart at 0
      per row; targets[p] is the response token that position p predicts (0 elsewhere).
    index: (M, R) int32, the flat position (s * T + p) that predicts response token t of
      row m. valid: (M, R) bool, t lies inside the row's response region.
    fits: bool scalar, every row found a stream (else the packing is unusable).
    """

    tokens: jax.Array
    segment_ids: jax.Array
    positions: jax.Array
    targets: jax.Array
    index: jax.Array
    valid: jax.Array
    fits: jax.Array


def row_lengths(batch):
    """Real tokens per row (M,): the prompt's plus the response region's."""
    return (jnp.sum(batch["query_mask"].astype(jnp.int32), axis=1)
            + jnp.sum(response_attention(batch).astype(jnp.int32), axis=1))


def plan(lengths, streams: int, length: int):
    """First-fit decreasing placement of rows of `lengths` (M,) into `streams` streams of
    `length` tokens: (stream (M,), offset (M,), fits). A row that finds no room keeps
    stream 0, offset 0 and makes `fits` False."""
    m = lengths.shape[0]
    order = jnp.argsort(-lengths, stable=True)

    def place(fill, row):
        n = lengths[row]
        room = fill + n <= length
        s = jnp.argmax(room)
        ok = room[s]
        offset = jnp.where(ok, fill[s], 0)
        fill = fill.at[s].add(jnp.where(ok, n, 0))
        return fill, (jnp.where(ok, s, 0), offset, ok)

    _, (s, offset, ok) = jax.lax.scan(place, jnp.zeros((streams,), jnp.int32), order)
    unsort = lambda x: jnp.zeros((m,), jnp.int32).at[order].set(x.astype(jnp.int32))
    return unsort(s), unsort(offset), jnp.all(ok)


def pack(batch, streams: int, length: int) -> Packed:
    """Pack the rows of `batch` (query_tokens/query_mask (M, Q), left-padded;
    response_tokens (M, R) and its response region `response_attention(batch)`, a prefix)
    into `streams` streams of `length` tokens (see `Packed`)."""
    q, r = batch["query_tokens"].shape[1], batch["response_tokens"].shape[1]
    qm = batch["query_mask"].astype(jnp.int32)
    rm = response_attention(batch).astype(jnp.int32)
    q_len = jnp.sum(qm, axis=1)
    r_len = jnp.sum(rm, axis=1)
    stream, offset, fits = plan(q_len + r_len, streams, length)
    m = q_len.shape[0]
    size = streams * length
    # Joined row j: the real tokens are j in [Q - q_len, Q + r_len); each goes to its
    # segment's slot j - (Q - q_len).
    j = jnp.arange(q + r)[None, :]
    first = (q - q_len)[:, None]
    real = (j >= first) & (j < (q + r_len)[:, None])
    seg_pos = j - first
    dest = jnp.where(real, stream[:, None] * length + offset[:, None] + seg_pos, size)  # size: dropped
    joined = jnp.concatenate([batch["query_tokens"], batch["response_tokens"]], axis=1).astype(jnp.int32)
    scatter = lambda values: jnp.zeros((size,), jnp.int32).at[dest.reshape(-1)].set(
        jnp.broadcast_to(values, dest.shape).reshape(-1), mode="drop").reshape(streams, length)
    tokens = scatter(joined)
    segment_ids = scatter(jnp.arange(1, m + 1, dtype=jnp.int32)[:, None])
    positions = scatter(seg_pos.astype(jnp.int32))
    # Response token t of row m is predicted by its segment's slot q_len - 1 + t.
    t = jnp.arange(r)[None, :]
    valid = (t < r_len[:, None]) & (q_len[:, None] > 0)
    index = stream[:, None] * length + offset[:, None] + q_len[:, None] - 1 + t
    index = jnp.where(valid, index, 0)
    targets = jnp.zeros((size,), jnp.int32).at[jnp.where(valid, index, size).reshape(-1)].set(
        batch["response_tokens"].astype(jnp.int32).reshape(-1), mode="drop").reshape(streams, length)
    return Packed(tokens, segment_ids, positions, targets, index.astype(jnp.int32), valid, fits)


def packer(apply_fn) -> Optional[Callable]:
    """The `packed_outputs(params, tokens, segment_ids, positions, targets, temperature)`
    method that `apply_fn` offers (the built-in `Model`, `PolicyAndCritic`, or a bound
    `Model.apply`), or None: other models cannot be packed."""
    return model_method(apply_fn, "packed_outputs")


def _unpack(packed: Packed, x):
    """(S, T) per-position outputs -> (M, R) at the response tokens (0 outside them)."""
    if x is None:
        return None
    return jnp.where(packed.valid, x.reshape(-1)[packed.index], 0.0)


def response_outputs(apply_fn, params, batch, temperature: float, streams: int, length: Optional[int] = None):
    """`jaxppo.response_outputs` (log-probs, values, entropies, each (M, R)) computed on the
    batch packed into `streams` streams of `length` tokens (None: the padded width Q + R).
    If the rows do not fit, the padded forward runs instead (`jax.lax.cond`; same results).
    Outputs at positions outside the response region are 0."""
    return response_outputs_and_fit(apply_fn, params, batch, temperature, streams, length)[0]


def response_outputs_and_fit(apply_fn, params, batch, temperature: float, streams: int,
                             length: Optional[int] = None):
    """(`response_outputs`'s outputs, whether the rows fitted: a bool scalar; False means
    the padded forward ran)."""
    method = packer(apply_fn)
    if method is None:
        raise ValueError("packed sequences need a built-in model (jaxppo.models.Model or PolicyAndCritic) as the "
                         f"apply_fn; got {apply_fn!r}. Set pack_sequences=False for other models")
    packed = pack(batch, streams, stream_length(batch, length))

    def run_packed(params):
        logprobs, values, entropy = method(params, packed.tokens, packed.segment_ids, packed.positions,
                                           packed.targets, temperature)
        return tuple(_unpack(packed, x) for x in (logprobs, values, entropy))

    def run_padded(params):
        outputs = padded_outputs(apply_fn, params, batch, temperature)
        return tuple(None if x is None else jnp.where(packed.valid, x.astype(jnp.float32), 0.0) for x in outputs)

    return jax.lax.cond(packed.fits, run_packed, run_padded, params), packed.fits


def streams_needed(lengths, length: int) -> int:
    """How many streams of `length` tokens first-fit decreasing fills with rows of
    `lengths` (host ints): the fewest streams for which `plan` fits them. A row longer than
    `length` fits nowhere: ValueError."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > length:
        raise ValueError(f"a row of {int(lengths.max())} real tokens is longer than the stream length {length}")
    fill = []
    for n in lengths[np.argsort(-lengths, kind="stable")]:
        for s, f in enumerate(fill):
            if f + n <= length:
                fill[s] += n
                break
        else:
            fill.append(int(n))
    return max(len(fill), 1)


def round_streams(needed: int, rows: int) -> int:
    """`needed` streams rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers
    of two and one and a half times them), at most `rows` (one row per stream always
    fits): a run compiles for a handful of stream counts at most, and rounding adds at
    most a third."""
    power = 1
    while power < needed:
        if power >= 2 and power * 3 // 2 >= needed:
            return min(power * 3 // 2, rows)
        power *= 2
    return min(power, rows)


def minibatch_streams(lengths, indices, micro_batch_size: int, length: int) -> int:
    """The streams every micro-batch of an update fits in: `lengths` (B,) real tokens per
    row (host), `indices` the update's mini-batch rows (`jaxppo.update.engine.minibatch_indices`,
    host), cut into micro-batches of `micro_batch_size`; the largest need, rounded by
    `round_streams`."""
    lengths = np.asarray(lengths)
    rows = np.asarray(indices).reshape(-1, micro_batch_size)
    needed = max(streams_needed(lengths[r], length) for r in rows)
    return round_streams(needed, micro_batch_size)


def host_row_lengths(query_mask, response_attention_mask) -> np.ndarray:
    """Real tokens per row (M,) from host masks: the prompt's plus the response region's
    (`row_lengths` on the host, where the stream counts are chosen)."""
    return np.asarray(query_mask).sum(axis=1) + np.asarray(response_attention_mask).sum(axis=1)


def stream_length(batch, length: Optional[int]) -> int:
    """The stream length: `length`, or the padded width Q + R of `batch` (a dict of the
    rollout's fields, or the `RolloutBatch` itself)."""
    get = batch.__getitem__ if isinstance(batch, dict) else lambda name: getattr(batch, name)
    return length or get("query_tokens").shape[1] + get("response_tokens").shape[1]

