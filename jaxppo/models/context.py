"""Attention across a mesh's "context" axis: each row's positions split over its devices.

Under a mesh in context (`jax.set_mesh`, as the sharded train step, the trainer and
`jaxppo plan` set it) whose "context" axis has n > 1 devices, a forward pass without a
KV cache (the update's loss, the scoring pass, the reward model) splits every row's L
positions into n blocks of L / n, one per device (`shard_positions`): the embeddings,
norms, MLPs and rotary positions run on each device's own block, as everything
position-wise does (the log-prob head on each device's share of the response positions:
`jaxppo.models.heads`). Attention is the one place where positions meet, and it runs here,
inside a `jax.shard_map` over that axis, in one of two ways:

- "ring": each device keeps its queries and passes its keys and values round the axis
  (`jax.lax.ppermute`), n steps, accumulating the softmax online (a running maximum and
  sum), so it holds one tile of scores, half a block by half a block per head, at a time;
  a tile whose keys the mask hides entirely (causal attention's later ones) is skipped.
  Any head count.
- "ulysses": two all-to-alls turn the position split into a head split, attention runs
  over whole rows for H / n heads on each device (with the model's own kernel:
  `Model.attention`), and the output is turned back; the head counts must divide by n
  (key/value heads that do not are repeated to the query heads first).

"auto" (the default) takes Ulysses where the kernel is a fused one ("cudnn": it never
holds a row's scores) and the heads divide, else ring. Both give the attention of one
device up to float rounding, for every mask the models build (causal, padding, packed
segments, sliding windows, an image's bidirectional block), since each device's slice of
the mask travels with its queries.

Causal attention over contiguous blocks would leave the device with the first block almost
idle and the one with the last computing every block; a dense model's forward pass
therefore lays each row out in a balanced order first (`balanced_order`: device i holds
the i-th and the i-th-from-last of 2n chunks) and puts it back after the last layer, and
ring attention skips, in tiles of half a block, what the mask hides: every device then
computes the same share. (A mixture of experts keeps the contiguous blocks: its routing is
recorded and replayed per position in the row's own order.)

The samplers' decode steps (one token, or a prefill into a cache) do not split positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CONTEXT_ATTENTION", "context_size", "shard_positions", "balanced_order", "in_order", "context_method",
           "context_attention"]

CONTEXT_ATTENTION = ("auto", "ring", "ulysses")
_AXIS = "context"


def context_size() -> int:
    """The size of the "context" axis of the mesh in context; 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or _AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[_AXIS])


def _rows():
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in ("data", "fsdp") if a in mesh.axis_names) or None


def shard_positions(x):
    """`x` (B, L, ...) with its positions split over the "context" axis (its rows over the
    data axes) where the mesh in context has one; as it is otherwise. ValueError where
    the axis does not divide L."""
    n = context_size()
    if n == 1:
        return x
    if x.shape[1] % n:
        raise ValueError(f"the mesh's context axis has {n} devices but the forward pass runs rows of {x.shape[1]} "
                         f"positions, which it does not divide; make the rows' length (query_length + "
                         f"response_length, or pack_length) a multiple of {n}")
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(_rows(), _AXIS))


def balanced_order(length: int):
    """Where each device's block of a row comes from when the context axis (of the mesh in
    context, n devices) splits a causal forward pass of `length` positions: the row in 2n
    chunks, device i holding chunks i and 2n - 1 - i, so that every device has as much
    attention to compute (its early chunk sees few keys, its late one many). Returns
    (order, inverse): numpy index arrays, `x[:, order]` the balanced layout and
    `y[:, inverse]` back; None without the axis or where 2n does not divide `length`."""
    n = context_size()
    if n == 1 or length % (2 * n):
        return None
    size = length // (2 * n)
    chunks = [k for i in range(n) for k in (i, 2 * n - 1 - i)]
    order = np.concatenate([np.arange(k * size, (k + 1) * size) for k in chunks])
    return order, np.argsort(order)


def in_order(order, *arrays, axis: int = 1):
    """Each of `arrays` (None stays None) taken in `order` along its position `axis`."""
    return tuple(None if a is None else jnp.take(a, order, axis=axis) for a in arrays)


def context_method(choice: str, impl: str, num_heads: int, n: int) -> str:
    """"ring" or "ulysses" for `choice` (see `CONTEXT_ATTENTION`) with the attention
    kernel `impl`, `num_heads` query heads and a context axis of `n`."""
    if choice not in CONTEXT_ATTENTION:
        raise ValueError(f"context_attention={choice!r} is invalid; valid: {', '.join(map(repr, CONTEXT_ATTENTION))}")
    if choice == "ulysses" and num_heads % n:
        raise ValueError(f"context_attention='ulysses' splits the {num_heads} attention heads over the context axis's "
                         f"{n} devices, which does not divide them; use 'ring' (any head count) or a context axis "
                         f"that divides {num_heads}")
    if choice == "auto":
        return "ulysses" if impl == "cudnn" and num_heads % n == 0 else "ring"
    return choice


