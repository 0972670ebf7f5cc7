"""Whether a run fits a target, and how fast it could at best go: each program compiled for
the target's devices, its memory per device beside what the run keeps resident meanwhile,
its work, and the settings to change when it does not fit.

    plan = plan_run(config, Inputs(policy="path/with/config.json", tokenizer=None, prompts=None),
                    resolve_target("h200x8"))
    print(plan.text())
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax

from jaxppo.plan import breakdown as bd
from jaxppo.plan import costs
from jaxppo.plan.programs import PROGRAMS, RunShapes, abstract_run, image_tokens, lower_programs
from jaxppo.plan.targets import GIB, Target, target_devices

__all__ = ["ProgramPlan", "Plan", "plan_run", "run_work"]


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One program on the target: compile seconds (on this machine), its memory per device
    (`costs.MemoryFigures`; None where the target's compiler refused it for want of memory,
    `refused` holding its words: the TPU compiler checks the HBM), the run's other state resident per device while it runs (the
    optimizer's states during sampling, the frozen models during the update, ...), its work
    (`costs.ProgramWork`), its lower bound in seconds, and for the sampler the kernels one
    decode step launches."""

    name: str
    compile_s: float
    memory: costs.MemoryFigures
    resident_besides: int
    work: costs.ProgramWork
    lower_bound_s: float
    decode_kernels: Optional[int] = None
    refused: Optional[str] = None
    decode_gathered: Optional[int] = None
    breakdown: Optional[bd.Breakdown] = None
    decode_unknown_loops: int = 0  # loops in the decode step of unknown trips: decode_kernels is then "at least"

    @property
    def total(self) -> float:
        """Bytes per device while it runs: its peak and what the run keeps besides (infinite
        where the target's compiler refused the program for want of memory: `refused`)."""
        return float("inf") if self.memory is None else self.memory.peak + self.resident_besides


@dataclasses.dataclass(frozen=True)
class Plan:
    """A run on a target: the programs (`ProgramPlan`), the usable bytes per device, and
    what was planned (the mesh's axis sizes, the settings' summary)."""

    target: Target
    programs: tuple
    mesh_axes: dict
    summary: str
    config: object = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def fits(self) -> bool:
        return all(p.total <= self.target.usable_bytes for p in self.programs)

    @property
    def lower_bound_s(self) -> float:
        """The iteration's floor: its programs one after another (a synchronous iteration)."""
        return sum(p.lower_bound_s for p in self.programs)

    def text(self) -> str:
        t = self.target
        lines = [f"target {t.describe()}", f"run: {self.summary}; mesh {_axes(self.mesh_axes)}",
                 f"{'program':<10} {'compile s':>9} {'peak GiB':>9} {'+ resident':>10} {'= per device':>12} "
                 f"{'headroom':>9} {'TFLOP':>8} {'floor s':>9}  notes"]
        for p in self.programs:
            if p.memory is None:
                lines.append(f"{p.name:<10} {p.compile_s:>9.1f} DOES NOT FIT: the compiler: {p.refused}")
                continue
            headroom = (t.usable_bytes - p.total) / GIB
            note = "" if p.decode_kernels is None else f"{p.decode_kernels} kernels per decode step"
            if p.decode_unknown_loops:
                note = (f"at least {note} ({p.decode_unknown_loops} loops inside of unknown trip count, "
                        "each counted once)")
            if p.decode_gathered:
                note += f", {p.decode_gathered / GIB:.2f} GiB all-gathered per step"
            note = ("DOES NOT FIT; " if p.total > t.usable_bytes else "") + note
            lines.append(f"{p.name:<10} {p.compile_s:>9.1f} {p.memory.peak / GIB:>9.3f} "
                         f"{p.resident_besides / GIB:>10.3f} {p.total / GIB:>12.3f} {headroom:>9.2f} "
                         f"{p.work.flops / 1e12:>8.2f} {p.lower_bound_s:>9.4f}  {note}".rstrip())
            if p.breakdown is not None:
                lines.append(f"{'':<10} {p.breakdown.text()}")
        lines.append(f"usable per device: {t.usable_bytes / GIB:.2f} GiB; iteration floor {self.lower_bound_s:.3f} s "
                     "(FLOPs at peak, bytes at full bandwidth, programs back to back)")
        lines.append("fits" if self.fits else "does not fit: " + "; ".join(self.advice()))
        lines.append("(compiled without the hardware: no autotuning ran, so kernel choices and temporaries can differ "
                     "from a compile on the device; the floor is a bound, not a prediction)")
        return "\n".join(lines)

    def advice(self) -> list:
        """The settings to change, for the programs that do not fit, by what fills them."""
        over = {p.name for p in self.programs if p.total > self.target.usable_bytes}
        breakdowns = {p.name: p.breakdown for p in self.programs}
        return advice(self.config, over, self.mesh_axes, self.target, breakdowns)


