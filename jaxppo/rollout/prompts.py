"""The prompt set of a run and the order it is walked in.

`load_prompt_table` reads prompts and the dataset's other columns (for reward functions
that need them, e.g. an `answer` column); `prompt_order` gives the rows an iteration uses,
a pure function of the seed and the iteration (so a resumed run sees the same prompts).

A prompt set too large to tokenize up front, or one that is produced as the run goes, is
a stream (`jaxppo.rollout.streams.PromptStream`): a generator, a `datasets.IterableDataset`, a function returning
an iterator, a `mix_prompts` mixture of several sources with weights, or any source with
`DataConfig.stream_prompts`. Its prompts are read and tokenized when an iteration
reaches them, in the stream's own order; the run state holds only the position, and a
resumed run reads the stream again from its start up to that position (without rendering
or tokenizing what it passes, unless over-long prompts are filtered), so it continues
exactly where the run stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from jaxppo import sharding
from jaxppo.rollout.images import TableImages, has_image_parts, image_values

__all__ = ["load_prompts", "load_prompt_table", "prompt_order", "prompt_stream", "render_prompts", "PromptTable",
           "PromptBatch", "prompt_batch", "PromptEncoder", "PromptStreamEnded", "labelled_prompt_table",
           "check_prompts_file", "check_messages", "read_records"]


def load_prompts(source, prompt_column: str = "prompt") -> list:
    """Prompts (strings, or chat messages: lists of {"role", "content"} dicts, rendered
    later by `render_prompts`) from a list of strings or of records (dicts holding `prompt_column`), a
    `datasets.Dataset` (or anything with `column_names`) holding `prompt_column`, or a file: .txt (one prompt per line),
    .jsonl (one object per line with `prompt_column`), .json (a list of strings or objects).

    Errors name the file and line (or row) and say what was expected: a missing or empty
    file, a line that is not JSON, a record without the column, a prompt that is not a
    string."""
    return load_prompt_table(source, prompt_column)[0]


def load_prompt_table(source, prompt_column: str = "prompt"):
    """(prompts, columns): the prompts as `load_prompts` reads them, and the other columns
    of the dataset or of the records (.jsonl/.json, or a list of dicts) as {name: list, one
    value per prompt} (None where a record lacks the field). Plain strings and .txt files
    have no columns."""
    return labelled_prompt_table(source, prompt_column)[:2]


def check_prompts_file(path: str) -> None:
    """A `ValueError` unless `path` is a file: one that does not exist, and a directory, are
    named as what they are, with what is valid."""
    if os.path.isdir(path):
        raise ValueError(f"prompts file {path!r} is a directory; give a .txt, .jsonl or .json file (one prompt per "
                         "line or record), not the folder that holds it")
    if not os.path.isfile(path):
        raise ValueError(f"prompts file {path!r} does not exist (give a .txt, .jsonl or .json file)")


def labelled_prompt_table(source, prompt_column: str = "prompt"):
    """(prompts, columns, labels): `load_prompt_table`'s, and each prompt's name for errors
    (the file and line, the dataset row, or "prompt i")."""
    where = "the prompt list"
    rows = None  # the records, when the source has any
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        check_prompts_file(path)
        where = path
        rows, labels = read_records(path, prompt_column)
        prompts = [prompt_of(row, prompt_column, label) for row, label in zip(rows, labels)]
    elif hasattr(source, "column_names"):
        if prompt_column == "prompt" and "prompt" not in source.column_names and "messages" in source.column_names:
            prompt_column = "messages"  # the usual name of a chat dataset's column
        if prompt_column not in source.column_names:
            raise ValueError(f"the dataset has no column {prompt_column!r}; columns: {list(source.column_names)} "
                             "(set prompt_column / --prompt-column)")
        prompts = list(source[prompt_column])
        labels = [f"dataset row {i}" for i in range(len(prompts))]
        columns = {name: list(source[name]) for name in source.column_names if name != prompt_column}
        rows = None
    else:
        if isinstance(source, (str, bytes)):
            raise TypeError("prompts must be a list of strings or a file path, not a single string")
        rows = list(source)  # strings, or records (dicts) holding prompt_column and other columns
        labels = [f"prompt {i}" for i in range(len(rows))]
        prompts = [prompt_of(row, prompt_column, label) for row, label in zip(rows, labels)]
    if not prompts:
        raise ValueError(f"no prompts: {where} is empty")
    prompts = checked_prompts(prompts, labels)
    if rows is not None:
        used = {"messages"} if any(isinstance(r, dict) and prompt_column not in r for r in rows) else set()
        names = sorted({k for row in rows if isinstance(row, dict) for k in row if k != prompt_column} - used)
        columns = {name: [row.get(name) if isinstance(row, dict) else None for row in rows] for name in names}
    elif not hasattr(source, "column_names"):
        columns = {}
    return prompts, columns, labels


def _read_lines(path: str) -> list:
    """The file's lines as (line number, text), decoded as UTF-8; a ValueError naming the
    file, the line and the byte when one is not UTF-8."""
    return list(iter_lines(path))


def iter_lines(path: str):
    """(line number, text) of each line of the file, read as they are reached."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            line = line.rstrip(b"\r\n")
            try:
                yield n, line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} line {n} is not UTF-8 text: byte {line[err.start]:#04x} at column "
                                 f"{err.start + 1} ({line[max(0, err.start - 20):err.start + 1]!r}); save the file "
                                 "as UTF-8") from None


