"""Prompt sets read as streams: too large to tokenize up front, or produced as the run goes
(a generator, a `datasets.IterableDataset`, a function returning an iterator, a
`mix_prompts` mixture of several sources with weights, or any source with
`DataConfig.stream_prompts`). A `PromptStream`'s prompts are read and tokenized when an
iteration reaches them, in the stream's own order; the run state holds only the position,
and a resumed run reads the stream again from its start up to that position (without
rendering or tokenizing what it passes, unless over-long prompts are filtered), so it
continues exactly where the run stopped."""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from typing import NamedTuple, Optional

import numpy as np

from jaxppo.rollout.prompts import (PromptEncoder, PromptStreamEnded, check_prompts_file, checked_prompts, file_format,
                                    iter_lines, json_line, load_prompt_table, prompt_of, read_records)

__all__ = ["is_stream", "PromptStream", "PromptMixture", "mix_prompts", "read_prompt_records"]


def is_stream(source) -> bool:
    """Whether `source` is read as a stream: a generator or other iterator, a function that
    returns one, a `PromptMixture`, or an iterable without a length (a
    `datasets.IterableDataset`); not a file path, list or `datasets.Dataset`."""
    if isinstance(source, (str, bytes, os.PathLike, list, tuple, dict)):
        return False
    if isinstance(source, PromptMixture) or callable(source):
        return True
    return hasattr(source, "__iter__") and not hasattr(source, "__len__")


class _Labelled(NamedTuple):
    """A record a stream of jaxppo's own yields with the name errors give it."""

    record: object
    label: str


class _Entry(NamedTuple):
    prompt: object
    columns: dict
    text: str
    ids: np.ndarray
    mask: np.ndarray


class PromptStream:
    """Prompts read from `source` as the run reaches them (see the module's docstring).

    The stream's positions are its kept prompts in the order the source yields them (a
    prompt filtered out as over-long takes none). `rows_at(key, start, count)` reads up to
    position `start + count`, renders and tokenizes positions [start, start + count) with
    `encoder`, and returns those positions as the rows that index `prompts`, `texts`,
    `columns`, `ids` and `mask`, as a `PromptTable`'s rows do. The last `keep_behind`
    positions before the newest request stay held (pipelined iterations and dynamic
    sampling's rounds read rows a little behind the front).

    Where a pass of the source ends: a source that can be iterated again (a list, a
    `datasets.IterableDataset` (its `set_epoch(pass)` called first, which reseeds its
    shuffle buffer), a function returning an iterator) starts a new pass; a one-shot
    iterator raises `PromptStreamEnded`."""

    streamed = True
    images = None  # no images: a vision-language policy's prompts are read as a table

    def __init__(self, source, encoder: PromptEncoder, prompt_column: str = "prompt", keep_behind: int = 4096):
        self.source, self.encoder, self.prompt_column, self.keep_behind = source, encoder, prompt_column, keep_behind
        self.width = encoder.query_length
        self.filtered = 0  # prompts left out as over-long, up to the front
        self._lock = threading.RLock()
        self._entries = {}
        self._next = 0  # the next position the source's next kept prompt takes
        self._read = 0  # records read from the source
        self._iterator, self._passes, self._in_pass = None, 0, 0
        self._chat = None
        self._first = None
        self._column_names = {}
        self.prompts, self.texts = _Field(self, "prompt"), _Field(self, "text")
        self.ids, self.mask = _Field(self, "ids"), _Field(self, "mask")

    @property
    def columns(self) -> dict:
        """{name: values by row} of the columns the stream's records have shown so far (None
        where a record lacks one)."""
        with self._lock:  # a pipelined producer may be adding names while this is read
            names = list(self._column_names)
        return {name: _Field(self, "column", name) for name in names}

    def rows_at(self, key, start: int, count: int) -> np.ndarray:
        """Positions [start, start + count) of the stream (`key` is unused: a stream is read in
        its own order), read and tokenized now if not yet."""
        del key
        with self._lock:
            self._read_to(start + count, start)
            if self._first is None and start == 0:  # the prompts the digest hashes
                self._first = [self._entries[p].text for p in range(count)]
            for position in [p for p in self._entries if p < start - self.keep_behind]:
                del self._entries[position]
        return np.arange(start, start + count, dtype=np.int64)

    def digest(self) -> dict:
        """What a resumed run must match: a hash of the rendered texts of the prompts the
        first request from position 0 read (the trainer reads its first iteration's when it is
        built; a stream's length is unknown)."""
        if self._first is None:
            raise RuntimeError("PromptStream.digest() needs the stream read from position 0 first (rows_at)")
        return {"stream": True, "first": len(self._first),
                "first_sha256": hashlib.sha256("\x00".join(self._first).encode()).hexdigest()}

    def entry(self, position: int) -> _Entry:
        position = int(position)
        with self._lock:
            if position not in self._entries:
                if position >= self._next:
                    self._read_to(position + 1, position)
                else:
                    raise KeyError(f"prompt stream position {position} is no longer held (a stream keeps the "
                                   f"{self.keep_behind} positions behind the newest it read, {self._next - 1})")
            return self._entries[position]

    # reading

    def _read_to(self, end: int, first_held: int):
        """Read the source until `end` positions exist; positions from `first_held` on are
        rendered, tokenized and held. Without filtering, records before `first_held` are
        passed over unread (only counted); with it each is tokenized, to know if it counts."""
        while self._next < end:
            if self._next < first_held and self.encoder.overlong != "filter":
                skipped = self._take(first_held - self._next)
                self._next += len(skipped)
                continue
            records = self._take(end - self._next)
            labels = [label for _, label in records]
            prompts = [prompt_of(record, self.prompt_column, label) for record, label in records]
            prompts = checked_prompts(prompts, labels)
            chat = isinstance(prompts[0], list)
            if self._chat is None:
                self._chat = chat
            bad = next((i for i, p in enumerate(prompts) if isinstance(p, list) != self._chat), None)
            if bad is not None:
                raise TypeError(f"the prompt stream mixes chat messages and plain text: its first prompts are "
                                f"{'chat messages' if self._chat else 'strings'} but {labels[bad]} is "
                                f"{prompts[bad]!r:.60}; give every prompt in one form")
            texts, ids, mask, keep = self.encoder(prompts, labels)
            j = 0
            for i, (record, _) in enumerate(records):
                if not keep[i]:
                    self.filtered += 1
                    continue
                if self._next >= first_held:
                    columns = {k: v for k, v in record.items() if k != self.prompt_column and not (
                        k == "messages" and self.prompt_column not in record)} if isinstance(record, dict) else {}
                    self._column_names.update(dict.fromkeys(columns))
                    self._entries[self._next] = _Entry(prompts[i], columns, texts[j], ids[j], mask[j])
                self._next += 1
                j += 1

    def _take(self, count: int) -> list:
        """The source's next `count` records as (record, label), across passes."""
        out = []
        while len(out) < count:
            if self._iterator is None:
                self._iterator = self._open()
            try:
                item = next(self._iterator)
            except StopIteration:
                if self._in_pass == 0:
                    raise ValueError("the prompt stream yields no prompts" + (
                        f" in pass {self._passes + 1}" if self._passes else "") + "; give a source that yields "
                        "prompts (strings, chat messages or records)") from None
                if _one_shot(self.source):
                    raise PromptStreamEnded(
                        f"the prompt stream (a one-shot iterator) ended after {self._read} prompts; give a source "
                        "that can be read again (a list, a datasets.IterableDataset, a function returning an "
                        "iterator) to walk it again, or a longer one", self._next) from None
                self._iterator, self._passes, self._in_pass = None, self._passes + 1, 0
                continue
            label = f"prompt stream item {self._read}"
            if isinstance(item, _Labelled):
                item, label = item
            out.append((item, label))
            self._read += 1
            self._in_pass += 1
        return out

    def _open(self):
        iterator = _open_pass(self.source, self._passes)
        if iterator is None:
            raise PromptStreamEnded("the prompt stream ended", self._next)
        return iterator


