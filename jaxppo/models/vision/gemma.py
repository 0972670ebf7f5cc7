"""Gemma 3's vision encoder in Flax: a SigLIP vision transformer and Gemma 3's projector.

Every image is resized by the image processor to one square size, so every image has the
same patches and becomes the same number of image tokens (`mm_tokens_per_image`, 256 in
Gemma 3's checkpoints). The encoder:

1. a linear patch embedding with a bias (Hugging Face's Conv2d, stride = kernel) and a
   learned position embedding per patch;
2. `num_hidden_layers` pre-norm blocks (LayerNorm, attention over the whole image,
   LayerNorm, an MLP with a tanh GELU), all with biases, and a last LayerNorm;
3. the projector: the patch grid average-pooled to `mm_tokens_per_image` tokens, Gemma's
   RMSNorm (1 + weight), a linear map to the language model's width.

A batch's images come as `GemmaImageInput`: each row's images (padded to the most any row
has) and how many of them are real. In the language model, each image's tokens attend to
each other in both directions (`jaxppo.models.families.gemma3`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.lora import tower_dense
from jaxppo.models.transformer import RMSNorm, activation

__all__ = ["GemmaVisionConfig", "GemmaVisionEncoder", "GemmaImageInput", "gemma_image_input", "gemma_vision_hf_name"]


@dataclasses.dataclass(frozen=True)
class GemmaVisionConfig:
    """SigLIP's shape (Hugging Face's `SiglipVisionConfig` names), the projector's
    `mm_tokens_per_image` and the image's marker tokens (`boi_token_id`, `eoi_token_id`:
    the tokens before and after an image's tokens)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    mm_tokens_per_image: int
    boi_token_id: int
    eoi_token_id: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"vision hidden_size {self.hidden_size} must split into {self.num_attention_heads} heads")
        side, tokens = self.image_size // self.patch_size, int(round(self.mm_tokens_per_image ** 0.5))
        if self.image_size % self.patch_size or tokens * tokens != self.mm_tokens_per_image or side % tokens:
            raise ValueError(f"image_size {self.image_size}, patch_size {self.patch_size} and mm_tokens_per_image "
                             f"{self.mm_tokens_per_image}: the image must cut into a square grid of patches that "
                             "pools evenly to a square of tokens")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported; supported: gelu_pytorch_tanh, "
                             "gelu")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def flops(self, out_size: int) -> float:
        """The encoder's forward FLOPs for one image (every image has the one size): the
        patch embedding, each layer's projections, MLP and attention over the image's
        patches, and the projector to `out_size` (the language model's width) per image
        token."""
        n, d = self.patches_per_side ** 2, self.hidden_size
        per_patch = 4 * d * d + 2 * d * self.intermediate_size
        embed = n * d * self.num_channels * self.patch_size ** 2
        return (2.0 * (embed + self.num_hidden_layers * n * per_patch + self.mm_tokens_per_image * d * out_size)
                + 4.0 * self.num_hidden_layers * d * n * n)

    @classmethod
    def from_hf(cls, d: dict) -> "GemmaVisionConfig":
        """From a Hugging Face Gemma 3 config dict (its `vision_config` and the fields
        beside it)."""
        v = d["vision_config"]
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
                   image_size=v["image_size"], patch_size=v["patch_size"],
                   mm_tokens_per_image=d.get("mm_tokens_per_image", 256), boi_token_id=d["boi_token_index"],
                   eoi_token_id=d["eoi_token_index"], num_channels=v.get("num_channels", 3),
                   layer_norm_eps=v.get("layer_norm_eps", 1e-6), hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"))

    def to_hf(self) -> dict:
        """(the Hugging Face `vision_config` dict, the fields beside it)."""
        vision = dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                      num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                      image_size=self.image_size, patch_size=self.patch_size, num_channels=self.num_channels,
                      layer_norm_eps=self.layer_norm_eps, hidden_act=self.hidden_act, vision_use_head=False)
        return vision, dict(mm_tokens_per_image=self.mm_tokens_per_image, boi_token_index=self.boi_token_id,
                            eoi_token_index=self.eoi_token_id)


class GemmaImageInput(NamedTuple):
    """The images of a batch of rows: `pixels` (B, M, channels, size, size), each row's images
    as the image processor gives them, padded with blank images to M (the most a row has);
    `tokens` (B,) the image tokens of each row's real images (mm_tokens_per_image each).
    Row b's first tokens[b] image tokens take its images' embeddings in order; image tokens
    after them (a sampled one) are text."""

    pixels: Any
    tokens: Any


def gemma_image_input(pixel_rows, config: GemmaVisionConfig, images: int = None) -> GemmaImageInput:
    """The `GemmaImageInput` of rows whose images are `pixel_rows[b]` ((n_b, channels, size,
    size), the processor's `pixel_values`), padded to `images` per row (default: the most
    any row has, at least 1)."""
    shape = (config.num_channels, config.image_size, config.image_size)
    counts = [len(rows) for rows in pixel_rows]
    m = max(counts + [1]) if images is None else images
    if max(counts + [0]) > m:
        raise ValueError(f"images={m} per row cannot hold a row of {max(counts)} images")
    pixels = np.zeros((len(counts), m) + shape, np.float32)
    for b, rows in enumerate(pixel_rows):
        rows = np.asarray(rows, np.float32).reshape((-1,) + shape) if len(rows) else np.zeros((0,) + shape)
        if rows.shape[1:] != shape:
            raise ValueError(f"row {b}: pixel values of shape {rows.shape[1:]} per image; the model takes {shape}")
        pixels[b, :len(rows)] = rows
    return GemmaImageInput(pixels, np.asarray(counts, np.int32) * config.mm_tokens_per_image)


