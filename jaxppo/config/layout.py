"""The layout (`LayoutConfig`): the settings that change speed and memory, not what is
learned: compute dtypes, scanned layers, rematerialisation, the attention kernel, the prompts
run once, packed sequences, the device mesh and the sampler's devices."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from jaxppo.config.fields import Concern, check_bools, check_counts, setting
from jaxppo.models.context import CONTEXT_ATTENTION
from jaxppo.models.model import DTYPES, REMAT_POLICIES
from jaxppo.models.transformer import ATTENTION
from jaxppo.sharding import MeshConfig, axis_size
from jaxppo.update.checks import invalid, is_int

__all__ = ["LayoutConfig", "AUTO_SCAN_MIN_LAYERS", "MESH_AXES"]

MESH_AXES = ("mesh_data", "mesh_fsdp", "mesh_context", "mesh_tensor")  # the mesh's axis sizes, as settings

# scan_layers="auto" (the default) scans the layers of checkpoints this deep or deeper: an
# unrolled program's compile (and, on XLA:CPU, its load from the compilation cache) grows
# with the depth, a scanned one's does not (SmolLM2-135M, 30 layers, PPO on a 2-core CPU: the
# first iteration 171.5 s unrolled against 74.9 s scanned; docs/benchmarks.md).
AUTO_SCAN_MIN_LAYERS = 16


@dataclasses.dataclass(frozen=True)
class LayoutConfig(Concern):
    """How the run computes: every setting here changes speed and memory, none changes what
    is learned beyond float rounding (the compute dtypes excepted: they are precision, and a
    resumed run must keep them), so the others may change when a run resumes.

    Attributes:
      dtype: the compute dtype of models loaded from paths: "float32", "bfloat16" or
        "float16". Trained models keep float32 master parameters and optimizer states; the
        log-softmax is computed in float32.
      ref_dtype, reward_dtype: the compute and storage dtype of the frozen reference and
        reward model; None: `dtype` ("bfloat16" halves their memory).
      scan_layers: the blocks as one scan over layer-stacked parameters (compile time no
        longer grows with depth) or unrolled: True or False; "auto" (the default): the
        layout of the run being resumed, else scanned for a checkpoint of
        `AUTO_SCAN_MIN_LAYERS` (16) layers or more, as given for a `(Model, params)` pair;
        None: as loaded or given.
      remat: rematerialise the trained models' blocks in the backward pass: False, True
        (or "full") or a `jax.checkpoint_policies` name; None keeps each model's own.
      logits_chunk_size: apply the LM head this many response positions at a time (each
        chunk's logits recomputed in the backward pass); None: all at once.
      attention: None (each model as given, `Model.attention`), or "einsum", "xla" or
        "cudnn" (cuDNN's flash attention on NVIDIA GPUs, for a bfloat16/float16 `dtype`)
        for every model of the run.
      hoist_layers: with scanned layers, the sampler slices each layer's weights out once
        per call instead of at every decode step: faster sampling for a second copy of the
        weights while sampling.
      share_prompts: with `num_generations` G > 1, each group's prompt runs once for its G
        completions in the forward pass and the loss (the same log-probs, losses and
        gradients up to float rounding, for Q + G R tokens instead of G (Q + R); built-in
        models). None (the default): the trainer turns it on; `train_step` on a rollout you
        build runs every row. True: your rollout's groups share their prompt. False:
        every row.
      common_prefix: the prompts' common prefix (a chat template's system prompt) runs once
        per micro-batch in the forward pass, the sampler's prefill and the loss
        (`jaxppo.update.prefix`). None (the default): on where it pays (single-turn, one
        completion per prompt, the prompts sharing at least 16 tokens and an eighth of a
        row, no packing, no mesh); True: on (refused where the layout cannot be built);
        False: off. `train_step` reads None as False.
      pack_sequences: the loss's forward runs each micro-batch's rows packed into
        `pack_streams` streams of `pack_length` tokens instead of the padded batch
        (`jaxppo.update.packing`; built-in models).
      pack_streams: streams per micro-batch, in [1, micro_batch_size]; None: the trainer
        chooses per iteration (the fewest every micro-batch fits in).
      pack_length: tokens per stream, >= the padded width; None: that width.
      mesh_data, mesh_fsdp, mesh_context, mesh_tensor: the device mesh's axis sizes; all
        None (the default): one device. With any set the run shards over a mesh of axes
        ("data", "fsdp", "context", "tensor"): parameters and optimizer states sharded
        over fsdp, context and tensor, rollout rows split over data and fsdp, and each
        row's positions split over context in the update and the scoring pass (long
        rows: `jaxppo.models.context`; the rows' length, query_length +
        response_length, must divide by it); an axis left None takes what the others
        leave (fsdp first; context and tensor None are 1). Flags and `--config` keys
        like the rest.
      context_attention: how attention runs across the context axis: "ring", "ulysses"
        or "auto" (`jaxppo.models.Model.context_attention`); None: each model's own.
      mesh: the mesh as an object instead of the axes: a `jaxppo.sharding.MeshConfig` or a
        `jax.sharding.Mesh` with those axes (not a flag; not with the axes).
        `device_mesh` is the one a run uses, from either.
      sampler_devices: 0 (the sampler shares the trainer's devices) or n >= 1: the last n
        devices sample on a mesh of their own, the others train (needs max_staleness >= 1).
    """

    # The dtypes are compared on resume through the models' description (the run settings'
    # "policy", "reference", "reward" entries), as they were before they were settings.
    dtype: str = setting("float32", free=True)
    ref_dtype: Optional[str] = setting(None, free=True)
    reward_dtype: Optional[str] = setting(None, free=True)
    scan_layers: Union[bool, str, None] = setting("auto", free=True)
    remat: Union[bool, str, None] = setting(None, free=True)
    logits_chunk_size: Optional[int] = setting(None, free=True)
    attention: Optional[str] = setting(None, free=True)
    hoist_layers: bool = setting(False, free=True)
    share_prompts: Optional[bool] = setting(None, free=True)
    common_prefix: Optional[bool] = setting(None, free=True)
    pack_sequences: bool = setting(False, free=True)
    pack_streams: Optional[int] = setting(None, free=True)
    pack_length: Optional[int] = setting(None, free=True)
    mesh_data: Optional[int] = setting(None, free=True)
    mesh_fsdp: Optional[int] = setting(None, free=True)
    mesh_context: Optional[int] = setting(None, free=True)
    mesh_tensor: Optional[int] = setting(None, free=True)
    context_attention: Optional[str] = setting(None, free=True)
    mesh: Any = setting(None, free=True, flag=False)
    sampler_devices: int = setting(0, free=True)

    def __post_init__(self):
        for name in ("dtype", "ref_dtype", "reward_dtype"):
            value = getattr(self, name)
            if (value is not None or name == "dtype") and value not in DTYPES:
                raise invalid("LayoutConfig", name, value, ("" if name == "dtype" else "None (dtype's) or ")
                              + "one of " + ", ".join(map(repr, DTYPES)))
        if not (self.scan_layers is None or isinstance(self.scan_layers, bool) or self.scan_layers == "auto"):
            raise ValueError(f"LayoutConfig.scan_layers={self.scan_layers!r} is invalid; valid: True, False, 'auto' "
                             f"(scanned for checkpoints of {AUTO_SCAN_MIN_LAYERS} layers or more) or None (as loaded "
                             "or given)")
        if not (self.remat is None or isinstance(self.remat, bool) or self.remat in ("full",) + REMAT_POLICIES):
            raise ValueError(f"LayoutConfig.remat={self.remat!r} is invalid; valid: None (each model's own), False, "
                             f"True (or 'full'), or a policy name: {', '.join(REMAT_POLICIES)}")
        if self.logits_chunk_size is not None:
            check_counts(self, ("logits_chunk_size",))
        if self.attention is not None and self.attention not in ATTENTION:
            raise ValueError(f"LayoutConfig.attention={self.attention!r} is invalid; valid: None (each model as "
                             f"given), {', '.join(map(repr, ATTENTION))}")
        if self.context_attention is not None and self.context_attention not in CONTEXT_ATTENTION:
            raise invalid("LayoutConfig", "context_attention", self.context_attention,
                          "None (each model's own) or one of " + ", ".join(map(repr, CONTEXT_ATTENTION)))
        check_bools(self, ("hoist_layers", "pack_sequences"))
        for name in ("share_prompts", "common_prefix"):  # a bool itself: 1 == True, but the loss reads `is True`
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise invalid("LayoutConfig", name, getattr(self, name), "None (the trainer decides), True or False")
        if self.common_prefix is True and self.pack_sequences:
            raise invalid("LayoutConfig", "common_prefix", self.common_prefix,
                          "False with pack_sequences=True (packing packs whole rows instead); or turn packing off")
        for name, what in (("pack_streams", "streams per micro-batch"), ("pack_length", "tokens per stream")):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value <= 0):
                raise invalid("LayoutConfig", name, value, f"None or a positive int ({what})")
            if value is not None and not self.pack_sequences:
                raise invalid("LayoutConfig", name, value, "None unless pack_sequences=True (it sizes the packed "
                              "streams)")
        check_counts(self, ("sampler_devices",), least=0)
        axes = {name: getattr(self, name) for name in MESH_AXES}
        for name, size in axes.items():
            if size is not None and (not is_int(size) or size < 1):
                raise invalid("LayoutConfig", name, size, "None or a positive int (devices on that axis)")
        if self.mesh is not None and any(size is not None for size in axes.values()):
            raise ValueError(f"LayoutConfig: give the mesh as mesh={self.mesh!r} or as its axes ("
                             + ", ".join(f"{k}={v}" for k, v in axes.items() if v is not None) + "), not both")

    @property
    def device_mesh(self):
        """The mesh the run shards over: `mesh`, or a `jaxppo.sharding.MeshConfig` of the
        axes `mesh_data`, `mesh_fsdp`, `mesh_context`, `mesh_tensor` when any is set; None
        for one device."""
        if self.mesh is not None or all(getattr(self, name) is None for name in MESH_AXES):
            return self.mesh
        return MeshConfig(data=self.mesh_data, fsdp=self.mesh_fsdp,
                          tensor=1 if self.mesh_tensor is None else self.mesh_tensor,
                          context=1 if self.mesh_context is None else self.mesh_context)

    @property
    def context_size(self) -> int:
        """The context axis's size (1 without one; a given `jax.sharding.Mesh`'s "context")."""
        mesh = self.device_mesh
        if mesh is None:
            return 1
        if isinstance(mesh, MeshConfig):
            return 1 if mesh.context is None else mesh.context
        return axis_size(mesh, "context")
