"""A run's programs built from its settings and its models' configs alone, with abstract
parameters (`jax.eval_shape`: nothing is allocated, no weight is read), placed on a set of
devices (the target's device-less devices, or real ones) and lowered for ahead-of-time
compilation: the update (the run's `train_step`: `jaxppo.run.compiled.Step`), the scoring
pass (`jaxppo.rollout.forward.finish_rollout`) and the sampler (`generate`: its prefill and
decode loop).

The models are assembled by the trainer's own code (`jaxppo.run.assembly.assemble`: the
same copies, dtypes, LoRA adapters, critic and reference), from checkpoint directories read
as `jaxppo.models.hf.ConfigOnly` (config.json only) or from `(Model, params)` pairs whose
params may be shapes. What differs from a run: no prompts are read, so the prompts are
planned at their padded width (`DataConfig.query_length`) and without the common-prefix
layout; the static sampler is planned (the continuous one's slots are not); packed
sequences are planned at one stream per row, their most.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxppo import sharding
from jaxppo.config.optimizer import build_optimizer
from jaxppo.models.hf import ConfigOnly
from jaxppo.models.decoding import GenerationOutput
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.rollout.engines.static import lower_generate
from jaxppo.run.assembly import assemble
from jaxppo.run.compiled import Step, abstract_rollout
from jaxppo.run.parts import Inputs, initial_run_state, rollout_spec
from jaxppo.update.minibatches import TrainState

__all__ = ["RunShapes", "abstract_run", "lower_programs", "PROGRAMS", "ROLES", "planned_images"]

PROGRAMS = ("update", "score", "generate")
ROLES = ("policy", "reward_model", "ref_policy", "critic", "teacher")


@dataclasses.dataclass
class RunShapes:
    """A run's state as shapes placed on devices: the settings (their input-dependent
    defaults resolved as the trainer resolves them), the assembled models
    (`jaxppo.run.assembly.Assembly`), the rollout spec, the run state, the frozen
    parameters, the mesh (None on one device) and that device, and whether rewards come
    from the host (functions) rather than a reward model."""

    config: Any
    models: Any
    spec: Any
    run: Any
    ref_params: Any
    reward_params: Any
    mesh: Any
    device: Any
    host_scores: bool
    images: Any = None  # the batch's images as shapes (an `ImagePrompt` without ids), or None

    def queries(self, ids):
        """The prompts as the programs take them: `ids`, or with images their `ImagePrompt`."""
        return ids if self.images is None else self.rows_placed(self.images)._replace(ids=ids)

    def rows_placed(self, tree):
        """`tree`'s leaves as shapes whose rows are split like the rollout's."""
        where = sharding.batch_sharding(self.mesh) if self.mesh is not None else SingleDeviceSharding(self.device)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)

    def placed(self, tree):
        """`tree`'s leaves (parameters, optimizer states) as shapes placed like the trainer's."""
        if tree is None:
            return None
        if self.mesh is None:
            where = SingleDeviceSharding(self.device)
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)
        shardings = sharding.tree_shardings(tree, self.mesh)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    def replicated(self, tree):
        where = (SingleDeviceSharding(self.device) if self.mesh is None
                 else NamedSharding(self.mesh, PartitionSpec()))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree)


def _planned_config(config, devices):
    """The settings as the trainer resolves them for these inputs, and what a plan cannot
    know fixed: prompts shared within groups (not beside a context axis), no common
    prefix, packed streams at their most; on several devices a mesh over all of them (the
    unset axes fill it, fsdp first)."""
    changes = {}
    layout = config.layout
    if layout.share_prompts is None:  # as the trainer: on, except beside a context axis
        changes["share_prompts"] = layout.context_size == 1
    if layout.common_prefix is not False:
        changes["common_prefix"] = False
    if layout.pack_sequences and layout.pack_streams is None:
        changes["pack_streams"] = config.batch.micro_batch_size
    if len(devices) > 1 and layout.device_mesh is None:
        changes["mesh"] = sharding.MeshConfig()
    if layout.sampler_devices:
        raise ValueError(f"LayoutConfig.sampler_devices={layout.sampler_devices}: a plan places every program on the "
                         "target's devices together; plan with sampler_devices=0")
    return config.replace(**changes) if changes else config


def _abstract(value):
    """A `(Model, params)` pair's params as shapes; a checkpoint path as `ConfigOnly`."""
    if isinstance(value, tuple):
        return value[0], jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), value[1])
    if isinstance(value, (str, os.PathLike)) and not isinstance(value, ConfigOnly):
        return ConfigOnly(os.fspath(value))
    return value


