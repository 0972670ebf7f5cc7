"""Meshes and partition rules: the same `train_step` on 1 or N devices, through XLA SPMD.

A mesh has four named axes:
  "data":    pure data parallelism (parameters replicated across it),
  "fsdp":    data parallelism with parameters and optimizer states sharded across it,
  "context": each row's positions split across it (long rows; parameters and optimizer
             states sharded across it as over "fsdp"),
  "tensor":  tensor parallelism inside a layer (column-/row-parallel projections).
Rollout rows are split over ("data", "fsdp"); `batch_size` and `mini_batch_size` stay
global sizes and each device works on `mini_batch_size / (data * fsdp)` rows per update.
No collective is written by hand here: shardings are declared and XLA inserts the rest
(the exceptions: a mixture of experts' layer computes each device's own experts inside a
`jax.shard_map` over "fsdp", `jaxppo.models.moe`; attention across the "context" axis
passes keys and values round it or exchanges heads, `jaxppo.models.context`). A
`jax.sharding.Mesh` without a "context" axis (the three axes of jaxppo 0.4) works as one
whose "context" axis has size 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxppo.update.minibatches import batch_config, key_names
from jaxppo.update.ppo import jit_train_step

__all__ = ["MeshConfig", "mesh_context", "make_mesh", "batch_sharding", "shard_batch", "param_spec", "tree_shardings", "shard_state",
           "sharded_train_step", "global_batch", "place_rows", "check_batch_divides", "initialize_distributed",
           "axis_size", "sampling_mesh",
           "MeshBound", "to_host", "on_process_zero", "gather_to_process_zero"]

AXES = ("data", "fsdp", "context", "tensor")
# Projections split on their output features (column-parallel) or input features
# (row-parallel) along the "tensor" axis. Kernels are (in, out).
_COLUMN_PARALLEL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc", "lm_head"}
_ROW_PARALLEL = {"o_proj", "down_proj", "c_proj", "mlp_c_proj"}
# LoRA adapter leaves (`jaxppo.models.lora`).
_ADAPTERS = {"lora_a", "lora_b"}
# Entries whose leaves lead with a layer axis (`Model(scan_layers=True)`).
_STACKED = {"layers", "h"}


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes; None means "whatever is left": with data and fsdp None (and context and
    tensor at their default 1) every device goes to "fsdp" (data parallel with sharded
    parameters)."""

    data: Optional[int] = None
    fsdp: Optional[int] = None
    tensor: Optional[int] = 1
    context: Optional[int] = 1

    def resolve(self, n_devices: int):
        sizes = {"data": self.data, "fsdp": self.fsdp, "context": self.context, "tensor": self.tensor}
        for name, size in sizes.items():
            if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
                raise ValueError(f"mesh axis {name}={size!r} is invalid: a positive int or None")
        known = int(np.prod([s for s in sizes.values() if s is not None]))
        free = [k for k, s in sizes.items() if s is None]
        if not free:
            if known != n_devices:
                raise ValueError(f"mesh axes data={sizes['data']} x fsdp={sizes['fsdp']} x context={sizes['context']} "
                                 f"x tensor={sizes['tensor']} = {known} devices, but {n_devices} are available; the "
                                 "sizes must multiply to "
                                 f"the device count")
            return sizes
        if n_devices % known:
            raise ValueError(f"mesh axes {sizes} do not divide the {n_devices} devices: the given sizes multiply "
                             f"to {known}, and the axes left as None must take a whole share of the rest")
        # Leftover devices go to fsdp when it is free, else to the first free axis.
        target = "fsdp" if "fsdp" in free else free[0]
        for k in free:
            sizes[k] = n_devices // known if k == target else 1
        return sizes


