"""The parameters' layer layouts: per-layer entries (`layers_0` ... `layers_{n-1}`, as
`Model(scan_layers=False)` has them) and the stacked entry of `Model(scan_layers=True)`
(`stack_layers`, `unstack_layers`), the entry that holds the trunk (`trunk_name`), and the
copy of the matrices in the compute dtype that the samplers decode from
(`matrices_in_compute_dtype`)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.family import family_of

__all__ = ["trunk_name", "layer_prefix", "stack_layers", "unstack_layers", "matrices_in_compute_dtype"]


def layer_prefix(config: ModelConfig) -> str:
    return family_of(config).layers_prefix


def trunk_name(config: ModelConfig) -> str:
    """The params entry holding the trunk: its family's `trunk_name` ("transformer" for
    GPT-2, "model" for the Llama family and Gemma 3)."""
    return family_of(config).trunk_name


def stack_layers(params, config: ModelConfig):
    """Per-layer params (`layers_0` ... `layers_{n-1}`, as `Model(scan_layers=False)` has
    them) -> the stacked layout of `Model(scan_layers=True)` (one `layers` entry whose
    leaves lead with a num_layers axis). Other entries are kept as they are."""
    prefix, trunk = layer_prefix(config), trunk_name(config)
    out = dict(params)
    for collection in _trunk_collections(params, trunk):
        inner = dict(params[collection][trunk])
        names = [f"{prefix}_{i}" for i in range(config.num_layers)]
        missing = [n for n in names if n not in inner]
        if missing or prefix in inner:
            raise ValueError(f"stack_layers needs the per-layer layout ({prefix}_0 ... {prefix}_{config.num_layers - 1}); "
                             f"missing {missing}" + (f", and {prefix!r} is already stacked" if prefix in inner else ""))
        layers = [inner.pop(n) for n in names]
        inner[prefix] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        out[collection] = {**params[collection], trunk: inner}
    return out


def _trunk_collections(variables, trunk):
    """The variable collections ("params", and "lora" for adapters) that hold the trunk."""
    return [k for k, v in variables.items() if isinstance(v, dict) and trunk in v]


def matrices_in_compute_dtype(params, dtype, stacked: Optional[ModelConfig] = None):
    """`params` with every floating leaf of two or more axes (kernels, embeddings, LoRA's
    factors) cast to `dtype` where `dtype` is narrower; the others (biases, norm scales)
    as they are. `stacked`: the config of params in the scanned layout, whose stacked
    layers' leaves carry a leading layer axis, so that there a matrix has three or more
    axes (a stacked norm scale has two, and stays). The layers cast such a matrix to their
    compute dtype at every use, so a sampler given the cast copy computes the same values,
    from half the bytes (float32 weights, bfloat16 compute) and without a conversion per
    weight per decode step: the samplers decode from it (`Model.for_decoding`)."""
    dtype = jnp.dtype(dtype)
    stacked = (trunk_name(stacked), layer_prefix(stacked)) if stacked is not None else None

    def cast(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        layered = stacked is not None and any(tuple(names[i:i + len(stacked)]) == stacked
                                              for i in range(len(names)))
        if (jnp.ndim(x) >= (3 if layered else 2) and jnp.issubdtype(x.dtype, jnp.floating)
                and jnp.dtype(x.dtype).itemsize > dtype.itemsize):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map_with_path(cast, params)


def unstack_layers(params, config: ModelConfig):
    """The inverse of `stack_layers`: stacked `layers` -> `layers_0` ... `layers_{n-1}`."""
    prefix, trunk = layer_prefix(config), trunk_name(config)
    out = dict(params)
    for collection in _trunk_collections(params, trunk):
        inner = dict(params[collection][trunk])
        if prefix not in inner:
            raise ValueError(f"unstack_layers needs the stacked layout (a {prefix!r} entry under {trunk!r})")
        stacked = inner.pop(prefix)
        for i in range(config.num_layers):
            inner[f"{prefix}_{i}"] = jax.tree.map(lambda x: x[i], stacked)
        out[collection] = {**params[collection], trunk: inner}
    return out
