"""Preference pairs for reward-model training: read, checked, tokenized as TRL 1.12's
`RewardTrainer` tokenizes them, and held as fixed-shape arrays.

Rows are dicts in one of TRL's preference formats, the same format on every row:

- text, implicit prompt: {"chosen": str, "rejected": str} (the prompt is part of each);
- text, explicit prompt: {"prompt": str, "chosen": str, "rejected": str};
- chat, implicit or explicit prompt: the same keys holding lists of {"role", "content"}
  messages;
- tokenized: {"chosen_ids": [int], "rejected_ids": [int]};

each with an optional "margin" (a real number; on every row or on none). Text is
tokenized as `tokenizer(prompt + text + eos_token)` (the EOS token appended unless the text
ends with it), chat as `tokenizer.apply_chat_template(prompt + messages)`: TRL's rules.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import numpy as np

from jaxppo.rollout.prompts import check_messages, read_records

__all__ = ["PreferencePairs", "read_pairs", "check_pairs", "tokenize_pairs", "pair_format"]

FORMATS = ("text", "chat", "tokens")


@dataclasses.dataclass(frozen=True)
class PreferencePairs:
    """Tokenized pairs: `tokens`/`mask` int32 (N, 2, L), right-padded, the chosen sequence at
    [:, 0] and the rejected one at [:, 1]; `margin` float32 (N,) (zeros when the rows have
    none, `has_margin` False); `labels` name each pair's source row (for messages)."""

    tokens: np.ndarray
    mask: np.ndarray
    margin: np.ndarray
    has_margin: bool
    labels: tuple

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def take(self, rows) -> "PreferencePairs":
        rows = np.asarray(rows)
        return PreferencePairs(self.tokens[rows], self.mask[rows], self.margin[rows], self.has_margin,
                               tuple(self.labels[i] for i in rows))

    def arrays(self, rows=None) -> dict:
        """The pairs (or `rows` of them) as the loss's mini-batch dict."""
        sel = slice(None) if rows is None else np.asarray(rows)
        return {"tokens": self.tokens[sel], "mask": self.mask[sel], "margin": self.margin[sel]}


