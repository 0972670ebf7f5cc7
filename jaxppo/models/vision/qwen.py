"""Qwen2.5-VL's vision encoder in Flax, the layout of its patches, and the language model's
3-D rotary positions (M-RoPE).

The image processor (transformers' `Qwen2VLImageProcessor`) cuts an image into a grid of
t x h x w patches (t = 1 for a still image, repeated over `temporal_patch_size` frames) and
flattens each patch to in_channels * temporal_patch_size * patch_size^2 values, ordered so
that every spatial_merge_size^2 block of neighbouring patches is consecutive. The encoder:

1. a linear patch embedding (Hugging Face's Conv3d, whose stride equals its kernel);
2. rotary positions in two dimensions: half of each head's rotated pairs turn with the
   patch's row, half with its column;
3. `depth` pre-norm blocks (RMSNorm, attention, RMSNorm, gated MLP) that attend within
   windows of `window_size` pixels, except the blocks of `fullatt_block_indexes`, which
   attend over their whole image (frame);
4. the merger: RMSNorm, each block of merge^2 patches concatenated, an MLP to the language
   model's width: one image token per block.

The patches are visited window by window (`VisionLayout.order`) so each window is a run of
consecutive rows; each window (each frame, in the full blocks) attends alone, gathered
through its slots (`VisionLayout.window_slots`, `frame_slots`), so no block holds scores
over all the row's patches at once. Everything about the grids is computed on the host
(`vision_layout`) and static for the compiled encoder.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.lora import tower_dense
from jaxppo.models.transformer import RMSNorm, activation
from jaxppo.models.vision.prompt import ImagePrompt

__all__ = ["QwenVisionConfig", "QwenVisionEncoder", "VisionLayout", "vision_layout", "mrope_positions",
           "vision_params_from_hf", "vision_hf_name", "ImageInput", "image_input", "smallest_image_input",
           "image_prompt", "ImageShape", "image_shape"]


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """The vision transformer's shape (Hugging Face's `Qwen2_5_VLVisionConfig` names)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: Optional[int] = 112
    fullatt_block_indexes: Tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} must split into {self.num_heads} heads whose "
                             "size is a multiple of 4 (half of each head turns with the rows, half with the columns)")
        unit = self.spatial_merge_size * self.patch_size
        if self.window_size is not None and self.window_size % unit:
            raise ValueError(f"vision window_size {self.window_size} must be a multiple of spatial_merge_size x "
                             f"patch_size ({unit})")
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        """Values per flattened patch (the processor's `pixel_values` row width)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per image token."""
        return self.spatial_merge_size ** 2

    def flops(self, grid) -> float:
        """The encoder's forward FLOPs for one image of patch grid (t, h, w): the patch
        embedding, each block's projections and gated MLP per patch, its attention within
        windows (frames in the full-attention blocks) as computed, and the merger per image
        token (a multiply-add is 2 FLOPs)."""
        t, h, w = (int(v) for v in grid)
        n, d = t * h * w, self.hidden_size
        side = max(h, w) if self.window_size is None else self.window_size // self.patch_size
        window = min(h, side) * min(w, side)  # the patches a windowed block's patch attends to, at most
        per_patch = 4 * d * d + 3 * d * self.intermediate_size
        full = len(self.fullatt_block_indexes) if self.window_size is not None else self.depth
        attention = 4 * d * n * (full * h * w + (self.depth - full) * window)
        merger = (n // self.merge_unit) * (self.merge_unit * d) * (self.merge_unit * d + self.out_hidden_size)
        return 2.0 * (n * d * self.patch_values + self.depth * n * per_patch + merger) + attention

    def to_hf(self) -> dict:
        """The Hugging Face `vision_config` dict."""
        return dict(depth=self.depth, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_heads=self.num_heads, out_hidden_size=self.out_hidden_size, in_channels=self.in_channels,
                    patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
                    spatial_merge_size=self.spatial_merge_size, window_size=self.window_size,
                    fullatt_block_indexes=list(self.fullatt_block_indexes), hidden_act=self.hidden_act,
                    rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta})

    @classmethod
    def from_hf(cls, d: dict) -> "QwenVisionConfig":
        """From a Hugging Face `vision_config` dict."""
        rope = d.get("rope_parameters") or {}
        return cls(depth=d["depth"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_heads=d["num_heads"], out_hidden_size=d["out_hidden_size"],
                   in_channels=d.get("in_channels", 3), patch_size=d.get("patch_size", 14),
                   temporal_patch_size=d.get("temporal_patch_size", 2),
                   spatial_merge_size=d.get("spatial_merge_size", 2), window_size=d.get("window_size", 112),
                   fullatt_block_indexes=tuple(d.get("fullatt_block_indexes", ())),
                   hidden_act=d.get("hidden_act", "silu"), rope_theta=float(rope.get("rope_theta", 10000.0)))


class VisionLayout(NamedTuple):
    """The patches of a tuple of image grids as the encoder visits them (numpy, host).

    order: (N,) patch indices, window by window (the encoder's row i is patch order[i]).
    positions: (N, 2) each visited patch's (row, column) in its image.
    restore: (N / merge_unit,) where each image token, in the processor's order, is among
      the merged rows.
    window_slots: (windows, largest window) the visited rows of each window (a run of
      consecutive rows), padded with N: the windowed blocks attend window by window.
    frame_slots: (frames, largest frame) the same for the frames (image, t): the full blocks.
    sizes: (N, 2) each visited patch's image grid (h, w) (what Qwen3-VL's learned position
      embeddings are resampled to).
    """

    order: np.ndarray
    positions: np.ndarray
    restore: np.ndarray
    window_slots: np.ndarray
    frame_slots: np.ndarray
    sizes: np.ndarray


def _slots(sizes: Sequence[int], n: int) -> np.ndarray:
    """The rows of consecutive runs of `sizes` rows, one run a line, padded with `n` (the
    encoder's empty row): (runs, largest run)."""
    out = np.full((len(sizes), max(sizes, default=0)), n, np.int32)
    for i, (start, size) in enumerate(zip(np.cumsum([0] + list(sizes)), sizes)):
        out[i, :size] = np.arange(start, start + size)
    return out


def _run_sizes(table: np.ndarray, count: int) -> list:
    """The sizes of a slot table's runs (each run's rows below `count`, the real rows)."""
    return list((table < count).sum(axis=1))


def _pad_slots(tables: Sequence[np.ndarray], counts: Sequence[int], n: int, least=(0, 0)) -> np.ndarray:
    """Rows' slot tables (each its `vision_layout`'s, of `counts[b]` real rows) for rows of
    `n` rows: the same runs, then the padding rows count .. n - 1 in runs no longer than the
    longest real one (what they compute is dropped; longer runs would only widen every
    row's table), the empty row n; stacked, padded with n to the largest, and to at least
    `least` = (runs, width) (a shape fixed for many batches, `ImageShape`)."""
    sizes = [_run_sizes(table, count) for table, count in zip(tables, counts)]
    width = max([size for row in sizes for size in row] + [least[1]] or [n]) or n
    rows = [_slots(row + [min(width, n - start) for start in range(count, n, width)], n)
            for row, count in zip(sizes, counts)]
    out = np.full((len(rows), max([len(r) for r in rows] + [least[0]]), width), n, np.int32)
    for b, r in enumerate(rows):
        out[b, :r.shape[0], :r.shape[1]] = r
    return out


def _check_grid(grid, config: QwenVisionConfig) -> Tuple[int, int, int]:
    t, h, w = (int(v) for v in grid)
    m = config.spatial_merge_size
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(f"image grid (t, h, w) = {(t, h, w)}: each must be positive and h, w multiples of "
                         f"spatial_merge_size {m}")
    return t, h, w


def vision_layout(grids: Sequence[Sequence[int]], config: QwenVisionConfig) -> VisionLayout:
    """The `VisionLayout` of images with patch grids `grids` ((t, h, w) each, as the
    processor's `image_grid_thw`), their patches concatenated in that order."""
    m, unit = config.spatial_merge_size, config.merge_unit
    merged, windows, frames, positions, sizes, start = [], [], [], [], [], 0
    for grid in grids:
        t, h, w = _check_grid(grid, config)
        rows, cols = h // m, w // m
        # a window's side in image tokens (no windows: the whole frame is one)
        side = max(rows, cols) if config.window_size is None else config.window_size // m // config.patch_size
        tokens = np.arange(t * rows * cols).reshape(t, rows, cols) + start
        for f in range(t):  # windows row-major within each frame: the order the encoder visits
            for i in range(0, rows, side):
                for j in range(0, cols, side):
                    merged.append(tokens[f, i:i + side, j:j + side].reshape(-1))
                    windows.append(merged[-1].size * unit)
            frames.append(rows * cols * unit)
        # (row, column) of each patch in the processor's order: merge blocks row-major, the
        # patches of a block row-major inside it; the same for every frame.
        r, c = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = lambda a: a.reshape(rows, m, cols, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        positions.append(np.tile(np.stack([blocks(r), blocks(c)], axis=-1), (t, 1)))
        sizes.append(np.tile([h, w], (t * h * w, 1)))
        start += t * rows * cols
    merged = np.concatenate(merged) if merged else np.zeros(0, np.int64)
    order = (merged[:, None] * unit + np.arange(unit)).reshape(-1)
    n = len(order)
    positions = np.concatenate(positions)[order] if positions else np.zeros((0, 2))
    sizes = np.concatenate(sizes)[order] if sizes else np.zeros((0, 2))
    return VisionLayout(order.astype(np.int32), positions.astype(np.int32), np.argsort(merged).astype(np.int32),
                        _slots(windows, n), _slots(frames, n), sizes.astype(np.int32))


class ImageInput(NamedTuple):
    """The images of a batch of rows, as the model takes them: `pixels` (B, N, patch_values),
    each row's patches (its images' `pixel_values` concatenated, padded to N), and `layout`,
    each row's `VisionLayout` with a leading B axis (padding patches after the real ones, in
    windows and frames of their own, so they change nothing the real patches see); `tokens`
    (B,) the image tokens of each row's images. Row b's first tokens[b] image tokens take
    its first embeddings in order; image tokens after them (a sampled one) are text."""

    pixels: Any
    layout: VisionLayout
    tokens: Any


class ImageShape(NamedTuple):
    """The padded shape of a batch's `ImageInput`: `patches` per row, and the (runs, width)
    of its window and frame slot tables. Batches of one shape run one compiled program;
    `image_shape` gives the smallest that holds a set of rows (a run's whole prompt set)."""

    patches: int
    windows: Tuple[int, int]
    frames: Tuple[int, int]


def image_shape(grid_rows: Sequence[Sequence[Sequence[int]]], config: QwenVisionConfig) -> ImageShape:
    """The smallest `ImageShape` that holds every row of `grid_rows` (each row's images'
    grids, (t, h, w) each): `image_input(..., shape=)` pads any batch of these rows to it."""
    layouts = [vision_layout(grids, config) for grids in grid_rows]
    counts = [len(layout.order) for layout in layouts]
    n = max(counts + [config.merge_unit])
    n += -n % config.merge_unit

    def least(tables):
        width = max([s for table, count in zip(tables, counts) for s in _run_sizes(table, count)] + [0]) or n
        runs = max(len(_run_sizes(table, count)) + -(-(n - count) // width) for table, count in zip(tables, counts))
        return int(runs), int(width)

    return ImageShape(n, least([lay.window_slots for lay in layouts]), least([lay.frame_slots for lay in layouts]))


def image_input(pixel_rows: Sequence[np.ndarray], grid_rows: Sequence[Sequence[Sequence[int]]],
                config: QwenVisionConfig, patches: int = None, shape: ImageShape = None) -> ImageInput:
    """The `ImageInput` of rows whose images have patches `pixel_rows[b]` ((n_b,
    patch_values), the processor's `pixel_values` of the row's images) and grids
    `grid_rows[b]` ((t, h, w) each, the processor's `image_grid_thw`), padded to `patches`
    per row (default: the largest row's), or to `shape` (`image_shape` of a set of rows
    these are among: the same shape for every batch of them). A row may have no image (an
    empty grid list)."""
    if len(pixel_rows) != len(grid_rows):
        raise ValueError(f"{len(pixel_rows)} rows of pixels for {len(grid_rows)} rows of image grids")
    counts = [sum(t * h * w for t, h, w in (_check_grid(g, config) for g in grids)) for grids in grid_rows]
    unit = config.merge_unit
    n = shape.patches if shape is not None else max(counts + [unit]) if patches is None else patches
    if n < max(counts) or n % unit:
        raise ValueError(f"patches={n} per row must be a multiple of {unit} and hold the largest row's {max(counts)}")
    pixels = np.zeros((len(counts), n, config.patch_values), np.float32)
    layouts, order, positions, restore, sizes = [], [], [], [], []
    for b, (rows, grids, count) in enumerate(zip(pixel_rows, grid_rows, counts)):
        rows = np.asarray(rows, np.float32)
        if rows.shape != (count, config.patch_values) and not (count == 0 and rows.size == 0):
            raise ValueError(f"row {b}: pixel values of shape {rows.shape} for images of grids {list(grids)} "
                             f"({count} patches of {config.patch_values} values)")
        pixels[b, :count] = rows.reshape(count, config.patch_values)
        layouts.append(vision_layout(grids, config))
        order.append(np.concatenate([layouts[-1].order, np.arange(count, n)]))  # padding visited last
        positions.append(np.concatenate([layouts[-1].positions, np.zeros((n - count, 2), np.int32)]))
        restore.append(np.concatenate([layouts[-1].restore, np.arange(count // unit, n // unit)]))
        sizes.append(np.concatenate([layouts[-1].sizes, np.ones((n - count, 2), np.int32)]))
    windows = _pad_slots([lay.window_slots for lay in layouts], counts, n, shape.windows if shape else (0, 0))
    frames = _pad_slots([lay.frame_slots for lay in layouts], counts, n, shape.frames if shape else (0, 0))
    if shape is not None and (windows.shape[1:], frames.shape[1:]) != (tuple(shape.windows), tuple(shape.frames)):
        raise ValueError(f"images of grids {[list(g) for g in grid_rows]} do not fit {shape}: their slot tables are "
                         f"{windows.shape[1:]} and {frames.shape[1:]} (give the image_shape of rows that include them)")
    layout = VisionLayout(np.stack(order).astype(np.int32), np.stack(positions).astype(np.int32),
                          np.stack(restore).astype(np.int32), windows, frames, np.stack(sizes).astype(np.int32))
    return ImageInput(pixels, layout, np.asarray(counts, np.int32) // unit)


def image_prompt(ids, mask, pixel_rows, grid_rows, config, shape: ImageShape = None) -> ImagePrompt:
    """The `ImagePrompt` of left-padded rows `ids`/`mask` whose runs of the model's image
    token are the images of `grid_rows[b]` with patches `pixel_rows[b]` (the processor's
    arrays, row by row); `config` the model's `ModelConfig` (its `vision`, `image_token_id`);
    `shape` as `image_input` takes it. ValueError where a row's image tokens do not match
    its images."""
    v = config.vision
    ids, mask = np.asarray(ids), np.asarray(mask)
    for b, grids in enumerate(grid_rows):
        want = sum(t * h * w for t, h, w in grids) // v.merge_unit
        have = int(np.sum((ids[b] == config.image_token_id) & (mask[b] > 0)))
        if have != want:
            raise ValueError(f"row {b} has {have} image tokens but its {len(grids)} image(s) of grids {list(grids)} "
                             f"need {want}: give each image the processor's tokens")
    positions, nexts = mrope_positions(ids, mask, [g for row in grid_rows for g in row], config.image_token_id,
                                       v.spatial_merge_size)
    return ImagePrompt(ids, image_input(pixel_rows, grid_rows, v, shape=shape), np.moveaxis(positions, 0, -1),
                       nexts)


def _rotate(x, cos, sin):
    """Rotary embedding of x (N, H, D) in float32: pairs (i, i + D/2), Hugging Face's rotate_half."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos[:, None] + rotated * sin[:, None]).astype(x.dtype)


def check_pixels(pixel_values, layout: VisionLayout, config: QwenVisionConfig):
    """ValueError where `pixel_values` are not (N, patch_values) for the layout's N patches."""
    if pixel_values.shape != (len(layout.order), config.patch_values):
        raise ValueError(f"pixel_values of shape {pixel_values.shape} for a layout of {len(layout.order)} "
                         f"patches of {config.patch_values} values")


def rotary_tables(positions, config: QwenVisionConfig):
    """(cos, sin) (N, head_dim) of the patches' 2-D rotary positions (`positions` (N, 2), row
    and column): each head's first half of frequencies turns with the row, the second with
    the column."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    angles = (jnp.asarray(positions, jnp.float32)[:, :, None] * inv_freq).reshape(len(positions), -1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


class SegmentAttention(nn.Module):
    """A vision block's attention (Qwen2.5-VL's and Qwen3-VL's): see `__call__`."""

    config: QwenVisionConfig
    dtype: Any
    param_dtype: Any
    lora: Any = None  # the tower's adapters (`jaxppo.models.lora.tower_dense`)

    @nn.compact
    def __call__(self, x, cos, sin, slots):
        """Attention within segments: `slots` (S, W) the rows of each of S segments (a window
        or a frame), padded with N. Each segment attends alone, (S, heads, W, W) scores,
        never (N, N)."""
        c = self.config
        n = x.shape[0]
        qkv = tower_dense(3 * c.hidden_size, "qkv", self.dtype, self.param_dtype, self.lora)(x)
        q, k, v = jnp.moveaxis(qkv.reshape(n, 3, c.num_heads, c.head_dim), 1, 0)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        slots = jnp.asarray(slots)
        q, k, v = (jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])[slots] for a in (q, k, v))
        scores = jnp.einsum("swhd,suhd->shwu", q, k, preferred_element_type=jnp.float32) / np.sqrt(c.head_dim)
        scores = jnp.where((slots < n)[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("shwu,suhd->swhd", weights, v.astype(self.dtype))
        out = jnp.zeros((n + 1,) + out.shape[2:], out.dtype).at[slots].set(out)[:n].reshape(n, c.hidden_size)
        return tower_dense(c.hidden_size, "proj", self.dtype, self.param_dtype, self.lora)(out)


class _MLP(nn.Module):
    config: QwenVisionConfig
    dtype: Any
    param_dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x):
        c = self.config
        dense = lambda n, name: tower_dense(n, name, self.dtype, self.param_dtype, self.lora)  # noqa: E731
        act = activation(c.hidden_act)
        return dense(c.hidden_size, "down_proj")(act(dense(c.intermediate_size, "gate_proj")(x))
                                                 * dense(c.intermediate_size, "up_proj")(x))


class _Block(nn.Module):
    config: QwenVisionConfig
    dtype: Any
    param_dtype: Any
    lora: Any = None

    @nn.compact
    def __call__(self, x, cos, sin, slots):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        attn = SegmentAttention(c, **kw, lora=self.lora, name="attn")
        x = x + attn(RMSNorm(c.norm_eps, **kw, name="norm1")(x), cos, sin, slots)
        return x + _MLP(c, **kw, lora=self.lora, name="mlp")(RMSNorm(c.norm_eps, **kw, name="norm2")(x))


class QwenVisionEncoder(nn.Module):
    """Qwen2.5-VL's vision transformer: `pixel_values` (N, patch_values) of images laid out as
    `layout` (`vision_layout` of their grids; its arrays may be numpy or device arrays)
    -> image token embeddings (N / merge_unit, out_hidden_size), in the processor's order
    (the order of the image tokens in the text). `lora`: adapters on its blocks' and
    merger's linear layers, (rank, scale, enabled) (`jaxppo.models.LoraConfig.tower`), or None."""

    config: QwenVisionConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora: Any = None

    @nn.compact
    def __call__(self, pixel_values, layout: VisionLayout):
        c, kw = self.config, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        check_pixels(pixel_values, layout, c)
        x = nn.Dense(c.hidden_size, use_bias=False, **kw, name="patch_embed")(pixel_values.astype(self.dtype))
        x = x[layout.order]
        cos, sin = rotary_tables(layout.positions, c)
        for i in range(c.depth):
            slots = layout.frame_slots if i in c.fullatt_block_indexes else layout.window_slots
            x = _Block(c, **kw, lora=self.lora, name=f"blocks_{i}")(x, cos, sin, slots)
        # The merger: one image token per block of merge^2 patches.
        x = RMSNorm(c.norm_eps, **kw, name="ln_q")(x).reshape(-1, c.hidden_size * c.merge_unit)
        x = tower_dense(c.hidden_size * c.merge_unit, "merger_fc1", **kw, lora=self.lora)(x)
        x = tower_dense(c.out_hidden_size, "merger_fc2", **kw, lora=self.lora)(jax.nn.gelu(x, approximate=False))
        return x[jnp.asarray(layout.restore)]


# The merger's modules and Hugging Face's names for them; every other module is a block's.
_MERGER_NAMES = {"ln_q": ["merger", "ln_q"], "merger_fc1": ["merger", "mlp", "0"], "merger_fc2": ["merger", "mlp", "2"]}
_LEAF_NAMES = {"kernel": "weight", "bias": "bias", "weight": "weight"}


def vision_hf_name(path: tuple, config: QwenVisionConfig):
    """(Hugging Face name under the encoder's prefix, layout) of the encoder's parameter at
    `path` (inside the encoder: ("blocks_0", "attn", "qkv", "kernel")); the layout as
    `jaxppo.models.family.to_hf_layout` takes it: Linear kernels transposed, the patch
    embedding a Conv3d of stride = kernel, (out, channels, t, p, p)."""
    inner, leaf = list(path[:-1]), _LEAF_NAMES[path[-1]]
    if inner == ["patch_embed"]:
        return "patch_embed.proj.weight", (config.hidden_size, config.in_channels, config.temporal_patch_size,
                                           config.patch_size, config.patch_size)
    parts = _MERGER_NAMES.get(inner[0]) or inner[0].rsplit("_", 1) + inner[1:]  # blocks_{i}/attn/qkv ...
    return ".".join(parts + [leaf]), path[-1] == "kernel"


def smallest_image_input(config: QwenVisionConfig) -> ImageInput:
    """One row with one image of a single image token (blank): what the encoder's
    parameters are made from."""
    m = config.spatial_merge_size
    return image_input([np.zeros((m * m, config.patch_values), np.float32)], [[(1, m, m)]], config)


def vision_params_from_hf(tensors: dict, config: QwenVisionConfig, prefix: str = "visual.") -> dict:
    """The encoder's parameters from Hugging Face tensors (name -> numpy array) whose names
    start with `prefix` ("visual." in Qwen2.5-VL checkpoints, "model.visual." as
    transformers 5 names them in memory), named and laid out by `vision_hf_name`."""
    from flax import traverse_util

    from jaxppo.models.family import from_hf_layout

    blank = jax.tree.map(lambda a: a[0], smallest_image_input(config))
    shapes = jax.eval_shape(lambda: QwenVisionEncoder(config).init(jax.random.key(0), blank.pixels, blank.layout))
    out = {}
    for path in traverse_util.flatten_dict(shapes["params"]):
        name, layout = vision_hf_name(path, config)
        if prefix + name not in tensors:
            raise KeyError(f"the checkpoint has no tensor {prefix + name!r} for the vision encoder")
        out[path] = from_hf_layout(np.asarray(tensors[prefix + name]), layout)
    return traverse_util.unflatten_dict(out)


def mrope_positions(ids: np.ndarray, mask: np.ndarray, grids: Sequence[Sequence[int]], image_token_id: int,
                    spatial_merge_size: int) -> Tuple[np.ndarray, np.ndarray]:
    """The language model's 3-D rotary positions (temporal, height, width) of token rows
    `ids` (B, L) with `mask` (B, L) (padding anywhere), whose runs of `image_token_id` are
    the images of `grids` in order, row by row (each image t * (h/m) * (w/m) tokens).

    Text tokens count on from the last position on all three axes; an image's tokens start
    at the position after the text before it (its height and width positions add its token
    row and column), and the text after it continues from that start + max(h, w) / m.
    Returns (positions (3, B, L) int32, 0 at padding; next (B,): each row's next position,
    that of the first token sampled after it, on all three axes)."""
    ids, mask = np.asarray(ids), np.asarray(mask).astype(bool)
    m = spatial_merge_size
    positions = np.zeros((3,) + ids.shape, np.int32)
    nexts = np.zeros(ids.shape[0], np.int32)
    images = iter([tuple(int(v) for v in g) for g in grids])
    for b in range(ids.shape[0]):
        where = np.flatnonzero(mask[b])
        row, out, pos, i = ids[b, where], np.zeros((3, len(where)), np.int64), 0, 0
        while i < len(row):
            if row[i] != image_token_id:
                out[:, i] = pos
                pos, i = pos + 1, i + 1
                continue
            try:
                t, h, w = next(images)
            except StopIteration:
                raise ValueError(f"row {b}: more runs of image tokens than the {len(grids)} image grids "
                                 "given") from None
            count = t * (h // m) * (w // m)
            if not np.all(row[i:i + count] == image_token_id):
                raise ValueError(f"row {b}: an image of grid {(t, h, w)} needs {count} consecutive image tokens; "
                                 f"the row has {int(np.sum(row[i:i + count] == image_token_id))} at position {i}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
            out[:, i:i + count] = pos + np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)])
            pos, i = pos + max(h, w) // m, i + count
        positions[:, b, where] = out
        nexts[b] = out.max(initial=-1) + 1
    if next(images, None) is not None:
        raise ValueError(f"{len(grids)} image grids given but fewer runs of image tokens in the rows")
    return positions, nexts