def context_attention(q, k, v, mask, dtype, scale_dim, local, method: str):
    """Attention of q (B, L, H, D) over k/v (B, L, KV, D) with mask (B, L, L), each row's
    positions split over the "context" axis: (B, L, H * D), as `local(q, k, v, mask, dtype,
    scale_dim)` (the model's attention over whole rows) gives on one device. `method`:
    "ring" or "ulysses" (`context_method`)."""
    from jax.sharding import PartitionSpec as P

    blocks = P(None, _AXIS)
    if method == "ring":
        fn = lambda q, k, v, m: _ring(q, k, v, m, dtype, scale_dim)  # noqa: E731
    else:
        fn = lambda q, k, v, m: _ulysses(q, k, v, m, dtype, scale_dim, local)  # noqa: E731
    return jax.shard_map(fn, in_specs=(blocks,) * 4, out_specs=blocks, axis_names={_AXIS}, check_vma=False)(
        q, k, v, mask)


def _ring(q, k, v, mask, dtype, scale_dim):
    """One device's queries (B, Lc, H, D) against every device's keys and values, passed
    round the axis; `mask` (B, Lc, L) its queries' row of the mask. Each step's block is
    worked in tiles of half a block by half a block (whole blocks where Lc is odd), a tile
    the mask hides entirely skipped: in the balanced order (`balanced_order`) every device
    then computes two tiles a step (three on the first) under causal attention."""
    n, me = jax.lax.axis_size(_AXIS), jax.lax.axis_index(_AXIS)
    b, lc, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, lc, kv, h // kv, d).astype(dtype)
    scale, low = math.sqrt(scale_dim or d), jnp.finfo(jnp.float32).min
    passed = [(i, (i + 1) % n) for i in range(n)]
    tiles = 2 if lc % 2 == 0 else 1
    t = lc // tiles
    rows = [slice(i * t, (i + 1) * t) for i in range(tiles)]

    def attend(queries, keys, values, tile, top, total, out):
        s = jnp.einsum("bqkgd,bskd->bkgqs", queries, keys.astype(dtype), preferred_element_type=jnp.float32) / scale
        s = jnp.where(tile[:, None, None], s, low)
        new_top = jnp.maximum(top, s.max(axis=-1))
        probs, kept = jnp.exp(s - new_top[..., None]), jnp.exp(top - new_top)
        total = total * kept + probs.sum(axis=-1)
        out = out * jnp.moveaxis(kept, -1, 1)[..., None] + jnp.einsum(
            "bkgqs,bskd->bqkgd", probs.astype(dtype), values.astype(dtype), preferred_element_type=jnp.float32)
        return new_top, total, out

    @jax.checkpoint
    def step(carry, i):
        keys, values, state = carry
        block = jax.lax.dynamic_slice_in_dim(mask, ((me - i) % n) * lc, lc, axis=2)  # whose keys these are
        updated = []
        for r, (top, total, out) in zip(rows, state):  # each half of the queries, over each half of the keys
            for c in rows:
                tile = block[:, r, c]
                top, total, out = jax.lax.cond(jnp.any(tile), attend, lambda *a: a[4:], q[:, r], keys[:, c],
                                               values[:, c], tile, top, total, out)
            updated.append((top, total, out))
        keys, values = jax.lax.ppermute((keys, values), _AXIS, passed)
        return (keys, values, tuple(updated)), None

    empty = (jnp.full((b, kv, h // kv, t), low, jnp.float32), jnp.zeros((b, kv, h // kv, t), jnp.float32),
             jnp.zeros((b, t, kv, h // kv, d), jnp.float32))
    (_, _, state), _ = jax.lax.scan(step, (k, v, (empty,) * tiles), jnp.arange(n))
    total = jnp.concatenate([part[1] for part in state], axis=-1)
    out = jnp.concatenate([part[2] for part in state], axis=1)
    # A query that sees no key at all (a padding position, never read) gets the average of
    # the values of the tiles it was shown (all masked alike), or 0 where every tile was
    # skipped; one device gives the average of all values there.
    total = jnp.moveaxis(jnp.where(total > 0, total, 1.0), -1, 1)[..., None]
    return (out / total).astype(dtype).reshape(b, lc, h * d)


def _ulysses(q, k, v, mask, dtype, scale_dim, local):
    """The position split turned into a head split and back: each device attends over
    whole rows for H / n heads."""
    n = jax.lax.axis_size(_AXIS)
    b, lc, h, d = q.shape
    if k.shape[2] % n:  # key/value heads that do not split: each query head its own copy
        k, v = (jnp.repeat(x, h // k.shape[2], axis=2) for x in (k, v))
    to_heads = lambda x: jax.lax.all_to_all(x, _AXIS, 2, 1, tiled=True)  # noqa: E731
    whole = jax.lax.all_gather(mask, _AXIS, axis=1, tiled=True)
    out = local(to_heads(q), to_heads(k), to_heads(v), whole, dtype, scale_dim).reshape(b, lc * n, h // n, d)
    return jax.lax.all_to_all(out, _AXIS, 1, 2, tiled=True).reshape(b, lc, h * d)