def json_line(path: str, n: int, line: str, prompt_column: str):
    try:
        return json.loads(line)
    except ValueError as err:
        raise ValueError(f"{path} line {n} is not valid JSON ({err}): {line.strip()[:60]!r}; each "
                         f'line must be an object such as {{"{prompt_column}": "..."}}') from None


FILE_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".txt": "txt"}  # by extension, any case


def _json_object(line: str):
    """The JSON object a line holds, or None."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def file_format(path: str, head, prompt_column: str = "prompt") -> str:
    """How a prompts file is read: "jsonl", "json" or "txt". By its extension in any case
    (`FILE_FORMATS`); a file with another extension or none by its content (`head()`: its
    (line number, text) lines, or the first of them; read only where needed): a JSON list
    is .json, lines that are all JSON objects are .jsonl, anything else text. A .txt file
    whose lines are all JSON objects holding `prompt_column` is read as text, as its
    extension says, with a warning (each line would be a prompt, braces and all)."""
    known = FILE_FORMATS.get(os.path.splitext(path)[1].lower())
    if known not in (None, "txt"):
        return known
    numbered = head()
    lines = [line for _, line in numbered if line.strip()][:1000]
    records = [_json_object(line) for line in lines]
    objects = bool(records) and all(r is not None for r in records)
    if known == "txt":
        if objects and all(prompt_column in r for r in records):
            import warnings

            warnings.warn(f"{path} is read as a .txt file, one prompt per line, but its lines are JSON objects with "
                          f"a {prompt_column!r} field: each whole line becomes a prompt. Name it .jsonl to read the "
                          "field", UserWarning, stacklevel=4)
        return known
    if lines and lines[0].lstrip().startswith("["):
        try:
            if isinstance(json.loads("\n".join(line for _, line in numbered)), list):
                return "json"
        except ValueError:
            pass
    return "jsonl" if objects else "txt"


def read_records(path: str, prompt_column: str):
    """(rows, labels) of a prompts file: .jsonl objects, a .json list, or .txt lines (blank
    lines skipped), the extension in any case, or the content where the extension says
    nothing (`file_format`); each label names the file and line or item, for errors."""
    numbered = _read_lines(path)
    extension = "." + file_format(path, lambda: numbered, prompt_column)
    if extension == ".jsonl":
        rows, labels = [], []
        for n, line in numbered:
            if not line.strip():
                continue
            rows.append(json_line(path, n, line, prompt_column))
            labels.append(f"{path} line {n}")
    elif extension == ".json":
        try:
            rows = json.loads("\n".join(line for _, line in numbered))
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err}); expected a list of strings or of objects "
                             f"with a {prompt_column!r} field") from None
        if not isinstance(rows, list):
            raise ValueError(f"{path} holds a {type(rows).__name__}; expected a list of strings or of objects "
                             f"with a {prompt_column!r} field")
        labels = [f"{path} item {i}" for i in range(len(rows))]
    else:
        numbered = [(n, line) for n, line in numbered if line.strip()]
        rows = [line for _, line in numbered]
        labels = [f"{path} line {n}" for n, _ in numbered]
    return rows, labels


def checked_prompts(prompts: list, labels: list) -> list:
    """The prompts, each a string or a list of chat messages (tuples become lists); a
    TypeError naming the first bad row otherwise, or a mix of both kinds."""
    chat = [i for i, p in enumerate(prompts) if isinstance(p, (list, tuple))]
    if chat:
        for i in chat:
            check_messages(prompts[i], labels[i])
        prompts = [list(p) if isinstance(p, tuple) else p for p in prompts]
        if len(chat) != len(prompts):
            i = next(i for i, p in enumerate(prompts) if not isinstance(p, list))
            raise TypeError(f"prompts mix chat messages and other values: {labels[chat[0]]} is a list of messages but "
                            f"{labels[i]} is a {type(prompts[i]).__name__} ({prompts[i]!r:.60}); give every prompt "
                            "as a string, or every prompt as a list of {\"role\", \"content\"} messages")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, (str, list))]
    if bad:
        i = bad[0]
        raise TypeError(f"prompts must be strings; {labels[i]} is a {type(prompts[i]).__name__} ({prompts[i]!r:.60})"
                        + (f" ({len(bad)} such rows)" if len(bad) > 1 else "")
                        + " (a prompt may also be a list of {\"role\", \"content\"} chat messages)")
    return prompts


# The roles chat templates render (OpenAI's and Hugging Face's conventions; "ipython" is
# Llama 3's tool output).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def check_messages(messages, label: str):
    if not messages:
        raise ValueError(f"{label} is an empty list of chat messages; give at least one {{\"role\", \"content\"}} "
                         "message")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(m.get("content"), str) or _content_parts(m.get("content")))):
            raise ValueError(f"{label} message {j} is {m!r:.80}; a chat message is a dict with a string \"role\" and "
                             "a \"content\": a string, or a list of parts {\"type\": \"text\", \"text\": ...} and "
                             "{\"type\": \"image\"} (a vision-language policy's images)")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"{label} message {j} has role {m['role']!r}, which no chat template knows; a role is one "
                             f"of {', '.join(map(repr, CHAT_ROLES))} (a misspelt role would be rendered into the "
                             "prompt and trained on)")


def _content_parts(content) -> bool:
    """Whether a message's content is a list of text and image parts."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(p, dict) and (p.get("type") == "image" or (p.get("type") == "text" and isinstance(p.get("text"), str)))
        for p in content)


