"""The LM head applied only where logits are read, optionally a chunk of positions at a time.

`token_logprobs(hidden, head, targets, temperature, chunk_size)` turns final hidden states
(B, T, D) at the positions that predict `targets` (B, T) into the targets' log-probs and the
per-position entropies, each (B, T) float32, without a (B, L, V) logits array for the
whole sequence: the head is applied at these T positions only, and with `chunk_size=K` to
K positions at a time inside a `lax.scan` whose step is rematerialised, so the backward
pass recomputes each chunk's (B, K, V) logits instead of keeping them all. Log-softmax,
the taken log-prob and the entropy are computed per chunk in float32.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxppo.models.context import context_size

__all__ = ["LMHead", "token_logprobs", "top_logprobs", "softcap"]


def softcap(x, cap):
    """cap * tanh(x / cap) (Gemma's soft capping); x itself when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


class LMHead(NamedTuple):
    """The output projection: `weight` (D, V) (an untied `lm_head` kernel) or, when
    `transposed`, (V, D) (the tied token-embedding table); `dtype` the compute dtype;
    `softcap` the final-logit soft capping (None: none)."""

    weight: jax.Array
    transposed: bool
    dtype: jnp.dtype
    softcap: Optional[float] = None  # Gemma's final-logit soft capping: cap * tanh(logits / cap)

    def logits(self, hidden):
        """(..., D) -> (..., V) float32."""
        w = self.weight.astype(self.dtype)
        h = hidden.astype(self.dtype)
        if self.transposed:
            out = jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)
        out = out.astype(jnp.float32)
        return softcap(out, self.softcap)


def _stats(head: LMHead, hidden, targets, temperature):
    """(log-probs of `targets`, entropy) at each position; `targets` (..., T) one id per
    position, or (..., T, m) m ids (then the log-probs are (..., T, m))."""
    logp = jax.nn.log_softmax(head.logits(hidden) / temperature, axis=-1)
    several = targets.ndim == hidden.ndim
    index = targets if several else targets[..., None]
    taken = jnp.take_along_axis(logp, index.astype(jnp.int32), axis=-1)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return (taken if several else taken[..., 0]), entropy


def _top(head: LMHead, hidden, targets, k: int, temperature):
    logp = jax.nn.log_softmax(head.logits(hidden) / temperature, axis=-1)
    taken = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return (taken,) + tuple(jax.lax.top_k(logp, k))


def _rows_over_data_axes(hidden, context: bool = False):
    """Under a mesh in context (`jax.set_mesh`; `jaxppo.sharding.sharded_train_step` and the
    trainer set it) with "data"/"fsdp" axes, pin the gathered positions' rows to those axes
    (and to "context" with `context`: rows that `_over_context` folded).

    Without this pin, JAX's SPMD partitioner computes a wrong gradient for "slice the
    sequence axis of a row-sharded activation, then matmul with a weight sharded over
    (fsdp, tensor)" on a data x fsdp x tensor mesh (reproduced in tests/test_sharding.py on
    jax 0.10.2, 0.11.2 and 0.12.0.1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return hidden
    rows = tuple(a for a in ("data", "fsdp") + (("context",) if context else ()) if a in mesh.axis_names)
    if not rows:
        return hidden
    return jax.lax.with_sharding_constraint(hidden, jax.sharding.PartitionSpec(rows))


def _over_context(hidden, targets):
    """Under a mesh whose context axis (n devices) divides the T positions: hidden (B, T, D)
    and targets folded into (B n, T / n, ...), each device's share of a row's positions a
    row of its own, so that the head runs on each device's positions (not on all of them
    on every device of the axis); and the function that unfolds (B n, T / n, ...) results.
    Else as they are, and None."""
    n = context_size()
    b, t = hidden.shape[:2]
    if n == 1 or t % n:
        return hidden, targets, None
    fold = lambda a: a.reshape(b * n, t // n, *a.shape[2:])  # noqa: E731
    return fold(hidden), fold(targets), lambda a: a.reshape(b, t, *a.shape[2:])


def token_logprobs(hidden, head: LMHead, targets, temperature=1.0, chunk_size: Optional[int] = None):
    """log softmax(head(hidden) / temperature)[targets] and the entropy, each (B, T) float32.

    hidden (B, T, D) at the positions that predict `targets` (B, T); targets (B, T, m), m
    ids per position, give their log-probs (B, T, m) (on-policy distillation's student at
    the teacher's top-k tokens, beside the sampled one). `chunk_size=None`
    applies the head to all T positions at once; `chunk_size=K` walks them K at a time
    (the last chunk zero-padded when K does not divide T; the padding is dropped), with the
    chunk's logits recomputed in the backward pass rather than stored. Under a mesh with a
    context axis that divides T, each device's share of the positions (chunked alike)."""
    hidden, targets, unfold = _over_context(hidden, targets)
    hidden = _rows_over_data_axes(hidden, unfold is not None)
    if chunk_size is None or chunk_size >= hidden.shape[1]:
        out = _stats(head, hidden, targets, temperature)
    else:
        @jax.checkpoint
        def chunk(h, tgt):
            return _stats(head, h, tgt, temperature)

        out = _chunked(chunk, chunk_size, hidden, targets)
    return out if unfold is None else tuple(map(unfold, out))


def _chunked(fn, chunk_size: int, hidden, extra):
    """`fn(hidden, extra)` over chunks of `chunk_size` positions in a `lax.scan` (the last
    chunk zero-padded when K does not divide T; the padding is dropped): hidden (B, T, D),
    `extra` (B, T, ...) or None; each output (B, T, ...)."""
    b, t, d = hidden.shape
    n = math.ceil(t / chunk_size)
    pad = n * chunk_size - t
    # (B, n*K, ...) -> (n, B, K, ...): the scan walks the chunks; rows keep their sharding.
    split = lambda x: jnp.swapaxes(  # noqa: E731
        jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(b, n, chunk_size, *x.shape[2:]), 0, 1)
    xs = (split(hidden), None if extra is None else split(extra))
    _, outs = jax.lax.scan(lambda carry, x: (carry, fn(*x)), None, xs)
    unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, n * chunk_size, *x.shape[3:])[:, :t]  # noqa: E731
    return jax.tree.map(unchunk, outs)


def top_logprobs(hidden, head: LMHead, targets, k: int, temperature=1.0, chunk_size: Optional[int] = None):
    """The log-probs of `targets` (B, T) under softmax(head(hidden) / temperature), and the
    k largest log-probs at each position with their token ids, (B, T, k) float32 and
    (B, T, k) int32, largest first: what on-policy distillation keeps of the teacher's
    distribution (`AdvantageConfig.distill_top_k`). Chunked like `token_logprobs`; for a
    frozen model (no rematerialisation for a backward pass)."""
    hidden = _rows_over_data_axes(hidden)
    if chunk_size is None or chunk_size >= hidden.shape[1]:
        return _top(head, hidden, targets, k, temperature)
    return _chunked(lambda h, tgt: _top(head, h, tgt, k, temperature), chunk_size, hidden, targets)
