"""The images of a run's prompts: read from an image column and from chat messages' image
parts, checked when the prompt set is read (before any model loads), and processed batch by
batch into the `ImagePrompt` that travels with the rollout.

A prompt's images come from

- its image column (`DataConfig.image_column`, "images" by default, or "image"): one image
  or a list of them per prompt, in the order of the prompt's image placeholders;
- its chat messages: a message's `content` may be a list of parts,
  `{"type": "text", "text": ...}` and `{"type": "image"}`; an image part may hold its image
  (`{"type": "image", "image": ...}`), or take the next of the image column's.

An image is a file path, bytes of an encoded image, a PIL image, a `{"bytes": ...}` or
`{"path": ...}` dict (a `datasets.Image` column without decoding), or an (H, W, 3) uint8
array; never a URL (nothing is downloaded). Every image is opened and decoded when the
prompts are read, so a missing or broken file stops the run before it starts; the table
keeps what was given (paths stay paths) and opens a batch's images again when the batch is
drawn.
"""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any, Sequence

import numpy as np

__all__ = ["read_image", "image_values", "TableImages", "IMAGE_COLUMNS", "has_image_parts"]

IMAGE_COLUMNS = ("images", "image")  # where `image_column` is left at its default, either name


def read_image(value, label: str):
    """The RGB PIL image that `value` gives (see the module's list); a ValueError naming
    `label`, what was wrong and what is valid otherwise."""
    import PIL.Image

    valid = ("a file path, image bytes, a PIL image, a {'bytes': ...} or {'path': ...} dict, or an (H, W, 3) uint8 "
             "array")
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, PIL.Image.Image):
            image = value
        elif isinstance(value, (str, os.PathLike)):
            path = os.fspath(value)
            if "://" in path:
                raise ValueError(f"{label}: image {path!r} is a URL; nothing is downloaded: save the image and give "
                                 "its path")
            if not os.path.isfile(path):
                raise ValueError(f"{label}: image file {path!r} does not exist")
            image = PIL.Image.open(path)
        elif isinstance(value, (bytes, bytearray)):
            image = PIL.Image.open(io.BytesIO(value))
        elif isinstance(value, np.ndarray) and value.ndim == 3 and value.shape[-1] == 3 and value.dtype == np.uint8:
            image = PIL.Image.fromarray(value)
        else:
            raise ValueError(f"{label}: an image must be {valid}; got {type(value).__name__} {value!r:.60}")
        image.load()
    except (OSError, SyntaxError) as err:  # PIL's errors for files that are not images or are cut short
        shown = repr(os.fspath(value)) if isinstance(value, (str, os.PathLike)) else f"{type(value).__name__} data"
        raise ValueError(f"{label}: the image {shown} cannot be read ({err})") from None
    return image if image.mode == "RGB" else image.convert("RGB")


def has_image_parts(prompt) -> bool:
    """Whether a chat-message prompt holds image parts."""
    return isinstance(prompt, list) and any(
        isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"]) for m in prompt)


def image_values(prompt, column_value, label: str) -> list:
    """The images of one prompt, as given (unopened), in the order the prompt shows them:
    the image parts of its chat messages, each holding its own image or taking the next of
    `column_value` (the image column's value: one image, a list, or None). ValueError where
    the counts disagree."""
    column = [] if column_value is None else list(column_value) if isinstance(column_value, (list, tuple)) \
        else [column_value]
    if not isinstance(prompt, list):
        return column
    given, out = iter(column), []
    for m in prompt:
        for part in m["content"] if isinstance(m.get("content"), list) else ():
            if part.get("type") != "image":
                continue
            value = part.get("image", part.get("path"))
            if value is None:
                value = next(given, None)
                if value is None:
                    raise ValueError(f"{label} has more image parts than images: its image column gives "
                                     f"{len(column)}; give each image part its image ({{'type': 'image', 'image': "
                                     "path}}) or one column image per part")
            out.append(value)
    rest = list(given)
    if rest and out:
        raise ValueError(f"{label} has {len(column)} images in its image column but only {len(column) - len(rest)} "
                         "image parts in its messages to show them; add a {'type': 'image'} part for each")
    return out or rest  # messages without image parts: the column's, placeholders written in their text


@dataclasses.dataclass(frozen=True)
class TableImages:
    """The images of a prompt table's rows: `values[i]`, prompt i's images as given,
    `grids[i]` their patch grids (from their sizes, as the model's processor resizes them),
    `reader` the policy family's image reader (`jaxppo.models.vision.qwen_images.QwenImages`)
    and `shape`, the padded shape every batch of these rows takes (one compiled program)."""

    values: list
    grids: list
    reader: Any
    shape: Any

    @classmethod
    def read(cls, reader, values: Sequence[list], labels: Sequence[str]):
        """Open every image (errors name its prompt) and size it; returns (table images,
        each prompt's grids)."""
        grids = [[reader.grid(read_image(v, f"{label} image {j}")) for j, v in enumerate(row)]
                 for row, label in zip(values, labels)]
        return cls(list(values), grids, reader, reader.shape(grids))

    def kept(self, keep: np.ndarray) -> "TableImages":
        """The rows that `keep` (bool, one per row) keeps; the shape stays."""
        return dataclasses.replace(self, values=[v for v, k in zip(self.values, keep) if k],
                                   grids=[g for g, k in zip(self.grids, keep) if k])

    def abstract(self, rows: int, width: int):
        """The shapes of `prompt`'s result for `rows` rows of width `width`, its ids None
        (`jax.ShapeDtypeStruct`s: nothing is opened)."""
        return self.reader.abstract(rows, width, self.shape)

    def prompt(self, ids, mask, rows: np.ndarray):
        """The `ImagePrompt` of table rows `rows` (ids / mask: their tokens): each distinct
        row's images opened and processed once."""
        opened = {}
        for r in dict.fromkeys(int(r) for r in rows):
            opened[r] = [read_image(v, f"prompt {r} image {j}") for j, v in enumerate(self.values[r])]
        return self.reader.prompt(np.asarray(ids), np.asarray(mask), [opened[int(r)] for r in rows],
                                  [self.grids[int(r)] for r in rows], self.shape)