def render_prompts(tokenizer, prompts: list, chat_template: Optional[bool] = None, tools=None):
    """(texts, is_chat): the prompts as the text the policy continues.

    Prompts given as chat messages are rendered with the tokenizer's chat template
    (`apply_chat_template(..., add_generation_prompt=True)`); the rendered text already
    holds the template's special tokens, so it is encoded without adding more (`is_chat`).
    `chat_template`: None (render messages when there are any) or True need a tokenizer
    with a template, else a clear error; False refuses message prompts. Plain strings are
    used as they are. `tools`: JSON schemas the template shows the model (`tools=`)."""
    is_chat = bool(prompts) and isinstance(prompts[0], list)
    if not is_chat:
        return list(prompts), False
    if chat_template is False:
        raise ValueError("the prompts are chat messages but the chat template is turned off (chat_template=False / "
                         "--no-chat-template); turn it on, or give the prompts as plain strings")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the prompts are chat messages but the tokenizer ({type(tokenizer).__name__}) has no chat "
                         "template to render them with; use a tokenizer that has one (tokenizer_config.json "
                         "chat_template or chat_template.jinja), set tokenizer.chat_template, or give the prompts as "
                         "plain strings")
    extra = {} if tools is None else {"tools": list(tools)}
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **extra) for m in prompts]
    return texts, True


def prompt_of(row, column: str, label: str):
    if isinstance(row, dict):
        if column == "prompt" and column not in row and "messages" in row:
            return row["messages"]  # the usual name of a chat dataset's column
        if column not in row:
            raise ValueError(f"{label} has no {column!r} field (fields: {sorted(row)}); set prompt_column / "
                             "--prompt-column to the field holding the prompt")
        return row[column]
    return row


def prompt_order(base_key, num_prompts: int, per_iteration: int, iteration: int) -> np.ndarray:
    """Rows of the prompt set that `iteration` uses (`per_iteration` of them): the prompts
    are walked in an order reshuffled every dataset epoch (epoch e: a permutation with
    fold_in(data key, e), the data key being fold_in(base_key, 2**30)); iteration i takes
    positions [i * per_iteration, (i + 1) * per_iteration) of that stream."""
    return prompt_stream(base_key, num_prompts, iteration * per_iteration, per_iteration)


def prompt_stream(base_key, num_prompts: int, start: int, count: int) -> np.ndarray:
    """Rows at positions [start, start + count) of the stream of prompts walked in an
    order reshuffled every dataset epoch (see `prompt_order`). Dynamic sampling reads it by
    the number of prompts consumed so far."""
    n = num_prompts
    out = np.empty(count, np.int64)
    for j in range(count):
        g = start + j
        epoch = g // n
        if j == 0 or g % n == 0:
            perm = np.asarray(_epoch_permutation(base_key, epoch, n))
        out[j] = perm[g % n]
    return out