def _one_shot(source) -> bool:
    """Whether a stream source is an iterator, read once (a generator)."""
    return not callable(source) and iter(source) is source


def _open_pass(source, passes: int):
    """An iterator over pass `passes` (from 0) of a stream source: a function's new iterator,
    an iterable's (its `set_epoch(passes)` called first where it has one), a one-shot
    iterator itself; None where a one-shot iterator has no second pass."""
    if callable(source) and not hasattr(source, "__iter__"):
        return iter(source())
    if _one_shot(source):
        return None if passes else source
    if hasattr(source, "set_epoch"):
        source.set_epoch(passes)
    return iter(source)


class _Field:
    """One field of a `PromptStream`'s rows, indexed as a `PromptTable`'s lists and arrays
    are: by one row, or (ids, mask) by an array of rows."""

    def __init__(self, stream: PromptStream, field: str, column: Optional[str] = None):
        self.stream, self.field, self.column = stream, field, column

    def _one(self, row):
        entry = self.stream.entry(row)
        if self.field == "column":
            return entry.columns.get(self.column)
        return getattr(entry, self.field)

    def __getitem__(self, rows):
        if np.ndim(rows) == 0:
            return self._one(rows)
        values = [self._one(r) for r in np.asarray(rows).reshape(-1)]
        return np.stack(values) if self.field in ("ids", "mask") else values

    @property
    def shape(self):
        return (None, self.stream.width)


