"""Prompt rows with their images, as the samplers and the forward pass over responses take
them in place of token ids: what every vision-language family shares (the images
themselves are the family's input, e.g. `jaxppo.models.vision.qwen.ImageInput`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

__all__ = ["ImagePrompt", "joined_positions", "response_positions"]


class ImagePrompt(NamedTuple):
    """Prompt rows with their images, as the samplers take them in place of the token ids:
    `ids` (B, Q) left-padded token ids; `images`, the family's image input (e.g.
    `jaxppo.models.vision.qwen.ImageInput`); `positions` (B, Q, 3), the rows' rotary
    positions; `next_position` (B,), the position of each row's first sampled token (e.g.
    from `jaxppo.models.vision.qwen.mrope_positions`)."""

    ids: Any
    images: Any
    positions: Any
    next_position: Any


def joined_positions(prompt: ImagePrompt, response_mask):
    """The rotary positions (B, Q + R, 3) of the prompt rows followed by responses
    (`response_mask` (B, R)): the prompt's own, then each response token at the row's next
    position plus the response tokens before it, on all three axes (as the samplers
    decode)."""
    return jnp.concatenate([jnp.asarray(prompt.positions, jnp.int32),
                            response_positions(prompt.next_position, response_mask)], axis=1)


def response_positions(next_position, response_mask):
    """The rotary positions (B, R, 3) of responses (`response_mask` (B, R)) after prompts whose
    next positions are `next_position` (B,): each token at the next position plus the
    response tokens before it, on all three axes."""
    counted = jnp.maximum(jnp.cumsum(jnp.asarray(response_mask, jnp.int32), axis=1) - 1, 0)
    after = jnp.asarray(next_position, jnp.int32)[:, None] + counted
    return jnp.repeat(after[..., None], 3, axis=-1)
