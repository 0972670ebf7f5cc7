"""Prompt rows with their images, as the samplers and the forward pass over responses take
them in place of token ids: what every vision-language family shares (the images
themselves are the family's input, e.g. `jaxppo.models.vision.qwen.ImageInput`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["ImagePrompt", "joined_positions", "response_positions", "positions_like", "image_slots", "take_slots",
           "merge_images", "row_encoder"]


class ImagePrompt(NamedTuple):
    """Prompt rows with their images, as the samplers take them in place of the token ids:
    `ids` (B, Q) left-padded token ids; `images`, the family's image input (e.g.
    `jaxppo.models.vision.qwen.ImageInput`); `positions`, the rows' rotary positions:
    (B, Q, 3) for Qwen's M-RoPE (`jaxppo.models.vision.qwen.mrope_positions`), (B, Q)
    where an image's tokens count like text (Gemma 3); `next_position` (B,), the position
    of each row's first sampled token."""

    ids: Any
    images: Any
    positions: Any
    next_position: Any


def joined_positions(prompt: ImagePrompt, response_mask):
    """The rotary positions (B, Q + R[, 3]) of the prompt rows followed by responses
    (`response_mask` (B, R)): the prompt's own, then each response token at the row's next
    position plus the response tokens before it (on all three axes where the prompt's
    positions have them), as the samplers decode."""
    positions = jnp.asarray(prompt.positions, jnp.int32)
    return jnp.concatenate([positions, response_positions(prompt.next_position, response_mask, positions.ndim)],
                           axis=1)


def response_positions(next_position, response_mask, ndim: int = 3):
    """The rotary positions of responses (`response_mask` (B, R)) after prompts whose next
    positions are `next_position` (B,): each token at the next position plus the response
    tokens before it; (B, R, 3), equal on the three axes, for prompts whose positions are
    (B, Q, 3) (`ndim` 3), else (B, R)."""
    counted = jnp.maximum(jnp.cumsum(jnp.asarray(response_mask, jnp.int32), axis=1) - 1, 0)
    after = jnp.asarray(next_position, jnp.int32)[:, None] + counted
    return positions_like(after, ndim)


def positions_like(after, ndim: int):
    """1-D positions `after` (B, R) laid out as a prompt's of `ndim` dimensions: (B, R, 3),
    equal on the three axes, for 3 (numpy or jax arrays alike); else as they are."""
    return after[..., None].repeat(3, axis=-1) if ndim == 3 else after


def image_slots(input_ids, image_token_id: int, tokens):
    """Where a batch's images go among its token ids: (is_image (B, L), the image tokens
    that take an image's features: row b's first tokens[b] (an image token after those, a
    sampled one, is text, as when it was decoded); index (B, L), which of the row's image
    tokens each is, counted from 0). The host checks the prompts' counts."""
    seen = jnp.cumsum(input_ids == image_token_id, axis=1)
    is_image = (input_ids == image_token_id) & (seen <= jnp.asarray(tokens)[:, None])
    return is_image, jnp.maximum(seen - 1, 0)


def take_slots(features, slots):
    """Each token's row of `features` (B, K, ...) by `image_slots`' index: (B, L, ...); at
    tokens that are not an image's, any row (mask them with `slots`' is_image)."""
    index = jnp.minimum(slots[1], features.shape[1] - 1)
    return jnp.take_along_axis(features, index.reshape(index.shape + (1,) * (features.ndim - 2)), axis=1)


def merge_images(x, slots, features):
    """The embeddings `x` (B, L, D) with row b's k-th image token (`slots`, from
    `image_slots`) taking `features[b, k]` (features (B, K, D)); every other token keeps its
    own embedding."""
    return jnp.where(slots[0][..., None], take_slots(features, slots).astype(x.dtype), x)


def row_encoder(trunk, encoder_cls, *fields, **vmap_kwargs):
    """The trunk's vision encoder ("visual"): `encoder_cls(*fields, trunk's dtypes, the
    tower's LoRA adapters)` mapped over a batch's rows (`nn.vmap`, `vmap_kwargs` such as
    `in_axes`), its parameters and adapters shared by every row."""
    tower = None if trunk.lora is None else trunk.lora.tower(trunk.adapters)
    mapped = nn.vmap(encoder_cls, variable_axes={"params": None, "lora": None}, split_rngs={"params": False},
                     **vmap_kwargs)
    return mapped(*fields, trunk.dtype, trunk.param_dtype, tower, name="visual")
