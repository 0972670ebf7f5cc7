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

__all__ = ["LMHead", "token_logprobs", "softcap"]


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
    logp = jax.nn.log_softmax(head.logits(hidden) / temperature, axis=-1)
    taken = jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return taken, entropy


def _rows_over_data_axes(hidden):
    """Under a mesh in context (`jax.set_mesh`; `jaxppo.sharding.sharded_train_step` and the
    trainer set it) with "data"/"fsdp" axes, pin the gathered positions' rows to those axes.

    Without this pin, JAX's SPMD partitioner computes a wrong gradient for "slice the
    sequence axis of a row-sharded activation, then matmul with a weight sharded over
    (fsdp, tensor)" on a data x fsdp x tensor mesh (reproduced in tests/test_sharding.py on
    jax 0.10.2, 0.11.2 and 0.12.0.1)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return hidden
    rows = tuple(a for a in ("data", "fsdp") if a in mesh.axis_names)
    if not rows:
        return hidden
    return jax.lax.with_sharding_constraint(hidden, jax.sharding.PartitionSpec(rows))


def token_logprobs(hidden, head: LMHead, targets, temperature=1.0, chunk_size: Optional[int] = None):
    """log softmax(head(hidden) / temperature)[targets] and the entropy, each (B, T) float32.

    hidden (B, T, D) at the positions that predict `targets` (B, T). `chunk_size=None`
    applies the head to all T positions at once; `chunk_size=K` walks them K at a time
    (the last chunk zero-padded when K does not divide T; the padding is dropped), with the
    chunk's logits recomputed in the backward pass rather than stored."""
    hidden = _rows_over_data_axes(hidden)
    b, t, d = hidden.shape
    if chunk_size is None or chunk_size >= t:
        return _stats(head, hidden, targets, temperature)
    n = math.ceil(t / chunk_size)
    pad = n * chunk_size - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # (B, n*K, ...) -> (n, B, K, ...): the scan walks the chunks; rows keep their sharding.
    hs = jnp.swapaxes(hidden.reshape(b, n, chunk_size, d), 0, 1)
    ts = jnp.swapaxes(targets.reshape(b, n, chunk_size), 0, 1)

    @jax.checkpoint
    def chunk(h, tgt):
        return _stats(head, h, tgt, temperature)

    def step(carry, xs):
        return carry, chunk(*xs)

    _, (taken, entropy) = jax.lax.scan(step, None, (hs, ts))
    unchunk = lambda x: jnp.swapaxes(x, 0, 1).reshape(b, n * chunk_size)[:, :t]
    return unchunk(taken), unchunk(entropy)
