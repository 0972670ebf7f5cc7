"""Tokenizers from local directories, and prompts as fixed-length left-padded arrays."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["load_tokenizer", "encode_prompts", "token_lists", "left_padded", "decode_responses", "PromptTooLong",
           "largest_token_id"]


class PromptTooLong(ValueError):
    """A prompt with more tokens than `encode_prompts`' `max_length`: `index`, `tokens` (its
    count) and `text` say which, so that a caller can name its own setting."""

    def __init__(self, message: str, index: int, tokens: int, text: str):
        super().__init__(message)
        self.index, self.tokens, self.text = index, tokens, text


# Files a tokenizer's vocabulary is usually read from (fast tokenizers, BPE, SentencePiece, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")


def load_tokenizer(path: str):
    """transformers' `AutoTokenizer` from a local directory, or the tokenizer a `.gguf` file
    holds (`jaxppo.models.gguf`); nothing is downloaded, no code from the directory is run.
    A tokenizer without a pad token gets its EOS token as pad token."""
    import os

    import transformers

    from jaxppo.models.gguf import gguf_tokenizer, is_gguf

    if is_gguf(path):
        return gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory; give the local directory holding the tokenizer files")
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        import json

        try:
            with open(tokenizer_config) as f:
                auto_map = json.load(f).get("auto_map")
        except (ValueError, AttributeError):
            auto_map = None
        if auto_map:
            raise ValueError(f"{tokenizer_config} asks for tokenizer code shipped with the checkpoint (auto_map "
                             f"{auto_map}); jaxppo never runs code from a checkpoint")
    # trust_remote_code=False: transformers refuses (instead of asking) anything that would run checkpoint code.
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    if len(tokenizer) < 2:  # what transformers builds from a directory without tokenizer files
        raise ValueError(f"{path} holds no usable tokenizer: transformers built one of {len(tokenizer)} token(s) from "
                         f"it (no tokenizer files such as {', '.join(TOKENIZER_FILES)}), so every prompt would encode "
                         "to nothing. Save the checkpoint's tokenizer there (tokenizer.save_pretrained), or give the "
                         "directory or .gguf file that has it")
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompts(tokenizer, prompts: Sequence[str], max_length: int, *, truncate: bool = False,
                   add_special_tokens: bool = True):
    """Encode prompts to (ids, mask), each int32 (len(prompts), max_length), left-padded.

    A prompt longer than `max_length` tokens is an error naming it, unless `truncate=True`,
    which keeps its last `max_length` tokens (the end of a prompt is what the response
    continues). An empty list is an error. The padding is the tokenizer's pad token, else its
    EOS token (under the mask either way).
    """
    if isinstance(prompts, str):
        raise TypeError("prompts must be a sequence of strings, not a single string")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    return left_padded(tokenizer, token_lists(tokenizer, prompts, add_special_tokens), max_length, truncate=truncate,
                       texts=prompts)


def token_lists(tokenizer, prompts: Sequence[str], add_special_tokens: bool = True) -> list:
    """Each prompt's token ids (a list of ints), as `encode_prompts` encodes them."""
    out = []
    for i, text in enumerate(prompts):
        if not isinstance(text, str):
            raise TypeError(f"prompt {i} is a {type(text).__name__}, not a str")
        out.append(list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]))
    return out


def left_padded(tokenizer, tokens: Sequence[Sequence[int]], max_length: int, *, truncate: bool = False,
                texts: Sequence[str] = ()):
    """(ids, mask), int32 (len(tokens), max_length): each row's tokens at the right end,
    padded on the left with the tokenizer's pad (else EOS) token; a row over `max_length` is a
    `PromptTooLong` (its text from `texts` when given) unless `truncate` (its last tokens)."""
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"max_length={max_length!r} must be a positive int")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with; set "
                         "tokenizer.pad_token (any token: padding is masked)")
    ids = np.full((len(tokens), max_length), pad, np.int32)
    mask = np.zeros((len(tokens), max_length), np.int32)
    for i, row in enumerate(tokens):
        if len(row) > max_length:
            if not truncate:
                text = texts[i] if i < len(texts) else ""
                raise PromptTooLong(
                    f"prompt {i} has {len(row)} tokens, more than max_length={max_length} "
                    f"({text[:60]!r}...); raise max_length or pass truncate=True to keep its last "
                    f"{max_length} tokens", i, len(row), text
                )
            row = row[-max_length:]
        if len(row):
            ids[i, max_length - len(row):] = row
            mask[i, max_length - len(row):] = 1
    return ids, mask


def decode_responses(tokenizer, tokens, mask) -> list:
    """Decode response tokens (B, R), keeping only those where `mask` is 1.

    Ids the tokenizer does not know (>= len(tokenizer): a model whose vocabulary is padded
    beyond its tokenizer can sample them) decode as the tokenizer's unknown token, or are
    left out when it has none; `unknown_token_count` counts them."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    size, unk = len(tokenizer), tokenizer.unk_token_id
    rows = []
    for row, m in zip(tokens, mask):
        ids = row[m.astype(bool)]
        if (ids >= size).any():
            ids = np.where(ids >= size, unk, ids) if unk is not None else ids[ids < size]
        rows.append(ids.tolist())
    # One call for the batch: a fast (Rust) tokenizer decodes the rows together.
    return list(tokenizer.batch_decode(rows, skip_special_tokens=True)) if rows else []


def unknown_token_count(tokenizer, tokens, mask) -> int:
    """How many real response tokens (`mask` 1) are ids the tokenizer does not know."""
    return int(np.sum((np.asarray(tokens) >= len(tokenizer)) & (np.asarray(mask) > 0)))


def largest_token_id(tokenizer) -> int:
    """The largest token id `tokenizer` can produce: `len(tokenizer) - 1`, or a larger id its
    vocabulary or its special tokens hold (a tokenizer whose added tokens skip ids)."""
    ids = [len(tokenizer) - 1]
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if callable(get_vocab):
        ids.append(max(get_vocab().values(), default=0))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            ids.append(value)
    return max(ids)