def mesh_context(mesh):
    """The mesh in context for compiled calls (axis names resolve inside them); nothing
    without one."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A `Mesh` with axes ("data", "fsdp", "context", "tensor") over `devices` (default:
    all); "tensor" varies fastest from device to device, then "context"."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = config.resolve(len(devices))
    grid = np.asarray(devices, dtype=object).reshape(*(sizes[a] for a in AXES))
    return Mesh(grid, AXES)


def axis_size(mesh, name: str) -> int:
    """The size of `mesh`'s axis `name` (a `Mesh` or an abstract mesh); 1 where it has
    none (no mesh, or a mesh without that axis)."""
    if mesh is None or getattr(mesh, "empty", False) or name not in getattr(mesh, "axis_names", ()):
        return 1
    return int(mesh.shape[name])


def sampling_mesh(mesh, rows: int):
    """The mesh a run's samplers place their `rows` on: `mesh` itself, or where it has a
    context axis (which splits positions in the forward passes, not a sampler's rows) and
    the rows divide over all its row-holding devices, the same devices with that axis
    folded into fsdp: each row sampled once, on one device, instead of on every device of
    the context axis. The parameters need not move: a shard over ("fsdp", "context") on
    `mesh` is the same buffer as over "fsdp" on this mesh."""
    context = axis_size(mesh, "context")
    if context == 1 or not set(AXES) <= set(mesh.axis_names) or rows % (_data_size(mesh) * context):
        return mesh
    # The device grid in AXES order (a given `Mesh` may name its axes in another), then
    # context folded into fsdp as its minor part, the order ("fsdp", "context") shards in.
    grid = mesh.devices.transpose([mesh.axis_names.index(a) for a in AXES])
    d, f, _, t = grid.shape
    return Mesh(grid.reshape(d, f * context, 1, t), AXES)


def _data_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def check_batch_divides(config, mesh: Mesh):
    """Raise ValueError unless every per-update row count splits evenly over the data axes
    (`config`: a `jaxppo.Config`, an `UpdateConfig` or a `BatchConfig`)."""
    n = _data_size(mesh)
    config = batch_config(config)
    micro = config.micro_batch_size
    if config.batch_size % n or micro % n:
        raise ValueError(
            f"the mesh splits rows over data x fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']} = {n} devices, "
            f"but BatchConfig.batch_size={config.batch_size}, mini_batch_size={config.mini_batch_size} and the "
            f"micro-batch size {micro} (mini_batch_size / gradient_accumulation_steps) must all be multiples of {n}"
        )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over ("data", "fsdp"); every other dimension replicated."""
    return NamedSharding(mesh, P(("data", "fsdp")))


def shard_batch(tree, mesh: Mesh):
    """Place every leaf (leading dim = rows) with its rows split over the data axes."""
    sharding = batch_sharding(mesh)
    return jax.tree.map(lambda x: jax.device_put(x, sharding), tree)


def param_spec(path: tuple, shape: tuple, mesh: Mesh) -> P:
    """PartitionSpec of a parameter (or of an optimizer-state leaf shaped like one).

    Rules: 2-D kernels of known projections are split on the "tensor" axis (column-parallel
    on the output dim, row-parallel on the input dim) when it divides; then the largest
    remaining dimension that the "fsdp" axis divides is split over "fsdp" (over ("fsdp",
    "context") on a mesh with a context axis, their product dividing it); 1-D and scalar
    leaves, and dimensions nothing divides, are replicated. Stacked layers (`scan_layers`:
    leaves under a `layers` / `h` entry, leading with the layer axis) keep the layer axis
    replicated and split the rest as the per-layer leaf would be split. LoRA adapters
    (`lora_a` (in, rank), `lora_b` (rank, out)) split their non-rank dimension on "tensor"
    as the base kernel does, else over "fsdp"; the rank dimension is whole. A mixture of
    experts' stacked kernels (E, in, out) split the expert axis over "fsdp" and their
    intermediate features over "tensor" (`jaxppo.models.moe`; the expert axis over
    "fsdp" alone, as the experts' `shard_map` reads it).
    """
    names = set(key_names(path))
    if names & _STACKED and len(shape) >= 1:
        return P(None, *param_spec(tuple(k for k, n in zip(path, key_names(path)) if n not in _STACKED), shape[1:], mesh))
    spec = [None] * len(shape)
    if len(shape) < 2:
        return P(*spec)
    tensor, experts_fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
    stored, fsdp = _stored_axes(mesh)
    if names & _ADAPTERS and len(shape) == 2:
        # LoRA A (in, rank) / B (rank, out): the non-rank dimension is split as the base
        # kernel splits it on "tensor" (row-parallel input, column-parallel output), else
        # over "fsdp"; the rank dimension stays whole.
        dim, parallel = (0, _ROW_PARALLEL) if "lora_a" in names else (1, _COLUMN_PARALLEL)
        if tensor > 1 and names & parallel and shape[dim] % tensor == 0:
            spec[dim] = "tensor"
        elif fsdp > 1 and shape[dim] % fsdp == 0:
            spec[dim] = stored
        return P(*spec)
    if "experts" in names and len(shape) == 3:
        # A mixture's stacked experts (E, in, out): the expert axis over "fsdp" (each device
        # stores its share of the experts), the intermediate features over "tensor" as the
        # dense MLP's are (column-parallel gate/up, row-parallel down).
        inner = 2 if names & _COLUMN_PARALLEL else 1
        if tensor > 1 and shape[inner] % tensor == 0:
            spec[inner] = "tensor"
        if experts_fsdp > 1 and shape[0] % experts_fsdp == 0:
            spec[0] = "fsdp"
            return P(*spec)
    elif tensor > 1 and len(shape) == 2:
        dim = 1 if names & _COLUMN_PARALLEL else (0 if names & _ROW_PARALLEL else None)
        if "embedding" in names:
            dim = 1
        if dim is not None and shape[dim] % tensor == 0:
            spec[dim] = "tensor"
    if fsdp > 1:
        candidates = [d for d in np.argsort(shape)[::-1] if spec[d] is None and shape[d] % fsdp == 0]
        if candidates:
            spec[int(candidates[0])] = stored
    return P(*spec)


def _stored_axes(mesh: Mesh):
    """The axes a parameter's largest dimension is split over, and their size: "fsdp", or
    ("fsdp", "context") where the mesh has a context axis (its devices hold a row's
    positions, not rows, but store their share of the state as fsdp's do)."""
    context = axis_size(mesh, "context")
    if context == 1:
        return "fsdp", mesh.shape["fsdp"]
    return ("fsdp", "context"), mesh.shape["fsdp"] * context


def tree_shardings(tree, mesh: Mesh):
    """NamedShardings for every leaf of `tree` (params, optimizer state, a TrainState) by
    `param_spec`; non-array leaves and scalars are replicated."""

    def one(path, leaf):
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, param_spec(path, tuple(shape), mesh))

    return jax.tree_util.tree_map_with_path(one, tree)