@functools.partial(jax.jit, static_argnums=2)
def _epoch_permutation(base_key, epoch, n: int):
    """The prompt order of dataset epoch `epoch`: a permutation of range(n) with
    fold_in(data key, epoch), the data key fold_in(base_key, 2**30). One compiled program
    (run op by op, its few random ops each compiled and dispatched on their own)."""
    return jax.random.permutation(jax.random.fold_in(jax.random.fold_in(base_key, 1 << 30), epoch), n)


@dataclasses.dataclass(frozen=True)
class PromptTable:
    """The run's prompts, tokenised once: `prompts` as given (text or chat messages),
    `columns` (the dataset's other columns, for reward functions), `texts` (rendered),
    `ids` / `mask` (int32 (N, Q), left-padded; a prompt's images are their image tokens
    there); `filtered`: prompts left out as longer than Q (`overlong_prompts="filter"`);
    `images`: the prompts' images (`jaxppo.rollout.images.TableImages`) for a
    vision-language policy, or None. Rows are walked in an order reshuffled every pass
    (`rows_at`)."""

    prompts: list
    columns: dict
    texts: list
    ids: np.ndarray
    mask: np.ndarray
    filtered: int = 0
    images: Optional[object] = None

    streamed = False

    @property
    def width(self) -> int:
        """Q, the padded prompt length."""
        return self.ids.shape[1]

    def rows_at(self, key, start: int, count: int) -> np.ndarray:
        """Rows at positions [start, start + count) of the run's prompt stream (`prompt_stream`)."""
        return prompt_stream(key, len(self.prompts), start, count)

    def digest(self) -> dict:
        """What a resumed run must match: the count and a hash of the rendered prompts (and
        of their images' grids, where they have images)."""
        text = "\x00".join(self.texts) + ("" if self.images is None else repr(self.images.grids))
        return {"count": len(self.prompts), "sha256": hashlib.sha256(text.encode()).hexdigest()}


class PromptBatch(NamedTuple):
    """An iteration's prompt rows (numpy (B,): each prompt repeated `num_generations` times
    in consecutive rows) and their ids and mask on the device (split over the mesh's data
    axes under a mesh); `images`: a vision-language policy's images of the rows, an
    `ImagePrompt` without its ids (processed once, what the sampler, the forward pass and
    the update all read), or None."""

    rows: np.ndarray
    ids: jax.Array
    mask: jax.Array
    images: Optional[object] = None

    @property
    def queries(self):
        """What the engines sample after: the ids, or with images the `ImagePrompt`."""
        return self.ids if self.images is None else self.images._replace(ids=self.ids)


def prompt_batch(table: PromptTable, rows: np.ndarray, mesh=None) -> PromptBatch:
    """The `PromptBatch` of the table's `rows` (ids and mask on the device, split over the
    mesh's data axes under a mesh; their images processed, where the table has images)."""
    images = None
    if table.images is not None:
        images = table.images.prompt(table.ids[rows], table.mask[rows], rows)._replace(ids=None)
        images = jax.tree.map(lambda x: sharding.place_rows(x, mesh), images)
    return PromptBatch(rows, sharding.place_rows(table.ids[rows], mesh), sharding.place_rows(table.mask[rows], mesh),
                       images)


# ----------------------------------------------------------------------------------------
# Prompts encoded to the run's query length; prompts that stream.