class _Layer(nn.Module):
    config: GemmaVisionConfig
    dtype: Any
    param_dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        dense = lambda n, name: tower_dense(n, name, **kw, lora=self.lora)  # noqa: E731
        h = nn.LayerNorm(c.layer_norm_eps, **kw, name="layer_norm1")(x)
        n, heads, d = x.shape[0], c.num_attention_heads, c.head_dim
        q, k, v = (dense(c.hidden_size, f"{p}_proj")(h).reshape(n, heads, d) for p in "qkv")
        scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(d)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1).astype(self.dtype), v).reshape(n, -1)
        x = x + dense(c.hidden_size, "out_proj")(out)
        h = nn.LayerNorm(c.layer_norm_eps, **kw, name="layer_norm2")(x)
        h = activation(c.hidden_act)(dense(c.intermediate_size, "fc1")(h))
        return x + dense(c.hidden_size, "fc2")(h)


class GemmaVisionEncoder(nn.Module):
    """SigLIP and Gemma 3's projector: images (M, channels, size, size) -> image token
    embeddings (M, mm_tokens_per_image, `out_size`), each image's tokens row by row.
    `lora`: adapters on the tower's layers' linear maps, (rank, scale, enabled)
    (`jaxppo.models.LoraConfig.tower`), or None (the projector's matrix gets none)."""

    config: GemmaVisionConfig
    out_size: int
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: Any = None

    @nn.compact
    def __call__(self, pixels):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        m, side, p = pixels.shape[0], c.patches_per_side, c.patch_size
        # (M, C, side, p, side, p) -> (M, side * side, C * p * p): Conv2d's (out, C, p, p) order.
        patches = pixels.reshape(m, c.num_channels, side, p, side, p).transpose(0, 2, 4, 1, 3, 5)
        x = nn.Dense(c.hidden_size, **kw, name="patch_embedding")(
            patches.reshape(m, side * side, -1).astype(self.dtype))
        x = x + nn.Embed(side * side, c.hidden_size, param_dtype=self.param_dtype,
                         name="position_embedding")(jnp.arange(side * side))[None].astype(x.dtype)
        layer = nn.vmap(_Layer, variable_axes={"params": None, "lora": None}, split_rngs={"params": False})
        for i in range(c.num_hidden_layers):
            x = layer(c, self.dtype, self.param_dtype, self.lora, name=f"layers_{i}")(x)
        x = nn.LayerNorm(c.layer_norm_eps, **kw, name="post_layernorm")(x)
        # The projector: the patch grid average-pooled to a square of tokens, normed, mapped.
        tokens = int(round(c.mm_tokens_per_image ** 0.5))
        k = side // tokens
        x = x.reshape(m, tokens, k, tokens, k, c.hidden_size).astype(jnp.float32).mean(axis=(2, 4))
        x = RMSNorm(c.layer_norm_eps, self.dtype, self.param_dtype, True, name="mm_soft_emb_norm")(
            x.reshape(m, c.mm_tokens_per_image, c.hidden_size).astype(self.dtype))
        weight = self.param("mm_input_projection_weight", nn.initializers.normal(0.02), (c.hidden_size, self.out_size),
                            self.param_dtype)
        return jnp.einsum("mtd,de->mte", x, weight.astype(self.dtype))


_LEAF_NAMES = {"kernel": "weight", "bias": "bias", "scale": "weight", "embedding": "weight"}


def gemma_vision_hf_name(path: tuple, config: GemmaVisionConfig, tower: str = "vision_tower"):
    """(Hugging Face name, layout) of the encoder's parameter at `path` (inside the encoder):
    the tower's under `tower` ("vision_tower" as transformers 5 saves it,
    "vision_tower.vision_model" in Gemma 3's published checkpoints), the projector's under
    "multi_modal_projector"; Linear kernels transposed, the patch embedding a Conv2d."""
    if path == ("mm_input_projection_weight",):
        return "multi_modal_projector.mm_input_projection_weight", False
    if path[0] == "mm_soft_emb_norm":
        return "multi_modal_projector.mm_soft_emb_norm.weight", False
    leaf = _LEAF_NAMES[path[-1]]
    if path == ("patch_embedding", "kernel"):
        p = config.patch_size
        return f"{tower}.embeddings.patch_embedding.weight", (config.hidden_size, config.num_channels, p, p)
    if path[0] in ("patch_embedding", "position_embedding"):
        return f"{tower}.embeddings.{path[0]}.{leaf}", False
    if path[0] == "post_layernorm":
        return f"{tower}.post_layernorm.{leaf}", False
    index = path[0].rsplit("_", 1)[1]  # layers_{i}/<module>/<leaf>
    module = path[1]
    group = "self_attn." if module.endswith("_proj") else "mlp." if module in ("fc1", "fc2") else ""
    return f"{tower}.encoder.layers.{index}.{group}{module}.{leaf}", path[-1] == "kernel"
