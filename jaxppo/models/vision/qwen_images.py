"""How a Qwen2.5-VL or Qwen3-VL policy reads the images of a run's prompts (`QwenImages`): the number
of image tokens each image becomes, read from its size as the model's own image processor
resizes it, and a batch's images processed once into the `ImagePrompt` that the samplers,
the forward pass and the update all take (the same pixel values everywhere).

The image processor is transformers' (`Qwen2VLImageProcessor`; its PIL backend,
`Qwen2VLImageProcessorPil`, needs no PyTorch), loaded from the checkpoint's
`preprocessor_config.json` or given with the processor."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxppo.models.vision.prompt import ImagePrompt
from jaxppo.models.vision.qwen import ImageInput, ImageShape, VisionLayout, image_prompt, image_shape

__all__ = ["QwenImages"]


def _size_bounds(processor):
    """(min_pixels, max_pixels) of the processor's resize (transformers 5's `size` holds
    them as shortest_edge / longest_edge; older processors as min_pixels / max_pixels)."""
    size = getattr(processor, "size", None) or {}
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    low = get("shortest_edge") or getattr(processor, "min_pixels", None)
    high = get("longest_edge") or getattr(processor, "max_pixels", None)
    if low is None or high is None:
        raise ValueError(f"the image processor {type(processor).__name__} gives no pixel bounds (size "
                         "shortest_edge / longest_edge): give the checkpoint's Qwen2VLImageProcessor")
    return int(low), int(high)


@dataclasses.dataclass(frozen=True)
class QwenImages:
    """The images of a Qwen2.5-VL or Qwen3-VL policy's prompts (both read them alike): `processor` (transformers'
    `Qwen2VLImageProcessor`, PIL or torchvision backend), `config` (the policy's
    `ModelConfig`), `placeholder` (the image token's text: a rendered prompt holds it once
    per image, where `expand` puts the image's tokens). Without a processor (None: a plan,
    which processes no image) only `grid_of`, `tokens`, `shape` and `abstract` work."""

    processor: Any
    config: Any
    placeholder: Optional[str]

    def __post_init__(self):
        if self.processor is None:
            return
        v, p = self.config.vision, self.processor
        theirs = tuple(getattr(p, k, None) for k in ("patch_size", "temporal_patch_size", "merge_size"))
        ours = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size)
        if theirs != ours:
            raise ValueError(f"the image processor's (patch_size, temporal_patch_size, merge_size) = {theirs} are not "
                             f"the model's vision_config {ours}: give the processor saved with this checkpoint")
        _size_bounds(p)

    def grid(self, image) -> tuple:
        """(t, h, w) patches of a PIL image once the processor resizes it (its `smart_resize`
        with the processor's pixel bounds); what `prompt` checks the processor gives."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        v = self.config.vision
        low, high = _size_bounds(self.processor)
        width, height = image.size
        return self.grid_of(*smart_resize(height, width, factor=v.patch_size * v.spatial_merge_size, min_pixels=low,
                                          max_pixels=high))

    def grid_of(self, height: int, width: int) -> tuple:
        """(t, h, w) patches of an image of `height` x `width` pixels as the encoder sees it
        (after the processor's resize): each side a multiple of patch_size x
        spatial_merge_size, else a ValueError saying so."""
        v = self.config.vision
        side = v.patch_size * v.spatial_merge_size
        if height < side or width < side or height % side or width % side:
            raise ValueError(f"an image of {height} x {width} pixels: each side must be a positive multiple of "
                             f"{side} (patch_size {v.patch_size} x spatial_merge_size {v.spatial_merge_size}), as "
                             "the image processor resizes it")
        return 1, height // v.patch_size, width // v.patch_size

    def tokens(self, grid) -> int:
        """The image tokens of an image of patch grid (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.config.vision.merge_unit

    def flops(self, grid) -> float:
        """The encoder's forward FLOPs for one image of patch grid (t, h, w)."""
        return self.config.vision.flops(grid)

    def expand(self, text: str, grids: Sequence[tuple]) -> str:
        """`text` with its k-th placeholder repeated as many times as image k has tokens."""
        parts = text.split(self.placeholder)
        if len(parts) - 1 != len(grids):
            raise ValueError(f"{len(grids)} image(s) for {len(parts) - 1} image placeholder(s)")
        out = [parts[0]]
        for grid, part in zip(grids, parts[1:]):
            out += [self.placeholder * self.tokens(grid), part]
        return "".join(out)

    def shape(self, grid_rows) -> ImageShape:
        """The padded shape that every batch of these rows (each a prompt's grids) takes."""
        return image_shape(grid_rows, self.config.vision)

    def abstract(self, rows: int, width: int, shape: ImageShape) -> ImagePrompt:
        """The shapes and dtypes (`jax.ShapeDtypeStruct`s) of `prompt`'s result for `rows`
        rows `width` tokens wide padded to `shape`, its ids None: what a program is compiled
        for before any image is processed."""
        import jax

        v = self.config.vision
        i32 = lambda *s: jax.ShapeDtypeStruct((rows,) + s, np.int32)  # noqa: E731
        n = shape.patches
        layout = VisionLayout(i32(n), i32(n, 2), i32(n // v.merge_unit), i32(*shape.windows), i32(*shape.frames),
                              i32(n, 2))
        images = ImageInput(jax.ShapeDtypeStruct((rows, n, v.patch_values), np.float32), layout, i32())
        return ImagePrompt(None, images, i32(width, 3), i32())

    def prompt(self, ids, mask, image_rows, grid_rows, shape: ImageShape) -> ImagePrompt:
        """The `ImagePrompt` of left-padded rows `ids` / `mask` whose images are
        `image_rows[b]` (PIL images) of grids `grid_rows[b]` (as `grid` gave them): each row's
        images processed once (rows that are the same prompt share the arrays)."""
        pixel_rows, done = [], {}
        for b, (images, grids) in enumerate(zip(image_rows, grid_rows)):
            key = tuple(map(id, images))
            if key not in done:
                done[key] = self._pixels(images, grids)
            pixel_rows.append(done[key])
        return image_prompt(ids, mask, pixel_rows, grid_rows, self.config, shape)

    def _pixels(self, images, grids):
        if not images:
            return np.zeros((0, self.config.vision.patch_values), np.float32)
        out = self.processor(images=list(images), return_tensors="np")
        got = [tuple(int(x) for x in g) for g in np.asarray(out["image_grid_thw"])]
        if got != [tuple(g) for g in grids]:
            raise RuntimeError(f"the image processor gave grids {got} where the prompts were tokenized for {list(grids)}")
        return np.asarray(out["pixel_values"], np.float32)
