"""The prompt set of a run and the order it is walked in.

`load_prompt_table` reads prompts and the dataset's other columns (for reward functions
that need them, e.g. an `answer` column); `prompt_order` gives the rows an iteration uses,
a pure function of the seed and the iteration (so a resumed run sees the same prompts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import NamedTuple, Optional

import jax
import numpy as np

from jaxppo import sharding

__all__ = ["load_prompts", "load_prompt_table", "prompt_order", "prompt_stream", "render_prompts", "PromptTable",
           "PromptBatch", "prompt_batch"]


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
    where = "the prompt list"
    rows = None  # the records, when the source has any
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"prompts file {path!r} does not exist (give a .txt, .jsonl or .json file)")
        where = path
        rows, labels = _read_records(path, prompt_column)
        prompts = [_prompt_of(row, prompt_column, label) for row, label in zip(rows, labels)]
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
        prompts = [_prompt_of(row, prompt_column, label) for row, label in zip(rows, labels)]
    if not prompts:
        raise ValueError(f"no prompts: {where} is empty")
    prompts = _checked_prompts(prompts, labels)
    if rows is not None:
        used = {"messages"} if any(isinstance(r, dict) and prompt_column not in r for r in rows) else set()
        names = sorted({k for row in rows if isinstance(row, dict) for k in row if k != prompt_column} - used)
        columns = {name: [row.get(name) if isinstance(row, dict) else None for row in rows] for name in names}
    elif not hasattr(source, "column_names"):
        columns = {}
    return prompts, columns


def _read_lines(path: str) -> list:
    """The file's lines as (line number, text), decoded as UTF-8; a ValueError naming the
    file, the line and the byte when one is not UTF-8."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = []
    for n, line in enumerate(raw.splitlines(), start=1):
        try:
            lines.append((n, line.decode("utf-8")))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path} line {n} is not UTF-8 text: byte {line[err.start]:#04x} at column "
                             f"{err.start + 1} ({line[max(0, err.start - 20):err.start + 1]!r}); save the file "
                             "as UTF-8") from None
    return lines


def _read_records(path: str, prompt_column: str):
    """(rows, labels) of a prompts file: .jsonl objects, a .json list, or .txt lines (blank
    lines skipped), the extension in any case; each label names the file and line or item,
    for errors."""
    extension = os.path.splitext(path)[1].lower()
    numbered = _read_lines(path)
    if extension == ".jsonl":
        rows, labels = [], []
        for n, line in numbered:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{path} line {n} is not valid JSON ({err}): {line.strip()[:60]!r}; each "
                                 f'line must be an object such as {{"{prompt_column}": "..."}}') from None
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


def _checked_prompts(prompts: list, labels: list) -> list:
    """The prompts, each a string or a list of chat messages (tuples become lists); a
    TypeError naming the first bad row otherwise, or a mix of both kinds."""
    chat = [i for i, p in enumerate(prompts) if isinstance(p, (list, tuple))]
    if chat:
        for i in chat:
            _check_messages(prompts[i], labels[i])
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


def _check_messages(messages, label: str):
    if not messages:
        raise ValueError(f"{label} is an empty list of chat messages; give at least one {{\"role\", \"content\"}} "
                         "message")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{label} message {j} is {m!r:.80}; a chat message is a dict with a string \"role\" and "
                             "a string \"content\"")
        if m["role"] not in CHAT_ROLES:
            raise ValueError(f"{label} message {j} has role {m['role']!r}, which no chat template knows; a role is one "
                             f"of {', '.join(map(repr, CHAT_ROLES))} (a misspelt role would be rendered into the "
                             "prompt and trained on)")


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


def _prompt_of(row, column: str, label: str):
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
    `ids` / `mask` (int32 (N, Q), left-padded)."""

    prompts: list
    columns: dict
    texts: list
    ids: np.ndarray
    mask: np.ndarray


class PromptBatch(NamedTuple):
    """An iteration's prompt rows (numpy (B,): each prompt repeated `num_generations` times
    in consecutive rows) and their ids and mask on the device (split over the mesh's data
    axes under a mesh)."""

    rows: np.ndarray
    ids: jax.Array
    mask: jax.Array


def prompt_batch(table: PromptTable, rows: np.ndarray, mesh=None) -> PromptBatch:
    """The `PromptBatch` of the table's `rows` (ids and mask on the device, split over the
    mesh's data axes under a mesh)."""
    return PromptBatch(rows, sharding.place_rows(table.ids[rows], mesh), sharding.place_rows(table.mask[rows], mesh))
