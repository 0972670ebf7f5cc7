"""What a compiled program holds at its peak, by what it is: its arguments as the run names
them (parameters, optimizer state, frozen models, the batch), and its temporaries read from
the compiler's own buffer assignment (XLA's dump of the optimised program: every value of
the temporaries' arena with its offset and size, and each value's live range), at the
moment the arena is fullest, each value sorted by what it matches: the trained parameters'
gradients and the optimizer's temporaries, state-sized copies, weights gathered
from their shards, weights converted to the compute dtype or sliced out of a stack of
layers, logits, the KV cache, and the rest (activations).

    compiled, breakdown = compile_with_breakdown(lowered, {"parameters": n, ...}, shapes)
    print(breakdown.text())

The sorting goes by shape and opcode, not by provenance: a value is a gradient when it has
a trained parameter's shape (per device) in float32, a gathered weight when it has a
weight's whole shape and that is not the shard a device keeps (or is any matrix an
all-gather made: a mixture's tokens gathered for its experts count there too), logits when
its last axis is the vocabulary, KV cache (in the sampler) when it ends in the cache's
length, heads and head width. An activation that happens to have a weight's shape is
sorted with the weights; in the update a float32 slice of a weight counts as a gradient, and so does a
copy of zeros of a trained parameter's shape (a loop's gradient accumulator starts so)
(the forward pass and the sampler have neither gradients nor optimizer state). The dump is
XLA's debug output (`xla_dump_to`); where a compiler writes none, or one this parser does
not read, the breakdown is None and the plan reports totals alone.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from typing import Optional

import numpy as np

__all__ = ["Breakdown", "ValueShapes", "compile_with_breakdown", "temporaries_at_peak", "TEMPORARY_PARTS"]

GRADIENTS = "gradients and optimizer temporaries"
STATE_COPIES = "state-sized copies"
GATHERED = "gathered weights"
WEIGHT_COPIES = "weight copies (compute dtype, layer slices)"
LOGITS = "logits"
KV_CACHE = "KV cache"
ACTIVATIONS = "activations and other temporaries"
TEMPORARY_PARTS = (GRADIENTS, STATE_COPIES, GATHERED, WEIGHT_COPIES, LOGITS, KV_CACHE, ACTIVATIONS)


@dataclasses.dataclass(frozen=True)
class ValueShapes:
    """The shapes a program's values are sorted against (dims as tuples of int).

    Attributes:
      trained: per-device dims of the trained parameters (of a scanned stack also one
        layer's), whose float32 values are gradients or the optimizer's temporaries.
      state: per-device dims of every leaf of the training state (parameters, optimizer
        state), a copy of whose shape (a weight, a moment or a gradient: they share their
        shapes) is a state-sized copy.
      weights_local: per-device dims of every weight the program reads (and one layer's).
      weights_full: the whole dims of every weight (and one layer's): held whole where a
        device keeps a shard, they were gathered.
      vocab: the vocabulary sizes (and their shards): a last axis of that size is logits.
      kv_tails: the trailing (length, kv heads, head dim) of the KV cache's leaves, each
        sorted (the compiler may hold them in another order).
      master_dtype: the dtype the weights are kept in ("f32"); held in another, a weight
        is a converted copy.
    """

    trained: frozenset = frozenset()
    state: frozenset = frozenset()
    weights_local: frozenset = frozenset()
    weights_full: frozenset = frozenset()
    vocab: frozenset = frozenset()
    kv_tails: frozenset = frozenset()
    master_dtype: str = "f32"


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Bytes per device of a program at its peak: `arguments` ((name, bytes), as given),
    and `temporaries` ((part, bytes) of `TEMPORARY_PARTS` alive when the arena is fullest),
    with `arena` the arena's size (what the compiler reserves; the parts add up to at most
    it)."""

    arguments: tuple
    temporaries: tuple
    arena: int

    def part(self, name: str) -> int:
        return dict(self.arguments + self.temporaries).get(name, 0)

    def largest(self) -> str:
        """The largest part, arguments and temporaries together."""
        return max(self.arguments + self.temporaries, key=lambda kv: kv[1])[0]

    def largest_temporary(self) -> Optional[str]:
        return max(self.temporaries, key=lambda kv: kv[1])[0] if self.temporaries else None

    def text(self) -> str:
        gib = lambda n: f"{n / 2 ** 30:.2f}"  # noqa: E731
        parts = lambda kvs: ", ".join(f"{k} {gib(v)}" for k, v in sorted(kvs, key=lambda kv: -kv[1]) if v)  # noqa: E731
        return f"arguments: {parts(self.arguments)}; temporaries at their peak: {parts(self.temporaries)} (GiB)"


def compile_with_breakdown(lowered, arguments: dict, shapes: ValueShapes, rest: str = "other arguments"):
    """(`lowered` compiled, its `Breakdown` or None): one compile, with XLA's dump of the
    optimised program written to a temporary directory and read back. `arguments`:
    {name: bytes per device} of the program's arguments as the run names them; what the
    compiler counts beyond their sum is added under the name `rest`."""
    with tempfile.TemporaryDirectory(prefix="jaxppo-plan-") as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        try:
            temporaries, arena = temporaries_at_peak(dump, shapes)
        except (OSError, ValueError, KeyError):
            return compiled, None
    total = int(compiled.memory_analysis().argument_size_in_bytes)
    named = [(k, int(v)) for k, v in arguments.items() if v]
    other = total - sum(v for _, v in named)
    if other > 0:
        named.append((rest, other))
    return compiled, Breakdown(tuple(named), tuple(temporaries.items()), arena)


# ------------------------------------------------------------------ reading XLA's dump

_VALUE = re.compile(r"^\s*value:\s*<\d+\s+(\S+)[^>]*@\d+>\s*\(size=(\d+),offset=(\d+)\):\s*(\S+)")
_RANGE = re.compile(r"^\s*(\S+\{[\d,]*\}):(\d+)-(\d+)\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(%?([\w.\-]*)")
_ARRAY = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")


def _one(dump: str, suffix: str) -> str:
    """The path of the dump's file ending in `suffix` (of the last module: the program)."""
    found = sorted(glob.glob(os.path.join(dump, f"*{suffix}")))
    if not found:
        raise OSError(f"no *{suffix} in XLA's dump")
    return found[-1]


def temporaries_at_peak(dump: str, shapes: ValueShapes) -> tuple:
    """({part: bytes} of the values alive in the temporaries' arena when it is fullest, the
    arena's size), from the buffer assignment, live ranges and optimised HLO of XLA's dump
    directory `dump`."""
    assignment = _one(dump, "after_optimizations-buffer-assignment.txt")
    prefix = assignment[: -len("-buffer-assignment.txt")]
    values, arena = _arena_values(assignment)
    ranges = _live_ranges(prefix + "-live-range.txt")
    opcodes = _opcodes(prefix + ".txt")
    slots = {}  # (offset, size) -> [(start, end, name, shape)]
    for name, size, offset, shape in values:
        key = name if "{" in name else name + "{}"
        if key in ranges:
            slots.setdefault((offset, size), []).append((*ranges[key], name, shape))
    t = _fullest(slots)
    out = dict.fromkeys(TEMPORARY_PARTS, 0)
    for (offset, size), lives in slots.items():
        alive = [(name, shape) for start, end, name, shape in lives if start <= t <= end]
        if alive:
            name, shape = alive[0]
            out[classify(shape, opcodes.get(name.split("{")[0], ""), shapes)] += size
    return out, arena


def _arena_values(path: str) -> tuple:
    """([(value name, size, offset, shape)] of the temporaries' arena, its size)."""
    values, arena, inside = [], None, False
    with open(path) as f:
        for line in f:
            if line.startswith("allocation "):
                inside = "preallocated-temp" in line
                if inside:
                    arena = int(re.search(r"size (\d+)", line).group(1))
                continue
            if inside:
                m = _VALUE.match(line)
                if m:
                    values.append((m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)))
    if arena is None:
        raise ValueError("no preallocated-temp allocation in the buffer assignment")
    return values, arena


def _live_ranges(path: str) -> dict:
    """{value name with its shape index: (first, last) position in the program's order}."""
    out, inside = {}, False
    with open(path) as f:
        for line in f:
            if line.strip() == "BufferLiveRange:":
                inside = True
                continue
            if inside:
                m = _RANGE.match(line)
                if m is None:
                    if line.strip():
                        break
                    continue
                out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    if not out:
        raise ValueError("no buffer live ranges in the dump")
    return out


def _opcodes(path: str) -> dict:
    """{instruction name: opcode} of the optimised HLO; a copy of a broadcast (zeros to
    start a loop's accumulator from) as "copy-of-broadcast"."""
    out = {}
    with open(path) as f:
        for line in f:
            m = _NAME.match(line)
            if m:
                copied_zeros = m.group(2) == "copy" and "broadcast" in m.group(3)
                out[m.group(1)] = "copy-of-broadcast" if copied_zeros else m.group(2)
    return out


def _fullest(slots: dict) -> int:
    """The position at which the live slots' bytes add up to the most (a slot is live while
    any of its values is)."""
    events = []
    for (_, size), lives in slots.items():
        for start, end in _merged([(s, e) for s, e, _, _ in lives]):
            events += [(start, size), (end + 1, -size)]
    events.sort()
    best_t, best, live = 0, -1, 0
    for t, change in events:
        live += change
        if change > 0 and live > best:
            best_t, best = t, live
    return best_t


def _merged(intervals: list) -> list:
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def classify(shape: str, opcode: str, shapes: ValueShapes) -> str:
    """The part of `TEMPORARY_PARTS` a value of HLO shape `shape` (as "bf16[4,256]{1,0}")
    made by `opcode` belongs to (see the module's docstring for the rules)."""
    m = _ARRAY.match(shape)
    if m is None:  # a tuple of pointers
        return ACTIVATIONS
    dtype, dims = m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)
    master = dtype == shapes.master_dtype
    if (dims in shapes.weights_full and dims not in shapes.weights_local) or (
            opcode.startswith("all-gather") and len(dims) in (2, 3)):  # (a padded gather has no weight's dims)
        return GATHERED
    if master and opcode == "copy" and dims in shapes.state:  # (a copy of zeros starts an accumulator: below)
        return STATE_COPIES
    if master and dims in shapes.trained:
        return GRADIENTS
    if dims in shapes.weights_local:  # converted to the compute dtype, or (outside the update) sliced
        return WEIGHT_COPIES
    if len(dims) >= 4 and tuple(sorted(dims[-3:])) in shapes.kv_tails:  # in any order of the three
        return KV_CACHE
    if dims and dims[-1] in shapes.vocab and len(dims) >= 2:
        return LOGITS
    return ACTIVATIONS


def dims_of(tree, *, local: bool, layers: bool = True) -> frozenset:
    """The dims of `tree`'s leaves (`jax.ShapeDtypeStruct`s or arrays), per device where
    `local` and the leaf has a sharding; with `layers` also each stacked leaf's one layer
    (its dims without the first)."""
    import jax

    out = set()
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        dims = tuple(int(d) for d in (sharding.shard_shape(leaf.shape) if local and sharding is not None
                                      else leaf.shape))
        if len(dims) >= 1 and int(np.prod(dims)) > 1:
            out.add(dims)
            if layers and len(dims) >= 3:
                out.add(dims[1:])
    return frozenset(out)