def read_pairs(source, what: str = "pairs"):
    """(rows, labels) of `source`: a .jsonl or .json file of objects, a list of dicts, or a
    `datasets.Dataset` (its rows in order); `labels` name each row for messages."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"{what}: {path!r} is not a file; give a .jsonl file (one JSON object per line) or a "
                             ".json list of objects with 'chosen' and 'rejected' fields")
        if os.path.splitext(path)[1].lower() in (".txt", ".csv", ".parquet"):
            raise ValueError(f"{what}: {path!r} is a {os.path.splitext(path)[1]} file; preference pairs are read from "
                             ".jsonl (one JSON object per line) or .json (a list of objects); load other formats "
                             "with `datasets` and pass the Dataset")
        rows, labels = read_records(path, "chosen")
        return list(rows), list(labels)
    if isinstance(source, (bytes, dict)):
        raise TypeError(f"{what} must be a file path, a list of dicts or a datasets.Dataset, not a "
                        f"{type(source).__name__}")
    rows = list(source)
    return rows, [f"{what} row {i}" for i in range(len(rows))]


def pair_format(row: dict) -> str:
    """"tokens", "chat" or "text": the format of one row (its keys and value types)."""
    if "chosen_ids" in row or "rejected_ids" in row:
        return "tokens"
    return "chat" if isinstance(row.get("chosen"), (list, tuple)) else "text"


def _keys(fmt: str) -> tuple:
    return ("chosen_ids", "rejected_ids") if fmt == "tokens" else ("chosen", "rejected")


def check_pairs(rows: list, labels: list, what: str = "pairs") -> str:
    """The rows' format ("text", "chat" or "tokens"), after checking every row: a dict with
    the format's two fields of the right type, the same format and the same optional fields
    ("prompt", "margin") on every row, margins finite real numbers. A ValueError or TypeError
    naming the first bad row, what it holds and what would be valid."""
    if not rows:
        raise ValueError(f"{what} is empty: give at least one preference pair")
    for row, label in zip(rows, labels):
        if not isinstance(row, dict):
            raise TypeError(f"{label} is a {type(row).__name__} ({row!r:.80}); a preference pair is an object with "
                            "'chosen' and 'rejected' fields (text or chat messages; optional 'prompt' and 'margin'), "
                            "or 'chosen_ids' and 'rejected_ids' (token ids)")
    fmt = pair_format(rows[0])
    has_prompt, has_margin = "prompt" in rows[0], "margin" in rows[0]
    for row, label in zip(rows, labels):
        keys = _keys(pair_format(row))
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(f"{label} has no {' or '.join(repr(k) for k in missing)} field (its fields: "
                             f"{sorted(row)}); every pair needs 'chosen' and 'rejected' (text or chat messages), "
                             "or 'chosen_ids' and 'rejected_ids' (token ids)")
        if pair_format(row) != fmt:
            raise ValueError(f"{label} is a {pair_format(row)} pair but {labels[0]} is a {fmt} pair; give every pair "
                             "in one format (text, chat messages, or token ids)")
        for optional, first in (("prompt", has_prompt), ("margin", has_margin)):
            if (optional in row) != first:
                raise ValueError(f"{label} {'has' if optional in row else 'lacks'} a {optional!r} field but "
                                 f"{labels[0]} {'has' if first else 'lacks'} one; give {optional!r} on every pair "
                                 "or on none")
        _check_row(row, label, fmt)
    return fmt


def _check_row(row: dict, label: str, fmt: str):
    if fmt == "tokens":
        for key in _keys(fmt):
            ids = row[key]
            if (not isinstance(ids, (list, tuple, np.ndarray)) or len(ids) == 0
                    or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids)):
                raise ValueError(f"{label} field {key!r} is {ids!r:.80}; give a non-empty list of token ids (ints >= 0)")
    else:
        kind = str if fmt == "text" else (list, tuple)
        for key in ("prompt", "chosen", "rejected"):
            if key not in row:
                continue
            value = row[key]
            if not isinstance(value, kind):
                want = "a string" if fmt == "text" else "a list of {\"role\", \"content\"} chat messages"
                raise TypeError(f"{label} field {key!r} is a {type(value).__name__} ({value!r:.60}) in a {fmt} pair; "
                                f"give {want}, as the pair's other fields are")
            if fmt == "chat":
                check_messages(value, f"{label} field {key!r}")
    if "margin" in row:
        m = row["margin"]
        if isinstance(m, bool) or not isinstance(m, (int, float, np.integer, np.floating)) or not math.isfinite(m):
            raise TypeError(f"{label} field 'margin' is {m!r} ({type(m).__name__}); a margin is a finite real number "
                            "(how much the chosen score should exceed the rejected one), on every pair or on none")


def _encode_text(tokenizer, text: str) -> list:
    eos = tokenizer.eos_token
    if eos is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no EOS token, which text pairs end with "
                         "(TRL's rule); give pairs as chat messages or token ids, or set tokenizer.eos_token")
    if not text.endswith(eos):
        text = text + eos
    return list(tokenizer(text)["input_ids"])


def _encode_chat(tokenizer, messages: list) -> list:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the pairs are chat messages but the tokenizer ({type(tokenizer).__name__}) has no chat "
                         "template to render them with; use a tokenizer that has one, or give the pairs as text")
    out = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _sequences(tokenizer, row: dict, fmt: str) -> tuple:
    if fmt == "tokens":
        return [int(t) for t in row["chosen_ids"]], [int(t) for t in row["rejected_ids"]]
    prompt = row.get("prompt")
    if fmt == "text":
        prompt = prompt or ""
        return _encode_text(tokenizer, prompt + row["chosen"]), _encode_text(tokenizer, prompt + row["rejected"])
    prompt = list(prompt or [])
    return (_encode_chat(tokenizer, prompt + list(row["chosen"])),
            _encode_chat(tokenizer, prompt + list(row["rejected"])))


def tokenize_pairs(tokenizer, rows: list, labels: list, *, max_length: Optional[int], overlong: str = "error",
                   pad_id: Optional[int] = None, multiple_of: int = 8, vocab_size: Optional[int] = None,
                   what: str = "pairs", setting: str = "max_length"):
    """(PreferencePairs, dropped): the checked rows tokenized (TRL's rules, module doc),
    right-padded to the longest sequence rounded up to `multiple_of`. A pair with a
    sequence longer than `max_length` tokens is an error naming it and how many there are
    (`overlong="error"`), or is left out and counted in `dropped` (`"drop"`, TRL's filter);
    no sequence is ever cut. A token id at or past `vocab_size` is an error."""
    fmt = check_pairs(rows, labels, what)
    encoded = [_sequences(tokenizer, row, fmt) for row in rows]
    too_long = [i for i, (c, r) in enumerate(encoded) if max_length is not None and max(len(c), len(r)) > max_length]
    if too_long and overlong == "error":
        i = too_long[0]
        longest = max(max(len(s) for s in encoded[j]) for j in too_long)
        raise ValueError(f"{len(too_long)} of the {len(rows)} {what} have a sequence longer than {setting}="
                         f"{max_length} tokens (the first: {labels[i]}, {len(encoded[i][0])} and {len(encoded[i][1])} "
                         f"tokens; the longest {longest}). Raise {setting} to at least {longest}, or drop them "
                         "(overlong_pairs='drop', TRL's filter); no sequence is cut")
    dropped = set(too_long)
    keep = [i for i in range(len(rows)) if i not in dropped]
    if not keep:
        raise ValueError(f"every one of the {len(rows)} {what} is longer than {setting}={max_length} tokens; raise "
                         f"{setting}")
    if vocab_size is not None:
        for i in keep:
            top = max(max(encoded[i][0]), max(encoded[i][1]))
            if top >= vocab_size:
                raise ValueError(f"{labels[i]} holds token id {top}, outside the model's vocabulary of {vocab_size}; "
                                 "give token ids of the model's tokenizer")
    width = max(max(len(encoded[i][0]), len(encoded[i][1])) for i in keep)
    width = -(-width // multiple_of) * multiple_of
    pad = int(pad_id if pad_id is not None else (getattr(tokenizer, "pad_token_id", None) or 0))
    tokens = np.full((len(keep), 2, width), pad, np.int32)
    mask = np.zeros((len(keep), 2, width), np.int32)
    for out, i in enumerate(keep):
        for side, seq in enumerate(encoded[i]):
            tokens[out, side, :len(seq)] = seq
            mask[out, side, :len(seq)] = 1
    has_margin = "margin" in rows[0]
    margin = np.asarray([float(rows[i]["margin"]) if has_margin else 0.0 for i in keep], np.float32)
    return PreferencePairs(tokens, mask, margin, has_margin, tuple(labels[i] for i in keep)), len(too_long)
