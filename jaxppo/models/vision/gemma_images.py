"""How a Gemma 3 policy reads the images of a run's prompts (`GemmaImages`): every image is
resized by the image processor to one square size and becomes `mm_tokens_per_image` image
tokens, written where the prompt shows the image (its start-of-image token) as Gemma 3's
processor writes them: a blank line, the start-of-image token, the image tokens, the
end-of-image token, a blank line.

The image processor is transformers' (`Gemma3ImageProcessor`; its PIL backend,
`Gemma3ImageProcessorPil`, needs no PyTorch), loaded from the checkpoint's
`preprocessor_config.json` or given with the processor. Pan and scan (extra crops of an
image) is refused."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxppo.models.vision.gemma import GemmaImageInput, gemma_image_input
from jaxppo.models.vision.prompt import ImagePrompt

__all__ = ["GemmaImages"]


@dataclasses.dataclass(frozen=True)
class GemmaImages:
    """The images of a Gemma 3 policy's prompts: `processor` (transformers'
    `Gemma3ImageProcessor`), `config` (the policy's `ModelConfig`), `tokenizer` (for the
    marker tokens' text). Without a processor and tokenizer (a plan, which processes no
    image) only `grid_of`, `tokens`, `shape` and `abstract` work."""

    processor: Any
    config: Any
    tokenizer: Any = None

    def __post_init__(self):
        v, p = self.config.vision, self.processor
        if p is None:
            return
        size = getattr(p, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        if (get("height"), get("width")) != (v.image_size, v.image_size):
            raise ValueError(f"the image processor resizes to {get('height')} x {get('width')}; the model's vision "
                             f"encoder takes {v.image_size} x {v.image_size}: give the processor saved with this "
                             "checkpoint")
        if getattr(p, "do_pan_and_scan", None):
            raise ValueError("the image processor has do_pan_and_scan=True (extra crops of each image, a number "
                             "that depends on the image): not supported; set it to False")

    @property
    def placeholder(self) -> Optional[str]:
        """The text that shows an image in a rendered prompt: the start-of-image token."""
        return None if self.tokenizer is None else self._token(self.config.vision.boi_token_id)

    def _token(self, token_id: int) -> str:
        return self.tokenizer.convert_ids_to_tokens(int(token_id))

    def grid(self, image) -> tuple:
        """Every image is resized to the encoder's square size: its (1, size, size)."""
        v = self.config.vision
        return 1, v.image_size, v.image_size

    def grid_of(self, height: int, width: int) -> tuple:
        """The same for an image of any size (a plan's)."""
        return self.grid(None)

    def tokens(self, grid) -> int:
        return self.config.vision.mm_tokens_per_image

    def flops(self, grid) -> float:
        """The encoder's forward FLOPs for one image."""
        return self.config.vision.flops(self.config.hidden_size)

    def expand(self, text: str, grids: Sequence[tuple]) -> str:
        """`text` with each start-of-image token written out as Gemma 3's processor writes
        it: a blank line, the start-of-image token, the image's tokens, the end-of-image
        token, a blank line."""
        parts = text.split(self.placeholder)
        if len(parts) - 1 != len(grids):
            raise ValueError(f"{len(grids)} image(s) for {len(parts) - 1} image placeholder(s)")
        v = self.config.vision
        image = (f"\n\n{self.placeholder}{self._token(self.config.image_token_id) * v.mm_tokens_per_image}"
                 f"{self._token(v.eoi_token_id)}\n\n")
        return image.join(parts)

    def shape(self, grid_rows) -> int:
        """The images per row every batch of these rows is padded to (the most any has)."""
        return max([len(row) for row in grid_rows] + [1])

    def abstract(self, rows: int, width: int, shape: int) -> ImagePrompt:
        """The shapes and dtypes of `prompt`'s result for `rows` rows `width` tokens wide,
        its ids None."""
        import jax

        v = self.config.vision
        i32 = lambda *s: jax.ShapeDtypeStruct((rows,) + s, np.int32)  # noqa: E731
        pixels = jax.ShapeDtypeStruct((rows, shape, v.num_channels, v.image_size, v.image_size), np.float32)
        return ImagePrompt(None, GemmaImageInput(pixels, i32()), i32(width), i32())

    def prompt(self, ids, mask, image_rows, grid_rows, shape: int) -> ImagePrompt:
        """The `ImagePrompt` of left-padded rows `ids` / `mask` whose images are
        `image_rows[b]` (PIL images): each row's images processed once (rows that are the
        same prompt share the arrays); positions count the real tokens, images' too."""
        pixel_rows, done = [], {}
        for images in image_rows:
            key = tuple(map(id, images))
            if key not in done:
                done[key] = self._pixels(images)
            pixel_rows.append(done[key])
        return gemma_prompt(ids, mask, pixel_rows, self.config, shape)

    def _pixels(self, images):
        v = self.config.vision
        if not images:
            return np.zeros((0, v.num_channels, v.image_size, v.image_size), np.float32)
        return np.asarray(self.processor(images=list(images), return_tensors="np")["pixel_values"], np.float32)


def gemma_prompt(ids, mask, pixel_rows, config, images: int = None) -> ImagePrompt:
    """The `ImagePrompt` of left-padded rows `ids` / `mask` whose image tokens are the images
    `pixel_rows[b]` ((n_b, channels, size, size), the processor's `pixel_values`), padded to
    `images` per row; ValueError where a row's image tokens are not mm_tokens_per_image per
    image. Positions count the real tokens (an image's tokens too), as Gemma 3's are."""
    ids, mask = np.asarray(ids), np.asarray(mask)
    per = config.vision.mm_tokens_per_image
    for b, rows in enumerate(pixel_rows):
        have = int(np.sum((ids[b] == config.image_token_id) & (mask[b] > 0)))
        if have != len(rows) * per:
            raise ValueError(f"row {b} has {have} image tokens but its {len(rows)} image(s) need {len(rows) * per}: "
                             "give each image the processor's tokens")
    positions = np.maximum(np.cumsum(mask > 0, axis=1) - 1, 0).astype(np.int32)
    return ImagePrompt(ids, gemma_image_input(pixel_rows, config.vision, images), positions,
                       np.sum(mask > 0, axis=1).astype(np.int32))