def abstract_run(config, inputs: Inputs, devices, *, host_scores: Optional[bool] = None, images=None) -> RunShapes:
    """The run of `config` and `inputs` (`jaxppo.run.parts.Inputs`: the policy and the other
    models as checkpoint directories or `(Model, params)` pairs; LoRA; no tokenizer or
    prompts needed) as shapes on `devices`. `host_scores`: rewards computed on the host
    (default: where no reward model is given). `images`: (count, height, width): every
    prompt with `count` images of height x width pixels (a vision-language policy's, as its
    processor resizes them), or None (text prompts)."""
    config = _planned_config(config, devices)
    given = {role: _abstract(getattr(inputs, role)) for role in ROLES}
    pairs = {role: v[1] for role, v in given.items() if isinstance(v, tuple)}
    kept = {}

    def build(traced):
        built = inputs._replace(**{role: (v[0], traced[role]) if role in traced else v for role, v in given.items()})
        models = assemble(config, built, reward_model=built.reward_model)
        _, tx = build_optimizer(config.optimizer, config.run.iterations * config.batch.updates_per_step,
                                critic=config.uses_critic, shared_trunk=config.advantages.shared_trunk)
        train = TrainState.create(apply_fn=models.apply_fn, params=models.params, tx=tx, freeze=models.freeze)
        kept["models"] = models
        return initial_run_state(config, train), models.ref_params, models.reward_params

    run, ref_params, reward_params = jax.eval_shape(build, pairs)
    models = kept["models"]
    eos = models.policy_model.config.eos_token_ids
    stops = tuple(dict.fromkeys(int(t) for s in config.sampling.stop_tokens
                                for t in ((eos or (0,)) if s == "eos" else (s,))))
    spec = rollout_spec(config, models, reward_weight=1.0, token_reward_fn=None, stop_token_ids=stops,
                        stop_strings=None, pad_token_id=stops[0] if stops else 0, common_prefix=0)
    mesh = None
    if config.layout.device_mesh is not None:
        mesh = config.layout.device_mesh if isinstance(config.layout.device_mesh, jax.sharding.Mesh) else \
            sharding.make_mesh(config.layout.device_mesh, devices)
        sharding.check_batch_divides(config, mesh)
    shapes = RunShapes(config, models, spec, run, ref_params, reward_params, mesh, devices[0],
                       models.reward_model is None if host_scores is None else host_scores,
                       None if images is None else planned_images(models.policy_model.config, config, images))
    shapes.run = run.replace(train=shapes.placed(run.train))
    shapes.ref_params, shapes.reward_params = shapes.placed(ref_params), shapes.placed(reward_params)
    return shapes


def image_tokens(model_config, images):
    """(the family's image reader, the grids, the image tokens) of a prompt with `images` =
    (count, height, width); ValueError for a text-only policy or a size the encoder cannot
    take."""
    from jaxppo.models.family import family_of

    count, height, width = images
    if model_config.vision is None or family_of(model_config).images is None:
        raise ValueError(f"images were given to plan, but the policy ({model_config.model_type}) reads text only")
    reader = family_of(model_config).images(model_config, None, None)
    grids = [reader.grid_of(height, width)] * count
    return reader, grids, count * reader.tokens(grids[0])


def planned_images(model_config, config, images):
    """The shapes of a batch's images (an `ImagePrompt` without ids, `batch_size` rows of
    `query_length`) where every prompt has `images` = (count, height, width): ValueError for
    a text-only policy, a size the encoder cannot take, or image tokens that leave no room
    in `query_length`."""
    count, height, width = images
    reader, grids, tokens = image_tokens(model_config, images)
    q = config.data.query_length
    if tokens >= q:
        raise ValueError(f"{count} image(s) of {height} x {width} pixels are {tokens} image tokens, which leave no room "
                         f"in DataConfig.query_length={q} (--query-length): raise it above {tokens}")
    return reader.abstract(config.batch.batch_size, q, reader.shape([grids]))


def _key(shapes: RunShapes):
    return shapes.replicated(jax.eval_shape(lambda: jax.random.key(0)))


def lower_update(shapes: RunShapes):
    """The run's update (`train_step` for its settings, on its mesh), lowered."""
    c = shapes.config
    step = Step(c, shapes.mesh, shapes.run.train if shapes.mesh is not None else None)
    rollout = abstract_rollout(shapes.spec, shapes.run, shapes.ref_params, shapes.reward_params, c.batch.batch_size,
                               c.data.query_length, shapes.host_scores, shapes.mesh, shapes.images)
    if shapes.mesh is None:
        rollout = shapes.rows_placed(rollout)
    return step.lower(shapes.run.train, rollout, _key(shapes))


def _mesh_context(shapes: RunShapes):
    import contextlib

    return jax.set_mesh(shapes.mesh) if shapes.mesh is not None else contextlib.nullcontext()


def lower_score(shapes: RunShapes):
    """The forward pass over a sampled batch (`finish_rollout`), lowered."""
    c = shapes.config
    b, q, r = c.batch.batch_size, c.data.query_length, c.sampling.response_length
    i32, f32 = (lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)), (lambda *s: jax.ShapeDtypeStruct(s, jnp.float32))
    gen = GenerationOutput(i32(b, r), f32(b, r), i32(b, r), f32(b, r) if shapes.spec.reshapes else None)
    rows = shapes.rows_placed((i32(b, q), i32(b, q), gen, f32(b) if shapes.host_scores else None))
    state = shapes.run
    with _mesh_context(shapes):
        ids, mask, gen, host_scores = rows
        return finish_rollout.lower(shapes.spec, state.train.params, shapes.ref_params, shapes.reward_params,
                                    (shapes.queries(ids), mask), gen, host_scores,
                                    Shaping(shapes.replicated(state.kl), shapes.replicated(state.score_moments)))


def lower_generate_program(shapes: RunShapes):
    """The sampler (`generate`: prefill and decode loop) over the batch's prompts, lowered."""
    c, spec = shapes.config, shapes.spec
    b, q = c.batch.batch_size, c.data.query_length
    ids = shapes.rows_placed(jax.ShapeDtypeStruct((b, q), jnp.int32))
    params = spec.policy_params(shapes.run.train.params)
    with _mesh_context(shapes):
        return lower_generate(spec.policy, params, shapes.queries(ids), ids, _key(shapes), spec.sampling,
                              num_generations=spec.num_generations)


LOWER = {"update": lower_update, "score": lower_score, "generate": lower_generate_program}


def lower_programs(shapes: RunShapes, programs=PROGRAMS) -> dict:
    """{program: its `jax.stages.Lowered`} for the run's `programs`."""
    return {name: LOWER[name](shapes) for name in programs}
