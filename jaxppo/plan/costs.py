"""What a compiled program costs, read from the compiler's output and from the model's
shapes: the memory per device (XLA's `memory_analysis`), the kernels one decode step
launches (counted in the optimised HLO), and the work of each program in FLOPs and bytes of
memory traffic (counted from the shapes: XLA's own cost analysis counts a loop's body once,
not once per trip, so it undercounts every scanned program by its trip counts).

FLOPs are the model FLOPs of the usual convention (the matrix products of the transformer
blocks and the LM head, 2 per multiply-add, plus attention's two products over full causal
length); elementwise work, the optimizer's arithmetic and softmaxes are left out. Bytes are
the weights each pass reads, the optimizer's read and write of its state per update, and
the KV cache each decode step reads. The lower bound of a program is max(FLOPs / peak,
bytes / bandwidth) per chip: a floor that assumes perfect overlap and the chip's peak
rates, not a prediction of the time.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import numpy as np

__all__ = ["MemoryFigures", "memory_figures", "DecodeStep", "decode_step", "decode_kernels", "decode_gathered_bytes", "count_kernels", "ModelShape", "model_shape",
           "ProgramWork", "update_work", "score_work", "generate_work", "per_device_bytes"]


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
    """Bytes per device of a compiled program (XLA's buffer assignment): its arguments,
    outputs, the outputs that reuse a donated argument's buffer, its temporaries, and the
    peak (arguments + outputs - aliased + temporaries)."""

    arguments: int
    outputs: int
    aliased: int
    temporaries: int

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


def memory_figures(compiled) -> MemoryFigures:
    m = compiled.memory_analysis()
    return MemoryFigures(int(m.argument_size_in_bytes), int(m.output_size_in_bytes), int(m.alias_size_in_bytes),
                         int(m.temp_size_in_bytes))


def per_device_bytes(tree) -> int:
    """Bytes one device holds of `tree`'s leaves (`jax.ShapeDtypeStruct`s or arrays with
    shardings: each leaf's shard; without a sharding the whole leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not hasattr(leaf, "shape"):
            continue
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total


# ------------------------------------------------------------------ kernels in the HLO

# Instructions that launch nothing: bookkeeping of tuples and buffers, and the second half
# of an asynchronous pair (its start is counted).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "after-all",
         "add-dependency", "domain", "partition-id", "replica-id"}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\((.*)$")


def _computations(hlo: str) -> tuple:
    """({computation name: its instruction lines}, the entry computation's name), from HLO
    text: a computation opens with an unindented line ending in "{", closes with "}"."""
    out, entry, name = {}, None, None
    for line in hlo.splitlines():
        if name is None:
            if line[:1] not in ("", " ") and line.rstrip().endswith("{") and "(" in line:
                words = line.split()
                is_entry = words[0] == "ENTRY"
                name = words[1 if is_entry else 0].lstrip("%")
                out[name] = []
                entry = name if is_entry else entry
        elif line.strip() == "}":
            name = None
        else:
            out[name].append(line)
    return out, entry


def _called(line: str, key: str) -> list:
    """The computations an instruction names after `key=` (one, or a {list})."""
    m = re.search(r"\b" + key + r"=\{([^}]*)\}", line) or re.search(r"\b" + key + r"=(%?[\w.\-]+)", line)
    return [] if m is None else [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]


def _trip_count(line: str) -> Optional[int]:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    return None if m is None else int(m.group(1))


def count_kernels(computations: dict, name: str, cost=None) -> int:
    """Kernels one run of computation `name` launches: each instruction that is not
    bookkeeping counts one (a fusion, a library call, a collective, a copy); a loop counts
    its body and condition once per known trip (once where the count is not known); a
    conditional its largest branch; a call its callee. With `cost(opcode, line)`, each such
    instruction counts what `cost` says instead of one (the bytes it gathers, say)."""
    total = 0
    for line in computations.get(name, ()):
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        op = m.group(1)
        if op in _FREE or op.endswith("-done"):
            continue
        inner = lambda key: sum(count_kernels(computations, c, cost) for c in _called(line, key))  # noqa: E731
        if op == "while":
            total += (_trip_count(line) or 1) * (inner("body") + inner("condition"))
        elif op == "conditional":
            branches = _called(line, "branch_computations") or (_called(line, "true_computation")
                                                                 + _called(line, "false_computation"))
            total += max((count_kernels(computations, c, cost) for c in branches), default=0)
        elif op == "call":
            total += inner("to_apply")
        else:
            total += 1 if cost is None else cost(op, line)
    return total


def _unknown_trips(computations: dict, name: str) -> int:
    """Loops that one run of computation `name` enters whose trip count the compiler does
    not know (`count_kernels` counts each of them once)."""
    total = 0
    for line in computations.get(name, ()):
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        op = m.group(1)
        keys = {"while": ("body", "condition"), "call": ("to_apply",),
                "conditional": ("branch_computations", "true_computation", "false_computation")}.get(op, ())
        total += (op == "while" and _trip_count(line) is None) + sum(
            _unknown_trips(computations, c) for key in keys for c in _called(line, key))
    return total


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One trip of a compiled sampler's decode loop: the kernels it launches, the bytes it
    all-gathers per device, and how many loops inside it run a number of trips the
    compiler does not know (each counted once, so that `kernels` is then a lower bound)."""

    kernels: int
    gathered_bytes: int
    unknown_trip_loops: int


def decode_step(hlo: str, steps: Optional[int] = None) -> Optional[DecodeStep]:
    """One trip of the sampler's decode loop, read from compiled HLO text: of the loops at
    the top of the program, the one that launches the most kernels in all, a trip's
    kernels times its trips. A loop of unknown trips (decoding with an early stop; a
    mixture's blocks in an unrolled prefill) counts `steps` trips (the tokens decoded), or
    where not given as many as the top loop with the most known trips. So the decode loop,
    once per token through every layer, wins over the prefill's layer loop, once per
    layer, however few the layers. None when the program has no loop at its top."""
    computations, entry = _computations(hlo)
    loops = []
    for line in computations.get(entry, ()):
        m = _INSTRUCTION.match(line)
        if m is None or m.group(1) != "while":
            continue
        called = _called(line, "body") + _called(line, "condition")
        loops.append((sum(count_kernels(computations, c) for c in called), _trip_count(line), called))
    if not loops:
        return None
    if steps is None:
        steps = max([trips for _, trips, _ in loops if trips is not None], default=1)
    kernels, _, called = max(loops, key=lambda loop: loop[0] * (loop[1] if loop[1] is not None else steps))
    return DecodeStep(kernels, sum(count_kernels(computations, c, _gathered_bytes) for c in called),
                      sum(_unknown_trips(computations, c) for c in called))


def decode_kernels(hlo: str, steps: Optional[int] = None) -> Optional[int]:
    """Kernels per decode step of a compiled sampler (`decode_step`)."""
    step = decode_step(hlo, steps)
    return None if step is None else step.kernels


def decode_gathered_bytes(hlo: str, steps: Optional[int] = None) -> Optional[int]:
    """Bytes one decode step all-gathers per device (weights gathered from their shards
    for every step, tokens gathered for a mixture's experts): what the step moves over
    the interconnect beyond the device's share (`decode_step`)."""
    step = decode_step(hlo, steps)
    return None if step is None else step.gathered_bytes


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPED = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s[a-z][a-z0-9\-]*\(")
_ARRAYS = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def _gathered_bytes(op: str, line: str) -> int:
    """Bytes an all-gather instruction's results hold; 0 for any other instruction. An
    asynchronous start's result is (its operands, its results), one array each or one
    tuple each where the compiler combined several gathers into one: the second half
    counts."""
    if not op.startswith("all-gather"):
        return 0
    m = _SHAPED.match(line)
    arrays = _ARRAYS.findall(m.group(1)) if m else []
    if op == "all-gather-start":
        arrays = arrays[len(arrays) // 2:]
    return sum(int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * _ITEMSIZE.get(dtype, 4)
               for dtype, dims in arrays)


# ------------------------------------------------------------------ work from the shapes

@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What a model's work depends on: the matrix parameters outside the heads that a token
    runs through (`matmul`; of a mixture's experts, num_experts_per_tok of num_experts),
    the LM head's (hidden x vocab, 0 for a scalar head), the attention widths, the layer
    count, the bytes of all its parameters as held, and of one token's keys and values in
    the KV cache, and the bytes of the parameters the samplers decode from (matrices in the
    compute dtype: `Model.for_decoding`)."""

    matmul: int
    head: int
    layers: int
    attention_width: int
    weight_bytes: int
    kv_bytes_per_token: int
    decode_weight_bytes: int = 0


_HEADS = ("lm_head", "score", "value_head", "embed", "wte", "wpe")


def model_shape(model, params, cache_dtype=None) -> ModelShape:
    """The `ModelShape` of a built-in `Model` with (abstract) `params`."""
    c = model.config
    matmul = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = jax.tree_util.keystr(path)
        # (a vision encoder's weights act on image patches, not on every token: `report.run_work` counts them)
        if len(getattr(leaf, "shape", ())) >= 2 and not any(h in key for h in _HEADS + ("'visual'",)):
            size = int(np.prod(leaf.shape, dtype=np.int64))
            # A mixture's experts: a token runs num_experts_per_tok of num_experts.
            matmul += size * c.num_experts_per_tok // c.num_experts if "'experts'" in key else size
    head = c.hidden_size * c.vocab_size if model.kind in ("causal_lm", "causal_lm_value") else 0
    nbytes = lambda tree: sum(int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize  # noqa: E731
                              for x in jax.tree.leaves(tree) if hasattr(x, "shape"))
    head_dim = c.head_dim or c.hidden_size // c.num_heads
    itemsize = np.dtype(cache_dtype or model.dtype).itemsize
    decoding = jax.eval_shape(lambda p: model.for_decoding(p)[1], params) if model.is_causal_lm else params
    return ModelShape(matmul, head, c.num_layers, c.num_heads * head_dim, nbytes(params),
                      2 * c.num_layers * c.num_kv_heads * head_dim * itemsize, nbytes(decoding))


def _forward_flops(shape: ModelShape, rows: int, query: int, response: int, head_positions: int,
                   prompt_rows: Optional[int] = None) -> float:
    """Model FLOPs of one forward pass over `rows` rows of `query` prompt and `response`
    response tokens, with the LM head at `head_positions` positions per row; `prompt_rows`
    the distinct prompts computed (fewer where a group's rows share theirs; default `rows`).
    Attention as computed: each prompt token against the prompt, each response token
    against the whole row (masked, not skipped)."""
    prompt_rows = rows if prompt_rows is None else prompt_rows
    tokens = prompt_rows * query + rows * response
    products = prompt_rows * query * query + rows * response * (query + response)
    attention = 2 * 2 * shape.layers * shape.attention_width * products
    return 2.0 * shape.matmul * tokens + attention + 2.0 * shape.head * rows * head_positions


@dataclasses.dataclass(frozen=True)
class ProgramWork:
    """The FLOPs and bytes of memory traffic of one program, in all (over every chip),
    and the per-chip share of the bytes that every chip reads whole (gathered weights)."""

    flops: float
    bytes_per_chip: float

    def lower_bound(self, chips: int, peak_flops: float, bandwidth: float) -> float:
        return max(self.flops / chips / peak_flops, self.bytes_per_chip / bandwidth)


def update_work(models: list, rows: int, prompt_rows: int, query: int, response: int, epochs: int, updates: int,
                micro_batches: int, remat: bool, trained_params: int, shards: int) -> ProgramWork:
    """The update: per epoch one forward and one backward pass of each trained model over
    the batch (`models`: (ModelShape, LM-head positions per row, full: whether every weight
    trains, not only adapters); the backward pass costs two forwards where the weights
    train, one where only activations' gradients flow (LoRA's frozen base); remat adds a
    forward), and per optimizer update the optimizer reading and writing its state (f32
    weights, two moments, the gradient: 7 x 4 bytes per trained parameter, sharded over
    `shards`). Each micro-batch's passes read the weights."""
    flops = weights = 0.0
    for shape, head_positions, full in models:
        passes = 1 + (2 if full else 1) + (1 if remat else 0)
        flops += epochs * passes * _forward_flops(shape, rows, query, response, head_positions, prompt_rows)
        weights += micro_batches * passes * shape.weight_bytes
    return ProgramWork(flops, weights + updates * 28.0 * trained_params / shards)


def score_work(models: list, rows: int, prompt_rows: int, query: int, response: int) -> ProgramWork:
    """Scoring: one forward pass of each scoring model (`models`: (ModelShape, with its LM
    head at the response positions)) over the batch, each reading its weights once."""
    flops = sum(_forward_flops(shape, rows, query, response, response if lm else 0, prompt_rows)
                for shape, lm in models)
    return ProgramWork(flops, float(sum(shape.weight_bytes for shape, _ in models)))


def generate_work(shape: ModelShape, rows: int, prompts: int, query: int, response: int, rows_per_chip: int,
                  shards: int = 1, gathered_per_step: int = 0) -> ProgramWork:
    """Sampling: the prefill of `prompts` distinct prompts of `query` tokens (a group's
    rows share theirs), then `response` decode steps of `rows` rows, each step reading each
    chip's share of the weights the sampler decodes from (in the compute dtype, split over
    the `shards` chips that hold them: the compiled decode step computes mostly with the
    shard a chip keeps; what it gathers, activations and, where the partitioner chooses,
    whole weights, is `gathered_per_step`, bytes a chip receives per step, read from the
    compiled program)
    and the chip's rows of the KV cache at its full length (the sampler attends over the
    whole cache, masked)."""
    prefill = _forward_flops(shape, prompts, query, 0, 1)
    attention = 2 * 2 * shape.layers * shape.attention_width * rows * response * (query + response)
    decode = response * (2.0 * shape.matmul + 2.0 * shape.head) * rows + attention
    cache = rows_per_chip * (query + response) * shape.kv_bytes_per_token
    weights = (shape.decode_weight_bytes or shape.weight_bytes) / shards
    return ProgramWork(prefill + decode, response * (weights + cache + gathered_per_step))


def with_flops(work: ProgramWork, flops: float) -> ProgramWork:
    """`work` with `flops` more (e.g. a vision encoder's)."""
    return ProgramWork(work.flops + flops, work.bytes_per_chip)
