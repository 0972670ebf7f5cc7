"""The mini-batch loop of the update, model-agnostic: permute, split, scan, one optax update
per mini-batch (0.4's `jaxppo.update.engine`; "engine" now names only the rollout engines).

`update_epochs` works on any pytree batch whose leaves lead with `config.batch_size` and any
`loss_fn(params, minibatch) -> (loss, aux)`. Its whole loop is one compiled program:

    keys = split(key, ppo_epochs)
    lax.scan over epochs:
        idx = permutation(key_e, batch_size).reshape(num_minibatches, mini_batch_size)
        lax.scan over idx:                              # one optax update per row of idx
            minibatch = batch[idx_row]                  # gathered inside the body
            grads = mean over micro-batches (inner lax.scan when accumulating)
            state = state.apply_gradients(grads)        # unless stopped or non-finite

Nothing here knows about language models.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Tuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax

from jaxppo.update.checks import check_sizes, divisors, invalid, is_int, layer_config

__all__ = ["BatchConfig", "batch_config", "TrainState", "Freeze", "update_epochs", "update_epochs_fn",
           "minibatch_indices", "GroupOrder", "clip_by_global_norm", "global_norm", "check_sizes", "loop_config"]



class BatchSizes:
    """The sizes derived from `batch_size`, `mini_batch_size`, `ppo_epochs` and
    `gradient_accumulation_steps` (`BatchConfig`'s)."""

    @property
    def num_minibatches(self) -> int:
        """Optimizer updates per epoch: `batch_size // mini_batch_size`."""
        return self.batch_size // self.mini_batch_size

    @property
    def micro_batch_size(self) -> int:
        """Rows per gradient computation: `mini_batch_size // gradient_accumulation_steps`."""
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates planned per call: `ppo_epochs * num_minibatches`."""
        return self.ppo_epochs * self.num_minibatches


@dataclasses.dataclass(frozen=True)
class BatchConfig(BatchSizes):
    """The batch and how the update walks it: the settings of the mini-batch loop
    (`update_epochs`), and the sizes of `jaxppo.Config` (its `batch`). A static argument of
    the compiled loop. All counts are rows of the rollout, global over all devices.

    Attributes:
      batch_size: rows collected per PPO iteration (one rollout): completions.
      mini_batch_size: rows per optimizer update; `batch_size % mini_batch_size == 0`.
      ppo_epochs: passes over the rollout per iteration, each with a fresh permutation.
      gradient_accumulation_steps: micro-batches one mini-batch is split into to cut memory;
        still exactly one optimizer update per mini-batch.
        `mini_batch_size % gradient_accumulation_steps == 0`.
      target_kl: None, or > 0: once a mini-batch's approximate KL (measured before its
        update) exceeds it, that update and every later one of the same call are withheld.
      num_generations: completions per prompt (G), in consecutive rows (a prompt's group):
        `batch_size % num_generations == 0`, so each iteration samples `batch_size /
        num_generations` prompts. "grpo", "rloo" and "reinforce_pp_baseline" compare the
        completions of a prompt: they need G >= 2.
      skip_nonfinite_updates: withhold an update whose loss or gradient is not finite (counted in
        `TrainState.skipped_nonfinite`). False drops the check and its branch: every update
        applies (cheaper under `vmap`, where a branch on a batched predicate computes both
        sides); the `Trainer` refuses False.
    """

    batch_size: int = 64
    mini_batch_size: int = 16
    ppo_epochs: int = 4
    gradient_accumulation_steps: int = 1
    target_kl: Optional[float] = None
    num_generations: int = 1
    skip_nonfinite_updates: bool = dataclasses.field(default=True, metadata={"flag": False})

    def __post_init__(self):
        check_sizes("BatchConfig", self.batch_size, self.mini_batch_size, self.ppo_epochs,
                    self.gradient_accumulation_steps)
        g = self.num_generations
        if not is_int(g) or g < 1:
            raise invalid("BatchConfig", "num_generations", g, "a positive int (completions per prompt)")
        if self.batch_size % g:
            raise ValueError(f"BatchConfig.batch_size={self.batch_size} is not a multiple of BatchConfig.num_generations="
                             f"{g}: batch_size counts completions, num_generations of them per prompt. Valid "
                             f"num_generations values for this batch_size: {divisors(self.batch_size)}.")
        kl = self.target_kl
        if kl is not None and (isinstance(kl, bool) or not isinstance(kl, (int, float)) or not 0 < kl < float("inf")):
            raise ValueError(f"BatchConfig.target_kl={kl!r} is invalid: target_kl must be None (no early stopping) "
                             "or a finite real number > 0.")
        if not isinstance(self.skip_nonfinite_updates, bool):
            raise ValueError(f"BatchConfig.skip_nonfinite_updates={self.skip_nonfinite_updates!r} is invalid: "
                             "skip_nonfinite_updates must be a bool (True or False).")

    def replace(self, **changes) -> "BatchConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple:
        """The names of its settings."""
        return tuple(f.name for f in dataclasses.fields(cls))


def batch_config(config) -> BatchConfig:
    """The `BatchConfig` of `config`: itself, or its `.batch` (a `jaxppo.Config`'s)."""
    return layer_config(config, BatchConfig, "batch", "jaxppo.BatchConfig")


def EngineConfig(batch_size, mini_batch_size, ppo_epochs=1, gradient_accumulation_steps=1, target_kl=None,  # noqa: N802
                 skip_nonfinite=True, owner=None) -> BatchConfig:
    """Deprecated since 0.5 (removed in 0.6): `jaxppo.BatchConfig` (the same fields, and
    `ppo_epochs` defaulting to 4 there; `skip_nonfinite` is `skip_nonfinite_updates`)."""
    import warnings

    warnings.warn("jaxppo.EngineConfig is deprecated since 0.5 and will be removed in 0.6: use jaxppo.BatchConfig "
                  "(the same fields; its ppo_epochs defaults to 4, give ppo_epochs=1 for the old default)",
                  DeprecationWarning, stacklevel=2)
    del owner
    return BatchConfig(batch_size, mini_batch_size, ppo_epochs, gradient_accumulation_steps, target_kl,
                       skip_nonfinite_updates=skip_nonfinite)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Clip updates to a global norm of at most `max_norm`, as `optax.clip_by_global_norm`
    does, but as one scalar factor (1 when the norm is below `max_norm`, else
    `max_norm / norm`) multiplied into every leaf.

    Below the threshold the updates are bit-identical to optax's; above it they agree to
    float rounding (`t * (m / n)` against `(t / n) * m`). The point is memory: optax's
    per-leaf select makes XLA materialise a clipped copy of the whole gradient inside the
    engine's update branch (one more gradient-sized buffer; measured by
    `benchmarks/engine_memory.py`), while a scalar factor fuses into the optimizer's own
    update. The trainer's optimizer uses this."""

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * scale.astype(t.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def key_names(path) -> Tuple[str, ...]:
    """A pytree key path (`jax.tree_util` keys: dict keys, attributes, sequence indices) as
    a tuple of str."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class Freeze:
    """Which parameters a `TrainState` does not train: every leaf whose key path starts with
    one of `prefixes`, except those under one of `unless` (paths as tuples of dict keys).

    Frozen leaves get no gradient (the loss is differentiated with respect to the trained
    leaves only, so XLA computes nothing for the others), no optimizer state, and are
    never written. Example, LoRA adapters on a built-in model (`{"params": base, "lora":
    adapters}`) with a value head on the same trunk:
    `Freeze(prefixes=(("params",),), unless=(("params", "value_head"),))`. Hashable (a
    static part of the state)."""

    prefixes: Tuple[Tuple[str, ...], ...]
    unless: Tuple[Tuple[str, ...], ...] = ()

    def __post_init__(self):
        for field in ("prefixes", "unless"):
            value = getattr(self, field)
            if isinstance(value, (str, bytes)) or not all(isinstance(p, tuple) and all(isinstance(k, str) for k in p)
                                                         for p in value):
                raise ValueError(f"Freeze.{field}={value!r} is invalid; give a tuple of key paths, each a tuple of "
                                 "str, e.g. (('params',),)")
            object.__setattr__(self, field, tuple(value))

    def is_frozen(self, path) -> bool:
        names = key_names(path)
        under = lambda prefix: names[: len(prefix)] == prefix
        return any(map(under, self.prefixes)) and not any(map(under, self.unless))

    def trained(self, params):
        """`params` with every frozen leaf replaced by None (an empty subtree)."""
        return jax.tree_util.tree_map_with_path(lambda p, x: None if self.is_frozen(p) else x, params)

    def join(self, trained, params):
        """The full tree: the leaves of `trained` (as `trained(params)` shapes it) where they
        are trained, `params`'s own where frozen."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        new = iter(jax.tree.leaves(trained))
        leaves = [x if self.is_frozen(p) else next(new) for p, x in flat]
        return treedef.unflatten(leaves)


class TrainState(flax.struct.PyTreeNode):
    """Parameters, optimizer state and the count of optimizer updates actually applied.

    Attributes:
      step: int32 scalar, optimizer updates applied so far (skipped updates do not count).
      skipped_nonfinite: int32 scalar, updates skipped because the loss or a gradient was
        not finite (parameters and optimizer state were left untouched).
      params: the parameters (any pytree).
      opt_state: the optax state of `tx`.
      apply_fn: static, the model's pure forward function (used by `train_step`).
      tx: static, the optax `GradientTransformation` (of the trained params).
      freeze: static, a `Freeze` naming params that are not trained, or None (all are).
    """

    step: jax.Array
    skipped_nonfinite: jax.Array
    params: Any
    opt_state: Any
    apply_fn: Callable = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    freeze: Optional[Freeze] = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, *, apply_fn: Callable, params, tx: optax.GradientTransformation,
               freeze: Optional[Freeze] = None) -> "TrainState":
        """A fresh state: `tx.init` of the trained params, zero updates applied."""
        if freeze is not None and not isinstance(freeze, Freeze):
            raise TypeError(f"freeze must be a jaxppo.Freeze or None, got {type(freeze).__name__}")
        trained = params if freeze is None else freeze.trained(params)
        if freeze is not None and not jax.tree.leaves(trained):
            raise ValueError(f"{freeze} freezes every parameter: nothing would be trained")
        return cls(
            step=jnp.zeros((), jnp.int32),
            skipped_nonfinite=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=_init_optimizer(tx, trained),
            apply_fn=apply_fn,
            tx=tx,
            freeze=freeze,
        )

    def trained_params(self):
        """The params that are trained (frozen leaves None; all of them without `freeze`)."""
        return self.params if self.freeze is None else self.freeze.trained(self.params)

    def with_trained(self, trained) -> "TrainState":
        """This state with the trained params replaced (frozen ones kept)."""
        return self.replace(params=trained if self.freeze is None else self.freeze.join(trained, self.params))

    def apply_gradients(self, grads) -> "TrainState":
        """One optax update with `grads` (of the trained params: `trained_params()`'s
        structure); `step` advances by one."""
        trained = self.trained_params()
        updates, opt_state = self.tx.update(grads, self.opt_state, trained)
        state = self.with_trained(optax.apply_updates(trained, updates))
        return state.replace(step=self.step + 1, opt_state=opt_state)


def _init_optimizer(tx: optax.GradientTransformation, trained):
    """`tx.init(trained)`; for concrete parameters on one device as one compiled program (op
    by op, every distinct leaf shape's zeros compile on their own), else op by op: under the
    caller's transformation (`jit`, `vmap`, `eval_shape`, `scan`: the leaves are tracers,
    whose sharding cannot be read, and the caller's program holds the init anyway), or where
    each leaf's state follows its parameter's sharding."""
    leaves = jax.tree.leaves(trained)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return tx.init(trained)
    if all(isinstance(x, jax.Array) and len(x.sharding.device_set) == 1 for x in leaves):
        return jax.jit(tx.init)(trained)
    return tx.init(trained)


def minibatch_indices(key, config: BatchConfig, group: int = 1):
    """Row indices of each mini-batch of each epoch: int32 (ppo_epochs, num_minibatches, mini_batch_size).

    Epoch e permutes `range(batch_size)` with the e-th key of `jax.random.split(key,
    ppo_epochs)` and reshapes the permutation; every row appears exactly once per epoch.
    With `group` G > 1 (rows in groups of G consecutive rows, such as a prompt's
    completions), epoch e permutes the batch_size / G groups with its key instead and keeps
    each group's rows together and in order, so every mini-batch (and, when G divides it,
    every micro-batch) holds whole groups; G must divide mini_batch_size.
    """
    config = batch_config(config)
    keys = jax.random.split(key, config.ppo_epochs)
    if group == 1:
        perms = jax.vmap(lambda k: jax.random.permutation(k, config.batch_size))(keys)
    else:
        if not isinstance(group, int) or group < 1 or config.mini_batch_size % group:
            raise ValueError(f"minibatch_indices: group={group!r} must be a positive int dividing "
                             f"BatchConfig.mini_batch_size={config.mini_batch_size}")
        groups = jax.vmap(lambda k: jax.random.permutation(k, config.batch_size // group))(keys)
        perms = groups[..., None] * group + jnp.arange(group)
    return perms.reshape(config.ppo_epochs, config.num_minibatches, config.mini_batch_size).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class GroupOrder:
    """A mini-batch order (`update_epochs_fn(..., order=...)`) that shuffles groups of
    `group` consecutive rows and keeps each group whole (`minibatch_indices(key, config,
    group)`). Hashable, so that equal orders share a compiled program."""

    group: int

    def __call__(self, key, config):
        return minibatch_indices(key, config, self.group)


def global_norm(tree):
    """The L2 norm of every leaf of `tree` together, accumulated in float32 (one norm for
    the engine's `grad_norm` metric and the trainer's clipping)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def grads_and_aux(params, minibatch, loss_fn, weight_fn, config: BatchConfig, key=None):
    """Loss, aux and gradients of one mini-batch, accumulated over micro-batches if asked.
    With a `key`, the loss is `loss_fn(params, micro_batch, key_i)`, micro-batch i taking
    the i-th key of `jax.random.split(key, gradient_accumulation_steps)` (the key itself
    without accumulation).

    Without a `weight_fn`, micro-batches count equally (the mean of their losses, which
    equals the whole mini-batch's loss when `loss_fn` is a mean over rows). With a
    `weight_fn(micro_batch) -> scalar` (for example its count of real tokens), micro-batch
    i counts w_i / sum(w): for a loss that is a masked mean over tokens this is exactly the
    loss of the whole mini-batch.
    """
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    grad_fn = value_and_grad if key is None else lambda p, mb_and_key: value_and_grad(p, *mb_and_key)
    k = config.gradient_accumulation_steps
    if k == 1:
        (loss, aux), grads = grad_fn(params, minibatch if key is None else (minibatch, key))
        return loss, aux, grads

    micro = jax.tree.map(lambda x: x.reshape((k, config.micro_batch_size) + x.shape[1:]), minibatch)
    if weight_fn is None:
        weights = jnp.full((k,), 1.0 / k, jnp.float32)
    else:
        raw = jax.vmap(weight_fn)(micro).astype(jnp.float32)
        chex.assert_shape(raw, (k,), custom_message="weight_fn must return a scalar per micro-batch")
        total = jnp.sum(raw)
        # All-zero weights (e.g. no real tokens anywhere): fall back to equal weights.
        weights = jnp.where(total > 0, raw / jnp.where(total > 0, total, 1.0), 1.0 / k)

    if key is not None:  # each micro-batch with its own key
        micro = (micro, jax.random.split(key, k))
    (loss0, aux0), grads0 = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro))
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)

    def accumulate(carry, inputs):
        mb, w = inputs
        (loss, aux), grads = grad_fn(params, mb)
        scale = lambda acc, x: acc + (w * x).astype(acc.dtype)
        loss_acc, aux_acc, grads_acc = carry
        return (scale(loss_acc, loss), jax.tree.map(scale, aux_acc, aux), jax.tree.map(scale, grads_acc, grads)), None

    (loss, aux, grads), _ = jax.lax.scan(accumulate, (zeros(loss0), zeros(aux0), zeros(grads0)), (micro, weights))
    return loss, aux, grads


def _approxkl(aux, approxkl_key: str, config: BatchConfig):
    if not isinstance(aux, dict) or approxkl_key not in aux:
        raise ValueError(
            f"BatchConfig.target_kl={config.target_kl} needs loss_fn's aux to be a dict with an "
            f"{approxkl_key!r} entry (the mini-batch's approximate KL, measured before its "
            f"update); aux given: {jax.tree.map(jnp.shape, aux)}"
        )
    kl = aux[approxkl_key]
    chex.assert_shape(kl, (), custom_message=f"aux[{approxkl_key!r}] must be a scalar")
    return kl


def _check_batch(batch, config: BatchConfig):
    """Trace-time checks of `update_epochs_fn`'s arguments."""
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch is an empty pytree: it needs at least one array leading with batch_size")
    chex.assert_tree_shape_prefix(
        batch,
        (config.batch_size,),
        custom_message=(
            f"every leaf of the batch must lead with BatchConfig.batch_size={config.batch_size} "
            f"(rows of one rollout); shapes given: {jax.tree.map(jnp.shape, batch)}"
        ),
    )


def minibatch_update(state, minibatch, stopped, loss_fn: Callable, config: BatchConfig, *,
                     weight_fn: Optional[Callable] = None, approxkl_key: str = "approxkl", key=None):
    """One optimizer update on one mini-batch: gradients of `loss_fn` (accumulated over
    micro-batches), then the update unless it is withheld. `stopped` (the KL stop had
    triggered before this mini-batch; always False without target_kl): no gradient is
    computed, nothing is applied, float metrics are NaN. With a `key`, the loss takes it
    (`loss_fn(params, minibatch, key)`). Returns (state, metrics) as one row of
    `update_epochs_fn`'s metrics.

    `state` is any train state with `params`, `step` and `apply_gradients(grads=...)` (a
    `jaxppo.TrainState`, flax's `TrainState`, ...); a `freeze` (`Freeze`) and a
    `skipped_nonfinite` counter are used where the state has them."""
    early_stop = config.target_kl is not None
    freeze = getattr(state, "freeze", None)
    # Gradients of the trained params only: frozen ones enter the loss as constants.
    trained_loss = loss_fn if freeze is None else (
        lambda trained, *mb: loss_fn(freeze.join(trained, state.params), *mb))
    trained = state.params if freeze is None else freeze.trained(state.params)
    grad_fn = lambda mb: grads_and_aux(trained, mb, trained_loss, weight_fn, config, key)
    if early_stop:
        shapes = jax.eval_shape(grad_fn, minibatch)

        def skipped(mb):
            fill = lambda s: jnp.full(s.shape, jnp.nan if jnp.issubdtype(s.dtype, jnp.inexact) else 0, s.dtype)
            loss, aux, grads = shapes
            return fill(loss), jax.tree.map(fill, aux), jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), grads)

        # A branch on the gradient only: the train state goes through one branch below
        # (a second, nested branch over the state would copy it).
        loss, aux, grads = jax.lax.cond(stopped, skipped, grad_fn, minibatch)
    else:
        loss, aux, grads = grad_fn(minibatch)
    norm = global_norm(grads)
    if config.skip_nonfinite_updates:
        # The gradient is finite iff its norm is (a NaN or inf anywhere reaches the sum of
        # squares): one check on a number the metrics compute anyway, instead of one per
        # leaf. (A norm past float32's range, ~1.8e19, counts as non-finite too.)
        finite = (jnp.isfinite(loss) & jnp.isfinite(norm)) | stopped
    else:  # every update applies: no check, and no branch over the state below
        finite = jnp.array(True)
    grad_norm = jnp.where(stopped, jnp.nan, norm)
    if early_stop:
        # The KL is measured before this update: once it is past the target, this
        # update is withheld too, and so is every later one of this call.
        kl_exceeded = stopped | (_approxkl(aux, approxkl_key, config) > config.target_kl)
    else:
        kl_exceeded = jnp.array(False)
    apply = finite & ~kl_exceeded
    # A withheld update (non-finite, or past the KL target) leaves parameters and
    # optimizer state untouched.
    if config.skip_nonfinite_updates or early_stop:
        new_state = apply_or_keep(state, grads, apply)
    else:
        new_state = state.apply_gradients(grads=grads)
    if config.skip_nonfinite_updates and hasattr(state, "skipped_nonfinite"):
        new_state = new_state.replace(skipped_nonfinite=state.skipped_nonfinite + (~finite).astype(jnp.int32))
    metrics = {"loss": loss, "grad_norm": grad_norm, "applied": apply, "nonfinite": ~finite, "aux": aux}
    if early_stop:
        metrics["early_stopped"] = kl_exceeded
    return new_state, metrics


def apply_or_keep(state, grads, apply, form: Optional[str] = None):
    """`state.apply_gradients(grads=grads)` where the scalar bool `apply` holds, `state`
    unchanged where it does not, in the form that lets the compiler update the state in
    place (`form`: "branch" or "select"; default the compile target's own).

    XLA:CPU ("branch"): a `lax.cond` around the update; a select of new against old there
    keeps both states alive (14-20% more temporaries in `tests/test_plan_targets.py`'s
    2-layer update). XLA:GPU and TPU ("select"): a select per leaf, which fuses into the
    optimizer's own elementwise update, so each leaf is read and written in place; a
    branch there makes XLA:GPU copy the whole carried state into the conditional's
    results (compiled for an H200, that layout's update held 0.8 GiB of temporaries that
    no micro-batch size moved; with the select, 0.02 GiB). Chosen per compile target
    (`jax.lax.platform_dependent`), so a program compiled ahead of time for a GPU or TPU
    on a CPU host gets the target's form. Both forms give the same numbers: the update is
    computed from the same inputs, only what is kept differs."""

    def branch(state):
        return jax.lax.cond(apply, lambda s: s.apply_gradients(grads=grads), lambda s: s, state)

    def select(state):
        new = state.apply_gradients(grads=grads)
        return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, state)

    if form is not None:
        if form not in ("branch", "select"):
            raise ValueError(f"apply_or_keep: form={form!r} is invalid: 'branch', 'select' or None (the target's)")
        return (branch if form == "branch" else select)(state)
    return jax.lax.platform_dependent(state, cpu=branch, default=select)


def update_epochs_fn(state: TrainState, batch, key, loss_fn: Callable, config: BatchConfig, *,
                     weight_fn: Optional[Callable] = None, approxkl_key: str = "approxkl", minibatch_sharding=None,
                     order: Optional[Callable] = None, loss_key: bool = False):
    """`ppo_epochs` passes of shuffled mini-batch updates over `batch`, compiled as one program.

    Args:
      state: a `TrainState`.
      batch: any pytree whose leaves all lead with `config.batch_size`.
      key: PRNG key; epoch e permutes the rows with the e-th key of `split(key, ppo_epochs)`.
      loss_fn: `loss_fn(params, minibatch) -> (loss, aux)`, pure; `loss` a scalar, `aux`
        any pytree of arrays (scalars are typical). Static: pass the same function object
        on every call, or each call compiles again.
      config: a `BatchConfig`, or a config that has one as `.batch` (`jaxppo.Config`):
        sizes, epochs, `gradient_accumulation_steps`, `target_kl`, `skip_nonfinite_updates`. Only
        the `BatchConfig` is static, so a setting the loop never reads does not retrace it.
      weight_fn: optional `weight_fn(micro_batch) -> scalar` weighting micro-batches under
        gradient accumulation (e.g. their count of real tokens, so that a masked-mean loss
        accumulates to exactly the whole mini-batch's loss). Static.
      approxkl_key: with `config.target_kl`, the entry of `aux` (a dict) that holds the
        mini-batch's approximate KL measured before its update.
      minibatch_sharding: optional sharding (e.g. rows over a mesh's data axes) applied to
        each gathered mini-batch as a constraint, so that under a mesh every device works on
        its share of the rows. Static.
      order: the mini-batch order, `order(key, config) -> int32 (ppo_epochs,
        num_minibatches, mini_batch_size)` row indices, each epoch a permutation of the
        rows (only the shape is checked); default `minibatch_indices` (a fresh permutation
        per epoch). `GroupOrder(G)` keeps groups of G rows whole. Static: hashable, the
        same object (or an equal one) on every call.
      loss_key: call `loss_fn(params, minibatch, key)` (dropout, a stochastic loss), each
        mini-batch (micro-batch) its own key from `fold_in(key, 1)`, a stream apart from
        the permutations, which stay as they are without it. Static.

    Returns:
      (state, metrics). `state.step` advances by the number of updates applied: exactly
      `config.updates_per_step` unless updates were skipped (early stop on `target_kl`, or
      a non-finite loss/gradient, which also increments `state.skipped_nonfinite`).
      `metrics` is a dict whose leaves lead with `(ppo_epochs, num_minibatches)`:
        loss, grad_norm: the mini-batch's loss and global gradient norm (before the update);
        applied: bool, whether the update was applied;
        nonfinite: bool, whether it was skipped for a non-finite loss or gradient;
        early_stopped: bool (only with `target_kl`), whether the KL stop had triggered;
        aux: `loss_fn`'s aux (weighted mean over micro-batches when accumulating);
          NaN for mini-batches skipped by the early stop.

    Raises AssertionError (chex, at trace time) if a batch leaf does not lead with
    `batch_size`. `update_epochs` is this function under `jax.jit`.
    """
    config = batch_config(config)
    _check_batch(batch, config)
    early_stop = config.target_kl is not None
    do_update = functools.partial(minibatch_update, loss_fn=loss_fn, config=config, weight_fn=weight_fn,
                                  approxkl_key=approxkl_key)

    def minibatch_step(carry, idx_and_key):
        state, stopped = carry
        idx, mb_key = idx_and_key
        minibatch = _gather(batch, idx, config, minibatch_sharding)
        state, metrics = do_update(state, minibatch, stopped, key=mb_key)
        if early_stop:
            stopped = stopped | metrics["early_stopped"]
        return (state, stopped), metrics

    epoch_step = lambda carry, epoch_indices: jax.lax.scan(minibatch_step, carry, epoch_indices)
    (state, _), metrics = jax.lax.scan(epoch_step, (state, jnp.array(False)), _walk(key, config, order, loss_key))
    chex.assert_tree_shape_prefix(metrics, (config.ppo_epochs, config.num_minibatches))
    return state, metrics


def _walk(key, config: BatchConfig, order, loss_key: bool):
    """What the epoch loop scans: (row indices (ppo_epochs, num_minibatches,
    mini_batch_size), each mini-batch's loss key or None)."""
    indices = (order or minibatch_indices)(key, config)
    chex.assert_shape(indices, (config.ppo_epochs, config.num_minibatches, config.mini_batch_size),
                      custom_message="order(key, config) must give (ppo_epochs, num_minibatches, mini_batch_size) rows")
    if not loss_key:
        return indices.astype(jnp.int32), None
    # One key per mini-batch, from a stream apart from the permutations'.
    return indices.astype(jnp.int32), jax.random.split(jax.random.fold_in(key, 1),
                                                       (config.ppo_epochs, config.num_minibatches))


def _gather(batch, idx, config: BatchConfig, sharding):
    """The mini-batch of rows `idx`, constrained to `sharding` when given."""
    minibatch = jax.tree.map(lambda x: jnp.take(x, idx, axis=0), batch)
    chex.assert_tree_shape_prefix(minibatch, (config.mini_batch_size,))
    return minibatch if sharding is None else jax.lax.with_sharding_constraint(minibatch, sharding)


update_epochs_jit = jax.jit(
    update_epochs_fn,
    static_argnames=("loss_fn", "config", "weight_fn", "approxkl_key", "minibatch_sharding", "order", "loss_key"),
)  # the jitted object; `_cache_size()` counts its compiles


@functools.wraps(update_epochs_fn)
def update_epochs(state, batch, key, loss_fn: Callable, config, **options):
    """`update_epochs_fn` under `jax.jit`, compiled once per `BatchConfig` (a `jaxppo.Config`
    is reduced to its `.batch` first, `loop_config`), loss function, options and shapes."""
    return update_epochs_jit(state, batch, key, loss_fn, loop_config(config), **options)


update_epochs.lower = lambda state, batch, key, loss_fn, config, **options: update_epochs_jit.lower(
    state, batch, key, loss_fn, loop_config(config), **options)


def loop_config(config) -> BatchConfig:
    """The `BatchConfig` the loop compiles for: `config`'s (`batch_config`) with
    `num_generations` at 1. The loop never reads the group size (a group-wise order comes as
    `order`), so configs that differ only in it share one compiled loop."""
    batch = batch_config(config)
    return batch if batch.num_generations == 1 else dataclasses.replace(batch, num_generations=1)

