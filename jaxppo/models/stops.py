"""Stop strings, matched token by token inside the compiled decode loop.

A completion ends at the first token that completes one of the stop strings in the text
decoded so far, also when the string is split across several tokens ("</ans" + "wer>").
Each string becomes an automaton over the vocabulary: its state is how many of the
string's first characters the text ends with (0 to len - 1), and a table gives, for every
state and every token, the next state, or -1 where the token's text completes the string.
The decode loop carries one state per row and string and looks up one entry per step
(`jaxppo.models.decoding.stop_step`); nothing is decoded to text while sampling.

What is kept: every token up to and including the one that completed the string (masked
in and trained on, as a stop token is), so the completion's text holds the stop string and
whatever else that last token's text holds after it; nothing after it.

The text matched is the completion's text as reward functions get it (decoded without
special tokens). A token's text is what it adds to a text decoded so far: the tokenizer's
decoding of it after a plain anchor token, less the anchor's own (so that a SentencePiece
token's leading space is kept); special tokens (the tokenizer's `all_special_ids`) add
nothing. A character that a tokenizer splits over several byte tokens (outside ASCII)
shows in no single token's text, so a stop string holding one may be missed there; ASCII
stop strings are always found.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, Tuple

import jax
import numpy as np

__all__ = ["StopStrings", "token_texts", "automaton"]


def token_texts(tokenizer, vocab_size: int) -> list:
    """The text each token id in [0, vocab_size) adds after a plain anchor token (see the
    module); special tokens and ids beyond the tokenizer's vocabulary add nothing."""
    known = min(len(tokenizer), vocab_size)
    anchor = tokenizer.encode("a", add_special_tokens=False)[-1]
    options = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    head = tokenizer.decode([anchor], **options)
    pairs = tokenizer.batch_decode([[anchor, t] for t in range(known)], **options)
    texts = [pair[len(head):] if pair.startswith(head) else tokenizer.decode([t], **options)
             for t, pair in enumerate(pairs)]
    for t in getattr(tokenizer, "all_special_ids", ()):
        if t < known:
            texts[t] = ""
    return texts + [""] * (vocab_size - known)


def _next_state(string: str, prefix: str, text: str) -> int:
    """After a text ending with `prefix` (a proper prefix of `string`) and then `text`:
    -1 if `string` is now complete, else the length of the longest prefix of `string`
    that the text ends with."""
    n, joined = len(string), prefix + text
    if string in joined:
        return -1
    tail = joined[-(n - 1):] if n > 1 else ""
    return next((k for k in range(min(n - 1, len(tail)), 0, -1) if tail.endswith(string[:k])), 0)


def _continues(string: str, text: str) -> bool:
    """`text` starts as `string` does from some position a >= 1 (for as long as both
    last): only then can a state past 0 change where `text` leads."""
    n = len(string)
    return any(string[a:a + min(len(text), n - a)] == text[:n - a] for a in range(1, n))


def automaton(string: str, texts: Sequence[str]) -> np.ndarray:
    """int32 (len(string), V): from state j (the text ends with string[:j]) and token t,
    the state after t's text, or -1 where that text completes `string`.

    From state j a match can start inside string[:j] only where t's text continues
    `string` from some position past 0 (`_continues`); for every other token the state
    after it is the one it leads to from state 0, so only those few are computed per
    state."""
    n = len(string)
    chars = set(string)
    first = np.array([_next_state(string, "", text) if text and not chars.isdisjoint(text) else 0
                      for text in texts], np.int32)
    table = np.broadcast_to(first, (n, len(texts))).copy()
    for t, text in enumerate(texts):
        if not text:
            table[:, t] = np.arange(n)  # nothing added: the state stays
        elif _continues(string, text):
            table[1:, t] = [_next_state(string, string[:j], text) for j in range(1, n)]
    return table


class StopStrings:
    """Stop strings compiled against a tokenizer and a vocabulary size (the model's logits'
    width, which may exceed the tokenizer's): `table`, int16 or int32 (K, S, V), the K
    strings' automata padded to the longest string's S states. Hashable (by the strings and
    the table's digest), so a `Sampling` value can hold it; a pytree whose leaf is the table,
    so a compiled sampler traces it as an array (`jaxppo.models.sampling`)."""

    def __init__(self, strings: Tuple[str, ...], table: np.ndarray):
        self.strings, self.table = tuple(strings), table
        self._digest = hashlib.sha256(table.tobytes() + repr(self.strings).encode()).hexdigest()

    @classmethod
    def build(cls, strings: Sequence[str], tokenizer, vocab_size: int) -> "StopStrings":
        strings = tuple(strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings={strings!r} is invalid: one or more non-empty strings")
        texts = token_texts(tokenizer, vocab_size)
        width = max(map(len, strings))
        table = np.zeros((len(strings), width, vocab_size), np.int32)
        for k, s in enumerate(strings):
            table[k, :len(s)] = automaton(s, texts)
        dtype = np.int16 if width < np.iinfo(np.int16).max else np.int32
        return cls(strings, table.astype(dtype))

    def first_stop(self, tokens) -> int:
        """The index of the first token of `tokens` that completes a stop string, or -1."""
        state = np.zeros(self.table.shape[0], np.int64)
        rows = np.arange(self.table.shape[0])
        for i, t in enumerate(tokens):
            nxt = self.table[rows, state, int(t)].astype(np.int64)
            if (nxt < 0).any():
                return i
            state = nxt
        return -1

    def completed(self, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(B,) bool: the row's masked tokens (host (B, R)) complete a stop string."""
        return np.array([self.first_stop(row[m > 0]) >= 0 for row, m in zip(tokens, mask)], bool)

    def cut(self, tokens: np.ndarray, mask: np.ndarray, pad_token_id: int):
        """Host (B, R) tokens and mask with every row ended at its first completed stop
        string: the tokens after it set to `pad_token_id` and masked out (for an engine that
        cannot stop on strings itself: `jaxppo.rollout.engines.vllm.inprocess`)."""
        tokens, mask = tokens.copy(), mask.copy()
        for row in range(tokens.shape[0]):
            n = int(mask[row].sum())
            end = self.first_stop(tokens[row, :n])
            if end >= 0:
                tokens[row, end + 1:], mask[row, end + 1:] = pad_token_id, 0
        return tokens, mask

    def __hash__(self):
        return hash(self._digest)

    def __eq__(self, other):
        return isinstance(other, StopStrings) and other._digest == self._digest

    def __repr__(self):
        return f"StopStrings({self.strings!r}, vocab={self.table.shape[2]})"


def _flatten_stops(stops: StopStrings):
    return (stops.table,), (stops.strings, stops._digest)


def _unflatten_stops(aux, children) -> StopStrings:
    """A `StopStrings` around `children`' table as it is (traced inside a compiled sampler:
    the digest is the host value's)."""
    stops = object.__new__(StopStrings)
    (stops.table,), (stops.strings, stops._digest) = children, aux
    return stops


# A pytree: the table is a leaf (an array a compiled sampler traces), the strings its structure.
jax.tree_util.register_pytree_node(StopStrings, _flatten_stops, _unflatten_stops)