def initialize_distributed(**kwargs):
    """`jax.distributed.initialize(**kwargs)` for multi-host runs (TPU pods and multi-node
    GPU jobs discover the coordinator themselves; pass coordinator_address, num_processes
    and process_id otherwise). Call once per process, before anything touches devices."""
    jax.distributed.initialize(**kwargs)
    return jax.process_index(), jax.process_count()


def shard_state(state, mesh: Mesh):
    """Place a `TrainState` (or any params/optimizer pytree) by `tree_shardings`."""
    return jax.device_put(state, tree_shardings(state, mesh))


def sharded_train_step(state, config, mesh: Mesh, *, donate: bool = False):
    """A jitted `train_step(state, rollout, key) -> (state, metrics)` for `mesh`.

    The state keeps the shardings of `tree_shardings` (parameters and optimizer states
    split over "fsdp"/"tensor"), rollout rows are split over ("data", "fsdp"), each
    mini-batch is constrained to the same row split, and metrics come back replicated. The
    update count and the math are those of the single-device `train_step`. `donate=True`
    lets XLA reuse the old state's buffers (the passed state is invalid afterwards).
    """
    check_batch_divides(config, mesh)
    state_sharding = tree_shardings(state, mesh)
    rows = batch_sharding(mesh)
    replicated = NamedSharding(mesh, P())
    return MeshBound(jit_train_step(config, donate=donate, minibatch_sharding=rows,
                                    in_shardings=(state_sharding, rows, replicated),
                                    out_shardings=(state_sharding, replicated)), mesh)


