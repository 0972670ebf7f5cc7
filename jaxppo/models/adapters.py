"""Adapters in a model's variables: add fresh LoRA adapters to a model without them, and fold
trained adapters back into the base weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxppo.models.lora import LoraConfig
from jaxppo.models.model import Model

__all__ = ["add_lora", "merge_lora", "check_model"]


def check_model(model):
    """TypeError unless `model` is a built-in `jaxppo.models.Model`."""
    if not isinstance(model, Model):
        raise TypeError(f"expected a jaxppo.models.Model, got {type(model).__name__}")


def add_lora(model, params, lora: LoraConfig, key):
    """(model with `lora`, variables {"params": `params`' params, "lora": fresh adapters})
    from a model without adapters: A random (from `key`), B zero, so the outputs equal the
    base model's exactly."""
    check_model(model)
    if model.lora is not None:
        raise ValueError("the model already has LoRA adapters")
    lora.modules(model.config)  # checks the targets
    lora_model = dataclasses.replace(model, lora=lora, adapters=True)
    shapes = jax.eval_shape(lambda k: lora_model.init(k, seq_len=2), key)
    if jax.tree.structure(shapes["params"]) != jax.tree.structure(params["params"]):
        raise ValueError("params do not fit the model (another layout or architecture)")
    adapters = jax.jit(lambda k: lora_model.init(k, seq_len=2)["lora"])(key)
    return lora_model, {**params, "lora": adapters}


def _merged_kernel(kernel, a, b, scale):
    delta = scale * (np.asarray(a, np.float32) @ np.asarray(b, np.float32))
    return (np.asarray(kernel, np.float32) + delta).astype(np.asarray(kernel).dtype)


def merge_lora(model, variables):
    """(model without adapters, params) with each adapter folded into its kernel:
    W + (alpha / rank) * A @ B, in the base parameters' dtype (on the host)."""
    check_model(model)
    if model.lora is None:
        return model, variables
    base = traverse_util.flatten_dict(jax.device_get(variables["params"]))
    adapters = traverse_util.flatten_dict(jax.device_get(variables["lora"]))
    for path, a in adapters.items():
        if path[-1] != "lora_a":
            continue
        module = path[:-1]
        b = adapters[module + ("lora_b",)]
        kernel = base[module + ("kernel",)]
        if kernel.ndim == 3:  # stacked layers
            base[module + ("kernel",)] = np.stack([_merged_kernel(kernel[i], a[i], b[i], model.lora.scale)
                                                   for i in range(kernel.shape[0])])
        else:
            base[module + ("kernel",)] = _merged_kernel(kernel, a, b, model.lora.scale)
    plain = dataclasses.replace(model, lora=None, adapters=True)
    return plain, {"params": traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in base.items()})}