class PromptStreamEnded(RuntimeError):
    """A one-shot prompt stream (a generator or other iterator) ended before the run did:
    `position` prompts were read. The loop saves a checkpoint and stops; a resumed run given
    the stream again continues from the checkpoint's position."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    """Prompts rendered (chat messages through the tokenizer's chat template) and tokenized
    to `query_length`, left-padded; a prompt longer than that gets `overlong`: "error" (a
    ValueError naming it and the settings), "truncate" (its last `query_length` tokens) or
    "filter" (left out). `tools`: JSON schemas the chat template shows the model.
    `images`: a vision-language policy's image reader (its family's, e.g.
    `jaxppo.models.vision.qwen_images.QwenImages`), or None: prompts with images are then
    refused, with `no_images` (why); `image_column`: the column of the prompts' images
    ("images", or "image" where there is no "images")."""

    tokenizer: object
    query_length: int
    overlong: str = "error"
    chat_template: Optional[bool] = None
    tools: Optional[tuple] = None
    images: Optional[object] = None
    image_column: str = "images"
    no_images: str = "the policy reads text only"

    def __call__(self, prompts: list, labels: list, grids: Optional[list] = None):
        """(texts, ids, mask, keep) of `prompts` (each named by its label in errors): `keep`
        (bool, one per prompt) is False where a prompt was filtered out; texts, ids and mask
        hold the kept prompts only. `grids`: each prompt's images' grids (`TableImages`),
        whose image tokens replace the placeholders of the rendered text."""
        from jaxppo.models.tokenizer import left_padded, token_lists

        if grids is None and any(map(has_image_parts, prompts)):
            raise ValueError("prompts with image parts are read as a prompt table with a vision-language policy (not "
                             "streamed)")
        texts, is_chat = render_prompts(self.tokenizer, prompts, self.chat_template, self.tools)
        if self.tools and not is_chat:
            raise ValueError("tools are shown to the model through the chat template: give the prompts as chat "
                             "messages (lists of {role, content} dicts), or use an environment with plain-text prompts")
        full = texts if grids is None else [self._expanded(t, g, label) for t, g, label in zip(texts, grids, labels)]
        tokens = token_lists(self.tokenizer, full, add_special_tokens=not is_chat)
        q = self.query_length
        keep = np.asarray([len(t) <= q for t in tokens], bool) if self.overlong == "filter" else np.ones(len(tokens), bool)
        over = next((i for i, t in enumerate(tokens) if len(t) > q), None)
        if over is not None and (self.overlong == "error" or (self.overlong == "truncate" and grids and grids[over])):
            raise ValueError(self._overlong(labels[over], tokens[over], texts[over], grids and grids[over]))
        kept = [i for i in range(len(tokens)) if keep[i]]
        ids, mask = left_padded(self.tokenizer, [tokens[i] for i in kept], q, truncate=True)
        return [texts[i] for i in kept], ids, mask, keep

    def _expanded(self, text: str, grids: list, label: str) -> str:
        """The rendered text with each image's tokens in place of its placeholder."""
        try:
            return self.images.expand(text, grids) if grids else text
        except ValueError as err:
            raise ValueError(f"{label}: {err}; a prompt shows each image once, as an image part of its chat messages "
                             f"({{'type': 'image'}}) or as {self.images.placeholder!r} in its text") from None

    def _overlong(self, label: str, tokens: list, text: str, grids) -> str:
        q = self.query_length
        if grids:
            images = sum(self.images.tokens(g) for g in grids)
            return (f"{label} has {len(tokens)} tokens, {images} of them its {len(grids)} image(s)' (grids "
                    f"{list(grids)}), longer than DataConfig.query_length={q} (--query-length); a prompt with images is "
                    "never truncated (it would cut its image tokens): raise query_length, shrink the images (the "
                    "image processor's largest size, its size['longest_edge'] in pixels), or set "
                    "overlong_prompts='filter' to leave such prompts out")
        return (f"{label} has {len(tokens)} tokens, longer than DataConfig.query_length={q} (--query-length) "
                f"({text[:60]!r}...); raise query_length, or set overlong_prompts='truncate' (--overlong-prompts "
                f"truncate) to keep each long prompt's last {q} tokens, or overlong_prompts='filter' "
                "(--overlong-prompts filter) to leave such prompts out")

    def _table_images(self, prompts: list, columns: dict, labels: list):
        """The prompts' `TableImages`, or None where they have none; an error for images a
        text-only policy would not see."""
        column = self.image_column if self.image_column in columns else None
        if column is None and self.image_column == "images" and "image" in columns:
            column = "image"  # the default name's other spelling
        given = columns.get(column) if column else None
        values = [image_values(p, None if given is None else given[i], labels[i]) for i, p in enumerate(prompts)]
        first = next((i for i, v in enumerate(values) if v), None)
        if first is None:
            return None
        if self.images is None:
            where = f"its {column!r} column" if given is not None and given[first] is not None else "its messages"
            raise ValueError(f"{labels[first]} has images ({where}), but {self.no_images}")
        return TableImages.read(self.images, values, labels)

    def table(self, prompts: list, columns: dict, labels: list) -> PromptTable:
        """The `PromptTable` of a whole prompt set (over-long prompts filtered out and counted
        with overlong="filter"; an error if none is left), with its images."""
        images = self._table_images(prompts, columns, labels)
        texts, ids, mask, keep = self(prompts, labels, None if images is None else images.grids)
        if not texts:
            raise ValueError(f"all {len(prompts)} prompts are longer than DataConfig.query_length="
                             f"{self.query_length} (--query-length), so overlong_prompts='filter' leaves none; raise "
                             "query_length or truncate them (overlong_prompts='truncate')")
        kept = np.flatnonzero(keep)
        return PromptTable([prompts[i] for i in kept], {k: [v[i] for i in kept] for k, v in columns.items()}, texts, ids,
                           mask, int(len(prompts) - len(kept)), None if images is None else images.kept(keep))
