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
        if not path[-1].endswith("lora_a"):
            continue
        b = adapters[path[:-1] + (path[-1][: -len("lora_a")] + "lora_b",)]
        # A layer's `kernel` beside `lora_a`; a mixture's expert kernel `<name>` beside `<name>_lora_a`.
        where = path[:-1] + (("kernel",) if path[-1] == "lora_a" else (path[-1][: -len("_lora_a")],))
        # Leading axes (stacked layers, experts) are batch axes of the product.
        base[where] = _merged_kernel(base[where], a, b, model.lora.scale)
    plain = dataclasses.replace(model, lora=None, adapters=True)
    return plain, {"params": traverse_util.unflatten_dict({k: jnp.asarray(v) for k, v in base.items()})}
