"""The compiled programs of a run's update: the train step for a config (one device or a
mesh; with packed sequences one per stream count, chosen per iteration), and its compile
ahead of time, in a background thread, while the first iteration samples and scores.

    step = train_step_for(config, mesh=mesh, state=run.train)     # a `Step`, or `PackedSteps`
    step = precompile(step, spec, run, ...)                         # `Precompiled` where it can
    state, metrics = step(state, rollout, key)
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import sharding
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.sharding import to_host
from jaxppo.update import packing
from jaxppo.update.batch import RolloutBatch
from jaxppo.update.minibatches import minibatch_indices
from jaxppo.update.ppo import minibatch_group, train_step_donating

__all__ = ["Step", "PackedSteps", "Precompiled", "train_step_for", "abstract_rollout", "precompile"]


class Step:
    """The compiled update of one config: `step(state, rollout, key)`, the old train state's
    buffers donated; `lower(state, rollout, key)` lowers it for ahead-of-time compilation.
    On one device `train_step` with the config bound; on a mesh the sharded step
    (`jaxppo.sharding.sharded_train_step`)."""

    def __init__(self, config, mesh=None, state=None):
        self.config = config
        self.sharded = None if mesh is None else sharding.sharded_train_step(state, config, mesh, donate=True)

    def __call__(self, state, rollout, key):
        if self.sharded is not None:
            return self.sharded(state, rollout, key)
        return train_step_donating(state, rollout, key, config=self.config)

    def lower(self, state, rollout, key):
        if self.sharded is not None:
            return self.sharded.lower(state, rollout, key)
        return train_step_donating.lower(state, rollout, key, config=self.config)


class PackedSteps:
    """The update with packed sequences and the streams chosen per iteration
    (`LayoutConfig.pack_streams` None): from the rollout's row lengths and the update's
    mini-batch permutations (`jaxppo.update.minibatches.minibatch_indices` of the same key),
    the fewest streams every micro-batch fits in, rounded up to 1, 2, 3, 4, 6, 8, 12, ...
    (`jaxppo.update.packing.minibatch_streams`), so that nothing falls back to padding and a
    run compiles for a few stream counts at most. One `Step` per stream count is kept. Adds
    `packing/streams` and `packing/fill` (the share of the streams' slots that hold real
    tokens) to the metrics. Its form depends on the rollout, so it is not compiled ahead."""

    def __init__(self, make_step: Callable, config):
        self.make_step, self.config, self.steps = make_step, config, {}

    def __call__(self, state, rollout: RolloutBatch, key):
        c = self.config
        length = packing.stream_length(rollout, c.layout.pack_length)
        attention = rollout.response_mask if rollout.response_attention_mask is None else rollout.response_attention_mask
        lengths = packing.host_row_lengths(to_host(rollout.query_mask), to_host(attention))
        order = minibatch_indices(key, c, minibatch_group(c))  # the update's own order
        streams = packing.minibatch_streams(lengths, np.asarray(order), c.batch.micro_batch_size, length)
        if streams not in self.steps:
            self.steps[streams] = self.make_step(c.replace(pack_streams=streams))
        state, metrics = self.steps[streams](state, rollout, key)
        slots = c.batch.num_minibatches * c.batch.gradient_accumulation_steps * streams * length
        return state, {**metrics, "packing/streams": streams, "packing/fill": float(lengths.sum()) / slots}


def train_step_for(config, mesh=None, state=None):
    """The run's compiled update for `config`: a `Step` (on `mesh`, whose shardings come
    from `state`, when given), or with packed sequences whose streams are left to the
    trainer, `PackedSteps` choosing them."""
    make = functools.partial(Step, mesh=mesh, state=state)
    if config.layout.pack_sequences and config.layout.pack_streams is None:
        return PackedSteps(make, config)
    return make(config)


class Precompiled:
    """A `Step` compiled ahead of time in a background thread while the first iteration
    samples and scores (XLA compiles without holding Python's lock, so on a machine with
    more than one core the two overlap; the update's compile is the largest of a run's
    start). `args` is what to lower it with (the train state, an abstract rollout from
    `abstract_rollout`, a key), or a function returning them, called in the background
    thread too.

    Calls wait for the compile and run the compiled program. If lowering or compiling fails,
    or the rollout given does not match the one it was compiled for, the call falls back to
    the step itself (which compiles, or raises, as it would have without this)."""

    def __init__(self, step: Step, args):
        self.step, self.compiled = step, None
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxppo-compile")
        self.future = pool.submit(lambda: step.lower(*(args() if callable(args) else args)).compile())
        pool.shutdown(wait=False)

    def __call__(self, state, rollout, key):
        if self.future is not None:
            future, self.future = self.future, None
            try:
                self.compiled = future.result()
            except Exception:  # the plain call below compiles, or raises the same error in this thread
                self.compiled = None
        if self.compiled is not None:
            try:
                with sharding_context(self.step):
                    return self.compiled(state, rollout, key)
            except (TypeError, ValueError):  # inputs unlike the ones compiled for (checked before running)
                self.compiled = None
        return self.step(state, rollout, key)


def sharding_context(step: Step):
    """The mesh in context for a sharded step's compiled program."""
    import contextlib

    mesh = getattr(getattr(step, "sharded", None), "mesh", None)
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def abstract_rollout(spec: RolloutSpec, run, ref_params, reward_params, rows: int, query_width: int,
                     host_scores: bool, mesh=None, images=None) -> RolloutBatch:
    """The shapes and dtypes of the rollout that `jaxppo.run.iteration.build` will produce
    for `rows` rows of prompts `query_width` wide (`jax.eval_shape` of `finish_rollout`:
    nothing runs), with the adaptive entropy coefficient's column where the run has one,
    placed like the rollout on `mesh` (rows split over its data axes). `images`: the
    prompts' images as shapes (an `ImagePrompt` without ids, `TableImages.abstract`), or
    None."""
    from jaxppo.models.decoding import GenerationOutput

    tokens = jax.ShapeDtypeStruct((rows, spec.response_length), jnp.int32)
    logprobs = jax.ShapeDtypeStruct(tokens.shape, jnp.float32)
    gen = GenerationOutput(tokens, logprobs, tokens, logprobs if spec.reshapes else None)
    ids = jax.ShapeDtypeStruct((rows, query_width), jnp.int32)
    queries = ids if images is None else images._replace(ids=ids)
    scores = jax.ShapeDtypeStruct((rows,), jnp.float32) if host_scores else None
    shapes = jax.eval_shape(lambda *a: finish_rollout(spec, *a), run.train.params, ref_params, reward_params,
                            (queries, ids), gen, scores, Shaping(run.kl, run.score_moments))[0]
    if run.entropy_coef is not None:
        shapes = shapes.replace(entropy_coef=jax.ShapeDtypeStruct((rows,), jnp.float32))
    if mesh is not None:
        rows_sharding = sharding.batch_sharding(mesh)
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rows_sharding), shapes)
    return shapes


def precompile(step: Any, spec: RolloutSpec, run, ref_params, reward_params, table, config, host_scores: bool, key,
               mesh=None):
    """`step` as a `Precompiled` (its compile started now), on one device or a mesh, where
    the rollout's form is known before sampling: a `Step` (not `PackedSteps`, whose stream
    count the rollout decides; a `Precompiled` is returned as it is, so this starts one
    compile at most), single-turn (the caller's part); else `step` unchanged."""
    if not isinstance(step, Step):
        return step
    width, rows = table.width, config.batch.batch_size
    images = None if getattr(table, "images", None) is None else table.images.abstract(rows, width)
    return Precompiled(step, lambda: (run.train, abstract_rollout(spec, run, ref_params, reward_params, rows, width,
                                                                  host_scores, mesh, images), key))
