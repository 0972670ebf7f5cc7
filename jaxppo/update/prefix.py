"""The common-prefix layout: a batch whose prompts all begin with the same tokens (a chat
template's system prompt, a task's instructions) run that prefix once.

A row of the usual layout is its left-padded prompt, then its response:

    query (B, Q):            [pad pad | P P P P P P | S S S]      P: the prefix every prompt shares
    response region (B, R):  [R R R R R pad]                      S: the rest of this prompt

In the common-prefix layout every row's query is the prefix alone, and the rest of the
prompt opens the response region, before the response, with the padding at the end:

    query (B, p):            [P P P P P P]                        the same in every row
    response region (B, Q - p + R): [S S S R R R R R pad pad]

The region's `response_attention_mask` is 1 at S and at the response (the sequence the
model attends to, unchanged), its `response_mask` 1 at the response only (what is
trained), so the loss, the KL, GAE and the values read the same tokens as before. Each
token keeps its position (positions count real tokens) and attends to the same tokens, so
a model computes the same outputs; with one query for every row, a built-in model runs it
once per batch (`jaxppo.models.Model.grouped_outputs`): p + B * (Q - p + R) tokens instead
of B * (Q + R). `LayoutConfig.common_prefix` tells the loss; the trainer's forward pass builds
its rollouts in this layout (`prefix_layout`, `to_region`).

Any permutation of the rows keeps the layout (every row has the same query), so mini-batches
need no grouping.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["common_prefix_length", "PrefixLayout", "prefix_layout", "to_region", "prefix_query"]


def common_prefix_length(ids, mask) -> int:
    """The number of leading real tokens every row shares (host arrays (N, Q), left-padded
    prompts): 0 when two prompts differ at their first token. At most the shortest prompt's
    length."""
    ids, mask = np.asarray(ids), np.asarray(mask) > 0
    if ids.ndim != 2 or ids.shape != mask.shape or not len(ids):
        raise ValueError(f"prompt ids {ids.shape} and mask {mask.shape} must be the same (N, Q) with N >= 1")
    lengths = mask.sum(axis=1)
    q, shortest = ids.shape[1], int(lengths.min())
    # each row's real tokens, left-aligned, up to the shortest prompt
    aligned = np.stack([row[q - n: q - n + shortest] for row, n in zip(ids, lengths)])
    same = np.all(aligned == aligned[:1], axis=0)
    return int(shortest if same.all() else np.argmin(same))


class PrefixLayout:
    """Where each token of the common-prefix layout comes from, for a batch: `index` (B, W)
    into the row's joined prompt + response (W = Q - p + R), `valid` (B, W) where it is
    inside that row; `start` (B,) where the row's prefix begins in its prompt."""

    def __init__(self, index, valid, start, prefix: int):
        self.index, self.valid, self.start, self.prefix = index, valid, start, prefix


def prefix_layout(prompt_mask, prefix: int, response_length: int) -> PrefixLayout:
    """The layout of a batch of left-padded prompts (`prompt_mask` (B, Q)) whose first
    `prefix` real tokens are shared, with responses of `response_length` tokens."""
    q = prompt_mask.shape[1]
    if not 0 < prefix <= q:
        raise ValueError(f"common prefix of {prefix} tokens: it must be in [1, {q}] (the prompts' width)")
    start = q - jnp.sum(prompt_mask > 0, axis=1).astype(jnp.int32)  # the first real token
    width = q - prefix + response_length
    index = start[:, None] + prefix + jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = index < q + response_length
    return PrefixLayout(jnp.minimum(index, q + response_length - 1), valid, start, prefix)


def to_region(layout: PrefixLayout, prompt_part, response_part):
    """A per-token array of the usual layout, (B, Q) for the prompt and (B, R) for the
    response, in the common-prefix layout's response region: (B, Q - p + R), 0 past each
    row's end."""
    joined = jnp.concatenate([jnp.asarray(prompt_part).astype(response_part.dtype), response_part], axis=1)
    moved = jnp.take_along_axis(joined, layout.index, axis=1)
    return jnp.where(layout.valid, moved, jnp.zeros((), moved.dtype))


def prefix_query(layout: PrefixLayout, prompt_ids):
    """The shared prefix as every row's query: (ids (B, p), mask of ones (B, p))."""
    index = layout.start[:, None] + jnp.arange(layout.prefix, dtype=jnp.int32)[None, :]
    ids = jnp.take_along_axis(prompt_ids, index, axis=1)
    return ids, jnp.ones_like(ids, dtype=jnp.int32)