class PromptMixture:
    """Prompts drawn from several sources with weights (`mix_prompts`)."""

    def __init__(self, sources, weights, *, seed: int = 0, prompt_column: str = "prompt", names=None,
                 source_column: Optional[str] = None):
        sources, weights = list(sources), list(weights)
        if not sources:
            raise ValueError("mix_prompts: give at least one source")
        if len(weights) != len(sources):
            raise ValueError(f"mix_prompts: {len(sources)} sources but {len(weights)} weights; give one weight per "
                             "source")
        bad = [w for w in weights if not (isinstance(w, (int, float)) and np.isfinite(w) and w >= 0)]
        if bad or sum(weights) <= 0:
            raise ValueError(f"mix_prompts: weights={weights} are invalid: each a finite number >= 0, their sum > 0")
        self.names = list(names) if names is not None else [
            os.fspath(s) if isinstance(s, (str, os.PathLike)) else f"source {k}" for k, s in enumerate(sources)]
        if len(self.names) != len(sources):
            raise ValueError(f"mix_prompts: {len(sources)} sources but {len(self.names)} names")
        self.probs = np.asarray(weights, np.float64) / float(sum(weights))
        self.seed, self.prompt_column, self.source_column = int(seed), prompt_column, source_column
        self.tables = []  # per source: (records, labels) of a source read whole, or None for a stream
        for name, source in zip(self.names, sources):
            if is_stream(source):
                self.tables.append(None)
                continue
            prompts, columns = load_prompt_table(source, prompt_column)
            records = [{prompt_column: p, **{k: v[i] for k, v in columns.items()}} for i, p in enumerate(prompts)]
            self.tables.append((records, [f"{name} row {i}" for i in range(len(records))]))
        self.sources = sources

    def __iter__(self):
        """The mixture's prompts, drawn without end (a one-shot source that ends ends it): the
        source of the n-th prompt is the n-th draw of a generator seeded with `seed`; a source
        read whole is walked in an order reshuffled every pass (seeded with the seed, the
        source and the pass), a stream in its own order, read again when it ends."""
        choices = np.random.default_rng([self.seed, 1])
        walks = [self._walk(k) for k in range(len(self.sources))]
        while True:
            for k in choices.choice(len(self.sources), size=1024, p=self.probs):
                try:
                    record, label = next(walks[k])
                except StopIteration:
                    return
                if self.source_column is not None:
                    record = dict(record) if isinstance(record, dict) else {self.prompt_column: record}
                    record[self.source_column] = self.names[k]
                yield _Labelled(record, label)

    def _walk(self, k: int):
        table, source, name = self.tables[k], self.sources[k], self.names[k]
        for passes in itertools.count():
            if table is not None:
                records, labels = table
                for i in np.random.default_rng([self.seed, 2, k, passes]).permutation(len(records)):
                    yield records[i], labels[i]
                continue
            iterator = _open_pass(source, passes)
            if iterator is None:  # a one-shot source read once
                return
            count = 0
            for i, record in enumerate(iterator):
                count += 1
                yield (record.record, record.label) if isinstance(record, _Labelled) else (record, f"{name} item {i}")
            if count == 0:
                raise ValueError(f"mix_prompts: {name} yields no prompts")


def mix_prompts(sources, weights, *, seed: int = 0, prompt_column: str = "prompt", names=None,
                source_column: Optional[str] = None) -> PromptMixture:
    """A prompt stream mixing `sources` (each a list, a `datasets.Dataset`, a prompts file, or a
    stream) with `weights` (OpenRLHF's `--prompt_data_probs`): each next prompt comes from
    source k with probability weights[k] / sum(weights), the draws a pure function of `seed`,
    so a resumed run continues the same sequence. Sources read whole are walked in an order
    reshuffled every pass; the mixture has no end (unless a one-shot source ends). With
    `source_column`, each record gets that column holding its source's name (`names`, else the
    file path or "source k"), which reward functions receive like any column. Give the result
    as `prompts=`; the trainer streams it."""
    return PromptMixture(sources, weights, seed=seed, prompt_column=prompt_column, names=names,
                         source_column=source_column)


class _FileRecords:
    """A .jsonl or .txt prompts file read a line at a time, each pass from its start
    (`DataConfig.stream_prompts`); a .json file is one JSON value and is read whole."""

    def __init__(self, path: str, prompt_column: str):
        self.path, self.prompt_column = path, prompt_column

    def __iter__(self):
        extension = "." + file_format(self.path, lambda: list(itertools.islice(iter_lines(self.path), 1000)),
                                      self.prompt_column)
        if extension == ".json":
            rows, labels = read_records(self.path, self.prompt_column)
            yield from (_Labelled(r, label) for r, label in zip(rows, labels))
            return
        for n, line in iter_lines(self.path):
            if not line.strip():
                continue
            record = json_line(self.path, n, line, self.prompt_column) if extension == ".jsonl" else line
            yield _Labelled(record, f"{self.path} line {n}")


def read_prompt_records(source, prompt_column: str = "prompt"):
    """`source` as a stream's source: a prompts file read a line at a time as the run reaches
    it (it must exist), a list or `datasets.Dataset` walked in its order, a stream as it is."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        check_prompts_file(path)
        return _FileRecords(path, prompt_column)
    if isinstance(source, (str, bytes)):
        raise TypeError("prompts must be a list of strings or a file path, not a single string")
    return source