def _axes(axes: dict) -> str:
    return " x ".join(f"{k}={v}" for k, v in axes.items()) if axes else "none (one device)"


# What each part of a program's peak answers to (`breakdown`): the kinds of remedy, in the
# order `advice` tries them.
_REMEDIES = {
    "parameters": ("shard", "adapters", "dtype"), "optimizer state": ("shard", "adapters"),
    bd.GRADIENTS: ("shard", "adapters"), bd.WEIGHT_COPIES: ("shard", "adapters"), "frozen models": ("shard",),
    bd.ACTIVATIONS: ("micro", "remat", "context"), bd.LOGITS: ("chunk", "micro"), bd.KV_CACHE: ("rows",),
    bd.GATHERED: ("tensor",), bd.STATE_COPIES: ("report",), "the rollout": ("rows",), "the sampled batch": ("rows",),
    "prompts": ("rows",),
}


def advice(config, over: set, axes: dict, target: Target, breakdowns: Optional[dict] = None) -> list:
    """What would lower the programs in `over`: from what fills each (its `Breakdown` in
    `breakdowns`, largest part first, parts under a tenth of the program's peak left out),
    or, where no breakdown was read, every setting that lowers what such a program holds."""
    c, layout = config, config.layout
    text = {
        "micro": (c.batch.micro_batch_size > 1,
                  f"a smaller micro-batch (--gradient-accumulation-steps {2 * c.batch.gradient_accumulation_steps}, or "
                  f"--mini-batch-size {max(1, c.batch.mini_batch_size // 2)}): the update's activations follow the "
                  "micro-batch"),
        "remat": (not layout.remat, "--remat full (recompute each block in the backward pass)"),
        "chunk": (layout.logits_chunk_size is None, "--logits-chunk-size 128 (the LM head a chunk at a time)"),
        "shard": (axes.get("fsdp", 1) < target.chips,
                  f"--mesh-fsdp {target.chips} (parameters and optimizer states sharded over every chip)"),
        "dtype": (layout.dtype == "float32", "--dtype bfloat16 (compute and frozen copies in bf16)"),
        "adapters": (True, "--lora-rank 16 (train adapters: no float32 copy or optimizer state of the base)"),
        "rows": (True, "a smaller --batch-size or --response-length (the sampler's KV cache and the scored batch)"),
        "context": _context_advice(c, axes, target),
        "tensor": (axes.get("tensor", 1) == 1 and target.chips > 1,
                   "--mesh-tensor 2 (each layer's gathered weights split over two chips)"),
        "report": (True, "state-sized copies in the update (of weights, moments or gradients): not expected of "
                         "jaxppo's update on this target (please report it with this plan)"),
    }
    kinds = []
    breakdowns = breakdowns or {}
    for name in sorted(over):
        b = breakdowns.get(name)
        if b is None:  # no breakdown: what lowers such a program, as a list
            fallback = {"update": ("micro", "remat", "chunk", "context", "shard", "dtype", "adapters"),
                        "score": ("shard", "dtype", "adapters", "rows"),
                        "generate": ("shard", "dtype", "adapters", "rows")}[name]
            kinds += fallback
            continue
        parts = sorted(b.arguments + b.temporaries, key=lambda kv: -kv[1])
        total = sum(v for _, v in parts)
        for part, size in parts:
            if size >= 0.1 * total:
                kinds += _REMEDIES.get(part, ())
    out = []
    for kind in dict.fromkeys(kinds):
        applies, words = text[kind]
        if applies and words not in out:
            out.append(words)
    return out


def _context_advice(c, axes: dict, target: Target) -> tuple:
    """(whether it applies, the words) for a context axis: the largest power of two that
    divides the chips and the rows' length, where the run has none and each device's
    micro-batch is down to one row (else a smaller micro-batch comes first)."""
    width = c.data.query_length + c.sampling.response_length
    rows = c.batch.micro_batch_size // max(1, axes.get("data", 1) * axes.get("fsdp", 1))
    sizes = [k for k in (2, 4, 8, 16, 32, 64) if k <= target.chips and target.chips % k == 0 and width % k == 0]
    if axes.get("context", 1) > 1 or not sizes or rows != 1:
        return False, ""
    k = sizes[-1]
    return True, (f"--mesh-context {k} (each row's {width} positions split over {k} chips: the update's activations "
                  "and attention scores per chip fall with it)")


