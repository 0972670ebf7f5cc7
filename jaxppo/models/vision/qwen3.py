"""Qwen3-VL's vision encoder in Flax.

The patches are cut and laid out as Qwen2.5-VL's (`jaxppo.models.vision.qwen`: the same
image processor, `vision_layout`, `ImageInput`, `image_prompt`); the encoder differs:

1. a linear patch embedding with a bias (Hugging Face's Conv3d, stride = kernel);
2. learned position embeddings on a square grid of `num_position_embeddings`, resampled
   bilinearly (corners aligned) to each image's patch grid, added to the patches;
3. the same 2-D rotary positions (half of each head's pairs turn with the row, half with
   the column);
4. `depth` pre-norm blocks (LayerNorm, attention over the whole frame, LayerNorm, an MLP
   with a tanh GELU), all with biases;
5. the merger (LayerNorm, each block of merge^2 patches concatenated, an MLP to the
   language model's width), and one more merger after each block of
   `deepstack_visual_indexes` (its LayerNorm after the concatenation): DeepStack's
   features, which the language model adds to the image tokens' hidden states after its
   first layers (`jaxppo.models.families.qwen_vl`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo.models.lora import tower_dense
from jaxppo.models.transformer import activation
from jaxppo.models.vision.qwen import QwenVisionConfig, SegmentAttention, VisionLayout, check_pixels, rotary_tables

__all__ = ["Qwen3VisionConfig", "Qwen3VisionEncoder", "vision3_hf_name"]


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(QwenVisionConfig):
    """Qwen3-VL's vision transformer (Hugging Face's `Qwen3VLVisionConfig` names): Qwen2.5-VL's
    fields without windows, plus the learned position grid and DeepStack's layers."""

    patch_size: int = 16
    window_size: Any = None
    fullatt_block_indexes: Tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: Tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        side = int(round(self.num_position_embeddings ** 0.5))
        if side * side != self.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {self.num_position_embeddings} must be a square (a "
                             "side x side grid of learned positions)")
        indexes = tuple(int(i) for i in self.deepstack_visual_indexes)
        if any(not 0 <= i < self.depth for i in indexes):
            raise ValueError(f"vision deepstack_visual_indexes {indexes} must be blocks of 0 .. {self.depth - 1}")
        object.__setattr__(self, "deepstack_visual_indexes", indexes)
        try:
            activation(self.hidden_act)
        except KeyError:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported; supported: gelu_pytorch_tanh, "
                             "gelu_new, gelu, relu, silu") from None

    @property
    def grid_side(self) -> int:
        """The side of the learned position grid."""
        return int(round(self.num_position_embeddings ** 0.5))

    def flops(self, grid) -> float:
        """The encoder's forward FLOPs for one image of patch grid (t, h, w): the patch
        embedding, each block's projections and MLP per patch and its attention over the
        frame, the merger and DeepStack's mergers per image token."""
        t, h, w = (int(v) for v in grid)
        n, d, wide = t * h * w, self.hidden_size, self.merge_unit * self.hidden_size
        per_patch = 4 * d * d + 2 * d * self.intermediate_size
        mergers = (1 + len(self.deepstack_visual_indexes)) * (n // self.merge_unit) * wide * (wide + self.out_hidden_size)
        return 2.0 * (n * d * self.patch_values + self.depth * n * per_patch + mergers) + 4.0 * self.depth * d * n * (n // t)

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3VisionConfig":
        """From a Hugging Face `vision_config` dict."""
        if d.get("window_size") is not None:
            raise ValueError("a Qwen3-VL vision_config has no window_size")
        rope = d.get("rope_parameters") or {}
        return cls(depth=d["depth"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_heads=d["num_heads"], out_hidden_size=d["out_hidden_size"],
                   in_channels=d.get("in_channels", 3), patch_size=d.get("patch_size", 16),
                   temporal_patch_size=d.get("temporal_patch_size", 2),
                   spatial_merge_size=d.get("spatial_merge_size", 2), hidden_act=d.get("hidden_act", "gelu_pytorch_tanh"),
                   rope_theta=float(rope.get("rope_theta", 10000.0)),
                   num_position_embeddings=d.get("num_position_embeddings", 2304),
                   deepstack_visual_indexes=tuple(d.get("deepstack_visual_indexes", ())))

    def to_hf(self) -> dict:
        """The Hugging Face `vision_config` dict: Qwen2.5-VL's fields without the windows,
        with the learned position grid and DeepStack's layers."""
        d = {k: v for k, v in super().to_hf().items() if k not in ("window_size", "fullatt_block_indexes")}
        return dict(d, num_position_embeddings=self.num_position_embeddings,
                    deepstack_visual_indexes=list(self.deepstack_visual_indexes))


def _taps(index, size, side):
    """Bilinear taps (2 per patch) into a `side`-long axis for patch `index` of `size` on
    that axis, corners aligned (torch's `interpolate(align_corners=True)`): (taps, weights)."""
    src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
    floor = jnp.floor(src)
    offsets = jnp.arange(2, dtype=jnp.float32)
    taps = jnp.clip(floor[:, None] + offsets, 0, side - 1).astype(jnp.int32)
    return taps, jnp.maximum(1 - jnp.abs(src[:, None] - floor[:, None] - offsets), 0)


class _Merger(nn.Module):
    config: Qwen3VisionConfig
    postshuffle: bool
    dtype: Any
    param_dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        wide = c.hidden_size * c.merge_unit
        norm = nn.LayerNorm(1e-6, **kw, name="norm")
        x = norm(x.reshape(-1, wide)) if self.postshuffle else norm(x).reshape(-1, wide)
        x = tower_dense(wide, "linear_fc1", **kw, lora=self.lora)(x)
        return tower_dense(c.out_hidden_size, "linear_fc2", **kw, lora=self.lora)(jax.nn.gelu(x, approximate=False))


class _Block(nn.Module):
    config: Qwen3VisionConfig
    dtype: Any
    param_dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, slots):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        attn = SegmentAttention(c, **kw, lora=self.lora, name="attn")
        x = x + attn(nn.LayerNorm(1e-6, **kw, name="norm1")(x), cos, sin, slots)
        h = nn.LayerNorm(1e-6, **kw, name="norm2")(x)
        h = tower_dense(c.intermediate_size, "linear_fc1", **kw, lora=self.lora)(h)
        return x + tower_dense(c.hidden_size, "linear_fc2", **kw, lora=self.lora)(activation(c.hidden_act)(h))


class Qwen3VisionEncoder(nn.Module):
    """Qwen3-VL's vision transformer: `pixel_values` (N, patch_values) of images laid out as
    `layout` (`jaxppo.models.vision.vision_layout` of their grids) -> (image token
    embeddings (N / merge_unit, out_hidden_size), DeepStack's features (len
    deepstack_visual_indexes, N / merge_unit, out_hidden_size)), both in the processor's
    order (the order of the image tokens in the text). `lora`: as `QwenVisionEncoder`'s."""

    config: Qwen3VisionConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: Any = None

    @nn.compact
    def __call__(self, pixel_values, layout: VisionLayout):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        check_pixels(pixel_values, layout, c)
        x = nn.Dense(c.hidden_size, **kw, name="patch_embed")(pixel_values.astype(self.dtype))[layout.order]
        table = self.param("pos_embed", nn.initializers.normal(0.02), (c.num_position_embeddings, c.hidden_size),
                           self.param_dtype)
        positions, sizes, side = jnp.asarray(layout.positions), jnp.asarray(layout.sizes), c.grid_side
        rows, row_weights = _taps(positions[:, 0], sizes[:, 0], side)
        cols, col_weights = _taps(positions[:, 1], sizes[:, 1], side)
        index = (rows[:, :, None] * side + cols[:, None, :]).reshape(len(x), 4)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(len(x), 4)
        x = x + jnp.sum(table.astype(jnp.float32)[index] * weights[..., None], axis=1).astype(x.dtype)
        cos, sin = rotary_tables(positions, c)
        deep = []
        for i in range(c.depth):
            x = _Block(c, **kw, lora=self.lora, name=f"blocks_{i}")(x, cos, sin, layout.frame_slots)
            if i in c.deepstack_visual_indexes:
                j = c.deepstack_visual_indexes.index(i)
                deep.append(_Merger(c, True, **kw, lora=self.lora, name=f"deepstack_merger_list_{j}")(x))
        restore = jnp.asarray(layout.restore)
        merged = _Merger(c, False, **kw, lora=self.lora, name="merger")(x)[restore]
        deep = jnp.stack([d[restore] for d in deep]) if deep else jnp.zeros((0,) + merged.shape, merged.dtype)
        return merged, deep


_LEAF_NAMES = {"kernel": "weight", "bias": "bias", "scale": "weight"}


def vision3_hf_name(path: tuple, config: Qwen3VisionConfig):
    """(Hugging Face name under the encoder's prefix, layout) of the encoder's parameter at
    `path` (inside the encoder), the layout as `jaxppo.models.family.to_hf_layout` takes
    it: Linear kernels transposed, the patch embedding a Conv3d of stride = kernel."""
    if path == ("pos_embed",):
        return "pos_embed.weight", False
    if path == ("patch_embed", "kernel"):
        return "patch_embed.proj.weight", (config.hidden_size, config.in_channels, config.temporal_patch_size,
                                           config.patch_size, config.patch_size)
    if path[0] == "patch_embed":
        return "patch_embed.proj.bias", False
    parts = []
    for p in path[:-1]:
        head, _, tail = p.rpartition("_")
        parts += [head, tail] if tail.isdigit() and head in ("blocks", "deepstack_merger_list") else [p]
    if parts[0] == "blocks" and parts[2] in ("linear_fc1", "linear_fc2"):
        parts.insert(2, "mlp")
    return ".".join(parts + [_LEAF_NAMES[path[-1]]]), path[-1] == "kernel"