def place_run(mesh, config, run, ref_params, reward_params):
    """A trainer's state on `mesh` (a `MeshConfig` or `Mesh`): (the mesh, the run state with
    its train state sharded, the sharded frozen parameters (None stays None)); the train
    step of a config on that mesh is `sharded_train_step` (`jaxppo.run.compiled.Step`)."""
    mesh = mesh if isinstance(mesh, Mesh) else make_mesh(mesh)
    check_batch_divides(config, mesh)
    run = run.replace(train=shard_state(run.train, mesh))
    ref_params, reward_params = (None if p is None else shard_state(p, mesh) for p in (ref_params, reward_params))
    return mesh, run, ref_params, reward_params


class MeshBound:
    """A jitted function traced and run with `mesh` in context (`jax.set_mesh`), so that code
    inside it (the built-in models' log-prob head) can pin shardings by axis name. Calls
    like the function; `lower(...)` lowers it for ahead-of-time compilation."""

    def __init__(self, jitted, mesh: Mesh):
        self.jitted, self.mesh = jitted, mesh

    def __call__(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)


def global_batch(array, mesh: Mesh):
    """A global array with rows split over the data axes, built from a host numpy array
    that every process holds in full (each process materialises only its own shards), so
    the same code feeds one host or many."""
    array = np.asarray(array)
    sharding = batch_sharding(mesh)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def place_rows(array, mesh=None):
    """A host array of rows on the device: as it is without a mesh, else split over the
    mesh's data axes (`global_batch`)."""
    return jnp.asarray(array) if mesh is None else global_batch(array, mesh)


_MESSAGE_BYTES = 4096
_ERRORS = (ValueError, RuntimeError, ConnectionError, TimeoutError, TypeError, OSError)


def on_process_zero(fn, like=None):
    """`fn()` run by process 0 alone, its result on every process (one process: `fn()`).

    `like` is a pytree of numpy arrays with the shapes and dtypes of `fn`'s result (None:
    `fn` returns nothing to share); the other processes receive process 0's values through
    one broadcast. An exception in `fn` is raised on process 0 and, with the same type
    (among the built-in errors, else RuntimeError) and message, on every other process, so
    that no process is left waiting in a collective the others have left. For the work
    only one process may do: talking to servers, writing a shared file."""
    if jax.process_count() == 1:
        return fn()
    from jax.experimental import multihost_utils

    error, result = None, like
    if jax.process_index() == 0:
        try:
            result = fn()
            if like is not None:
                result = jax.tree.map(lambda r, l: np.asarray(r, l.dtype).reshape(l.shape), result, like)
        except Exception as exc:  # noqa: BLE001 - raised again below, on every process
            error, result = exc, like
    kind = 0 if error is None else 1 + next((i for i, e in enumerate(_ERRORS) if isinstance(error, e)), 1)
    text = b"" if error is None else str(error).encode()[:_MESSAGE_BYTES]
    message = np.frombuffer(text.ljust(_MESSAGE_BYTES, b"\0"), np.uint8)
    kind, message, result = multihost_utils.broadcast_one_to_all((np.int32(kind), message, result))
    if int(kind):
        if error is not None:
            raise error
        text = bytes(np.asarray(message)).rstrip(b"\0").decode(errors="replace")
        raise _ERRORS[int(kind) - 1](f"(on process 0) {text}")
    return None if like is None else jax.tree.map(np.asarray, result)


def gather_to_process_zero(tree):
    """`tree`'s arrays as host numpy arrays on process 0 (global arrays gathered, leaf by
    leaf; every process takes part) and None leaves elsewhere; one process: `tree` as it is."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    def one(leaf):
        value = np.asarray(leaf) if getattr(leaf, "is_fully_addressable", True) else \
            multihost_utils.process_allgather(leaf, tiled=True)
        return value if jax.process_index() == 0 else None

    return jax.tree.map(one, tree)


def to_host(array) -> np.ndarray:
    """A global array as a host numpy array (gathered across processes in multi-host runs)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)