def run_work(shapes: RunShapes, images=None) -> dict:
    """{program: `costs.ProgramWork`} of the run, from its models' shapes; with `images`
    (count, height, width per prompt) the vision encoder's FLOPs too (`_encoder_flops`)."""
    c, spec, models = shapes.config, shapes.spec, shapes.models
    b, q, r = c.batch.batch_size, c.data.query_length, c.sampling.response_length
    params = shapes.run.train.params
    policy = costs.model_shape(models.policy_model, spec.policy_params(params))
    lora = models.policy_model.lora is not None
    critic = getattr(models.apply_fn, "critic", None)
    critic_shape = costs.model_shape(critic, params["critic"]) if critic is not None else None
    trained = [(policy, r, not lora)] + ([(critic_shape, 0, True)] if critic_shape is not None else [])
    trainable = sum(int(x.size) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
                    if not lora or any(k in jax.tree_util.keystr(path) for k in ("lora", "critic", "value_head")))
    sizes = dict(shapes.mesh.shape) if shapes.mesh is not None else {}
    shards = sizes.get("fsdp", 1) * sizes.get("context", 1) * sizes.get("tensor", 1)  # what stores the parameters
    epochs, updates = c.batch.ppo_epochs, c.batch.updates_per_step
    micro = updates * c.batch.gradient_accumulation_steps
    prompts = b // spec.num_generations if c.layout.share_prompts else b  # a group's prompt computed once
    update = costs.update_work(trained, b, prompts, q, r, epochs, updates, micro, bool(c.layout.remat), trainable,
                               shards)
    scored = [] if spec.sampler_logprobs_used else [(policy, True)]
    if models.ref_model is not None:
        ref_params = shapes.ref_params if shapes.ref_params is not None else spec.policy_params(params)
        scored.append((costs.model_shape(models.ref_model, ref_params), True))
    if models.reward_model is not None:
        scored.append((costs.model_shape(models.reward_model, shapes.reward_params), False))
    if critic_shape is not None:
        scored.append((critic_shape, False))
    score = costs.score_work(scored, b, prompts, q, r)
    data = shapes.mesh.shape["data"] * shapes.mesh.shape["fsdp"] if shapes.mesh is not None else 1
    generate = costs.generate_work(policy, b, b // spec.num_generations, q, r, b // data, shards)
    if images is not None:  # the encoder's forward per distinct prompt; forward and backward where it trains
        encoder = _encoder_flops(models.policy_model.config, images)
        trains = c.lora.train_vision_encoder
        passes = 1 + (2 + bool(c.layout.remat) if trains else 0)
        readers = (0 if spec.sampler_logprobs_used else 1) + (models.ref_model is not None)
        update = costs.with_flops(update, epochs * passes * prompts * encoder)
        score = costs.with_flops(score, readers * prompts * encoder)
        generate = costs.with_flops(generate, b // spec.num_generations * encoder)
    return {"update": update, "score": score, "generate": generate}


def _encoder_flops(model_config, images) -> float:
    """The vision encoder's forward FLOPs for one prompt's `images` (count, height, width)."""
    reader, grids, _ = image_tokens(model_config, images)
    return sum(reader.flops(grid) for grid in grids)


def _resident(shapes: RunShapes) -> dict:
    """{program: bytes per device the run holds besides that program's arguments}."""
    train = shapes.run.train
    params = costs.per_device_bytes(train.params)
    optimizer = costs.per_device_bytes(train.opt_state)
    frozen = costs.per_device_bytes(shapes.ref_params) + costs.per_device_bytes(shapes.reward_params)
    policy = costs.per_device_bytes(shapes.spec.policy_params(train.params))
    return {"update": frozen, "score": optimizer, "generate": optimizer + (params - policy) + frozen}


def plan_run(config, inputs, target: Target, *, devices=None, programs=PROGRAMS,
             host_scores: Optional[bool] = None, images=None) -> Plan:
    """The `Plan` of the run of `config` and `inputs` (`jaxppo.run.parts.Inputs`; models as
    checkpoint directories, of which only config.json is read, or `(Model, params)` pairs)
    on `target`: each program compiled for the target's devices (`devices`: others of the
    same count, such as host CPU devices, to plan against their compiler). `images`:
    (count, height, width), a vision-language policy's images per prompt in pixels
    (`jaxppo.plan.programs.planned_images`), or None."""
    devices = target_devices(target) if devices is None else list(devices)
    if len(devices) != target.chips:
        raise ValueError(f"{len(devices)} devices given for target {target.name} of {target.chips} chips")
    shapes = abstract_run(config, inputs, devices, host_scores=host_scores, images=images)
    work, resident = run_work(shapes, images), _resident(shapes)
    out = []
    for name, lowered in lower_programs(shapes, programs).items():
        floor = work[name].lower_bound(target.chips, target.peak_flops, target.bandwidth)
        start = time.perf_counter()
        try:
            compiled, breakdown = bd.compile_with_breakdown(lowered, *_parts(shapes, name))
        except jax.errors.JaxRuntimeError as err:  # the TPU compiler refuses what exceeds the HBM
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            out.append(ProgramPlan(name, time.perf_counter() - start, None, resident[name], work[name], floor,
                                   refused=_first_line(str(err))))
            continue
        seconds = time.perf_counter() - start
        steps = shapes.config.sampling.response_length
        step = costs.decode_step(compiled.as_text(), steps) if name == "generate" else None
        kernels, gathered = (step.kernels, step.gathered_bytes) if step else (None, None)
        if gathered:  # what each decode step receives from the other chips, as compiled
            work[name] = costs.ProgramWork(work[name].flops, work[name].bytes_per_chip + steps * gathered)
            floor = work[name].lower_bound(target.chips, target.peak_flops, target.bandwidth)
        out.append(ProgramPlan(name, seconds, costs.memory_figures(compiled), resident[name], work[name], floor,
                               kernels, breakdown=breakdown, decode_gathered=gathered,
                               decode_unknown_loops=step.unknown_trip_loops if step else 0))
    axes = dict(shapes.mesh.shape) if shapes.mesh is not None else {}
    return Plan(target, tuple(out), axes, _summary(shapes, images), shapes.config)


def _parts(shapes: RunShapes, program: str) -> tuple:
    """({argument name: bytes per device}, `breakdown.ValueShapes`, the name of the rest of
    the arguments) of one of the run's programs, for `breakdown.compile_with_breakdown`."""
    train = shapes.run.train
    frozen = (shapes.ref_params, shapes.reward_params)
    policy = shapes.spec.policy_params(train.params)
    if program == "update":
        arguments, rest = {"parameters": costs.per_device_bytes(train.params),
                           "optimizer state": costs.per_device_bytes(train.opt_state)}, "the rollout"
    elif program == "score":
        arguments, rest = {"parameters": costs.per_device_bytes(train.params),
                           "frozen models": costs.per_device_bytes(frozen)}, "the sampled batch"
    else:
        arguments, rest = {"parameters": costs.per_device_bytes(policy)}, "prompts"
    weights = (train.params,) + frozen
    c, m = shapes.config, shapes.models.policy_model.config
    sizes = set(shapes.mesh.shape.values()) if shapes.mesh is not None else {1}
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    q, r = c.data.query_length, c.sampling.response_length
    heads = {m.num_kv_heads} | {m.num_kv_heads // n for n in sizes if m.num_kv_heads % n == 0}
    leaf = jax.tree.leaves(train.params)[0]
    update = program == "update"  # the other programs hold no gradients nor optimizer state
    value_shapes = bd.ValueShapes(
        trained=bd.dims_of(train.trained_params(), local=True) if update else frozenset(),
        state=bd.dims_of((train.params, train.opt_state), local=True) if update else frozenset(),
        weights_local=bd.dims_of(weights, local=True), weights_full=bd.dims_of(weights, local=False),
        vocab=frozenset({m.vocab_size} | {m.vocab_size // n for n in sizes if m.vocab_size % n == 0}),
        kv_tails=frozenset(tuple(sorted((length, h, head_dim))) for length in (q + r, q, r) for h in heads)
        if program == "generate" else frozenset(),  # elsewhere keys and values are activations
        master_dtype=_HLO_DTYPES.get(jax.numpy.dtype(leaf.dtype).name, "f32"))
    return arguments, value_shapes, rest


_HLO_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0]
    return line.split("RESOURCE_EXHAUSTED: ", 1)[-1][:300]


def _summary(shapes: RunShapes, images=None) -> str:
    c, m = shapes.config, shapes.models.policy_model
    seen = ""
    if images is not None:
        count, height, width = images
        tokens = image_tokens(m.config, images)[2]
        seen = (f"; {count} image(s) of {height} x {width} pixels per prompt ({tokens} of its "
                f"{c.data.query_length} tokens; the vision encoder's FLOPs in the floor)")
    elif m.config.vision is not None:
        seen = ("; a vision-language policy planned on text prompts: its images and the vision encoder's work are "
                "not in these figures (--images COUNTxHEIGHTxWIDTH plans them)")
    lora = f", LoRA rank {m.lora.rank}" if m.lora is not None else ", full fine-tuning"
    return (f"{c.advantages.advantage_estimator} {m.config.model_type} {m.config.num_layers} layers{lora}, "
            f"batch {c.batch.batch_size} x ({c.data.query_length} + {c.sampling.response_length}) tokens, mini-batch "
            f"{c.batch.mini_batch_size}, micro-batch {c.batch.micro_batch_size}, {c.batch.ppo_epochs} epoch(s), "
            f"{c.layout.dtype}, remat {c.layout.remat or 'off'}{seen}")
