"""LoRA: low-rank adapters on the built-in models' linear layers, and PEFT's file format.

A `Model` with `lora=LoraConfig(rank, alpha, targets)` computes, in each targeted
projection, `x @ W + b + (alpha / rank) * (x @ A) @ B`, with A (in, rank) drawn at random
and B (rank, out) zero, so that training starts from the base model exactly. Its variables
are `{"params": base, "lora": adapters}`: the adapters are a Flax collection of their own
(`lora_a` / `lora_b` beside each targeted `kernel`, stacked on the layer axis with
`scan_layers`), so the trainer trains them alone (`jaxppo.Freeze` of "params") and the
reference policy is the same variables with `Model(adapters=False)`.

Hugging Face's module names select targets: `q_proj`, `k_proj`, `v_proj`, `o_proj`,
`gate_proj`, `up_proj`, `down_proj` (Llama family, Gemma 3), `c_attn`, `c_proj`, `c_fc`
(GPT-2; `c_proj` is both the attention and the MLP output, as in PEFT), or "all-linear"
(every projection in the blocks; not the LM head).

`save_peft_adapter` writes PEFT's `adapter_config.json` + `adapter_model.safetensors`,
which `peft.PeftModel.from_pretrained(base, dir)` loads onto the base checkpoint;
`load_peft_adapter` reads such a directory back; `merge_lora` folds the adapters into the
base weights (what `save_pretrained` writes for a LoRA model).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxppo.models.config import ModelConfig

__all__ = ["LoraConfig", "LoraDense", "add_lora", "merge_lora", "save_peft_adapter", "load_peft_adapter",
           "target_names"]

# Our block-level module names by Hugging Face (and PEFT) target name.
_GPT2_TARGETS = {"c_attn": ("c_attn",), "c_proj": ("c_proj", "mlp_c_proj"), "c_fc": ("c_fc",)}
_LLAMA_TARGETS = {n: (n,) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
ALL_LINEAR = "all-linear"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def target_names(config: ModelConfig) -> dict:
    """{Hugging Face target name: our module names} for this architecture."""
    return _GPT2_TARGETS if config.model_type == "gpt2" else _LLAMA_TARGETS


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, alpha (the adapters' output is scaled by alpha / rank) and target modules
    (Hugging Face module names, or "all-linear"). Hashable."""

    rank: int = 8
    alpha: float = 16.0
    targets: Union[Tuple[str, ...], str] = ("q_proj", "v_proj")

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid; use a positive int (8, 16, 64 are typical)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r} is invalid; use a positive number (often 2 x rank)")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"LoraConfig.targets={self.targets!r} is invalid; give module names such as "
                             "('q_proj', 'v_proj') or 'all-linear'")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"LoraConfig.targets={targets!r}: 'all-linear' stands alone")
        object.__setattr__(self, "targets", tuple(sorted(set(targets))))
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: ModelConfig) -> frozenset:
        """Our module names that get adapters on a `config` model; ValueError for a target
        this architecture does not have, listing the valid ones."""
        names = target_names(config)
        if self.targets == (ALL_LINEAR,):
            return frozenset(m for ms in names.values() for m in ms)
        unknown = [t for t in self.targets if t not in names]
        if unknown:
            raise ValueError(f"LoRA targets {unknown} are not linear layers of a {config.model_type} model; valid: "
                             f"{', '.join(names)} or '{ALL_LINEAR}'")
        return frozenset(m for t in self.targets for m in names[t])

    def hf_targets(self, config: ModelConfig) -> list:
        """The target names as PEFT records them (all-linear expanded)."""
        names = target_names(config)
        return sorted(names) if self.targets == (ALL_LINEAR,) else sorted(self.targets)


class LoraDense(nn.Module):
    """`nn.Dense` (same `kernel` / `bias` params and numerics) plus, in the "lora"
    collection, `lora_a` (in, rank) and `lora_b` (rank, out), float32, whose product scaled
    by `scale` is added to the output when `enabled`."""

    features: int
    use_bias: bool
    dtype: object
    param_dtype: object
    rank: int
    scale: float
    enabled: bool = True

    @nn.compact
    def __call__(self, x):
        d_in = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        # A as PEFT initialises it (Kaiming-uniform with a = sqrt(5): U(+-1/sqrt(in))), B zero.
        a = self.variable("lora", "lora_a", lambda: nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")(
            self.make_rng("params"), (d_in, self.rank), jnp.float32))
        b = self.variable("lora", "lora_b", lambda: jnp.zeros((self.rank, self.features), jnp.float32))
        x = x.astype(self.dtype)
        y = jax.lax.dot_general(x, kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias.astype(self.dtype)
        if self.enabled:
            low = jax.lax.dot_general(x, a.value.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
            y = y + (self.scale * jax.lax.dot_general(low, b.value.astype(self.dtype),
                                                      (((low.ndim - 1,), (0,)), ((), ())))).astype(self.dtype)
        return y


def _model_type_check(model):
    from jaxppo.models.model import Model

    if not isinstance(model, Model):
        raise TypeError(f"expected a jaxppo.models.Model, got {type(model).__name__}")


def add_lora(model, params, lora: LoraConfig, key):
    """(model with `lora`, variables {"params": `params`' params, "lora": fresh adapters})
    from a model without adapters: A random (from `key`), B zero, so the outputs equal the
    base model's exactly."""
    _model_type_check(model)
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
    _model_type_check(model)
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


def _peft_name(path, config):
    """Our adapter path (without the "lora" root) -> PEFT's tensor name of lora_A / lora_B."""
    from jaxppo.models.hf import _hf_name

    name, _ = _hf_name(path[:-1] + ("kernel",), config)  # e.g. model.layers.0.self_attn.q_proj.weight
    which = "lora_A" if path[-1] == "lora_a" else "lora_B"
    return f"base_model.model.{name[: -len('.weight')]}.{which}.weight"


def _per_layer_adapters(model, adapters):
    """The "lora" collection in the per-layer layout, flattened."""
    from jaxppo.models.model import unstack_layers

    if model.scan_layers:
        adapters = unstack_layers({"params": adapters}, model.config)["params"]
    return traverse_util.flatten_dict(jax.device_get(adapters))


def save_peft_adapter(model, variables, path: str, base_model_name_or_path: str = None):
    """Write the adapters in PEFT's format: `adapter_config.json` and
    `adapter_model.safetensors` (lora_A (rank, in), lora_B (out, rank) per module), for a
    causal LM. `peft.PeftModel.from_pretrained(base, path)` loads it onto the base model."""
    from safetensors.numpy import save_file

    _model_type_check(model)
    if model.lora is None:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {}
    for p, value in _per_layer_adapters(model, variables["lora"]).items():
        tensors[_peft_name(p, model.config)] = np.ascontiguousarray(np.asarray(value, np.float32).T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": model.lora.rank,
        "lora_alpha": model.lora.alpha,
        "target_modules": model.lora.hf_targets(model.config),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": model.config.model_type == "gpt2",  # GPT-2's Conv1D stores (in, out)
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_peft_config(path: str) -> LoraConfig:
    """The `LoraConfig` of a PEFT adapter directory; ValueError for what jaxppo cannot load
    the same way (DoRA, rsLoRA, trained biases, extra saved modules, per-layer ranks)."""
    from jaxppo.models.hf import read_json_object

    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} is not a PEFT adapter directory: it has no {ADAPTER_CONFIG}")
    c = read_json_object(file)
    if c.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type {c.get('peft_type')!r} is not supported; only LORA adapters load")
    unsupported = {k: c.get(k) for k in ("use_dora", "use_rslora", "modules_to_save", "layers_to_transform",
                                         "rank_pattern", "alpha_pattern")
                   if c.get(k)}
    if c.get("bias", "none") != "none":
        unsupported["bias"] = c["bias"]
    if unsupported:
        raise ValueError(f"{file}: options {unsupported} are not supported; jaxppo loads plain LoRA (one rank and "
                         "alpha, no bias, no extra saved modules)")
    targets = c.get("target_modules")
    if isinstance(targets, str):
        targets = (targets,)
    try:
        return LoraConfig(rank=c.get("r"), alpha=c.get("lora_alpha", c.get("r")), targets=tuple(targets or ()))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{file}: {err}") from None


def load_peft_adapter(model, params, path: str):
    """(model with LoRA, variables) from a model without adapters and a PEFT adapter
    directory saved for the same base architecture. ValueError lists missing, unexpected
    and mis-shaped tensors."""
    from safetensors.numpy import load_file

    from jaxppo.models.model import stack_layers

    _model_type_check(model)
    lora = read_peft_config(path)
    weights = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        raise ValueError(f"{path!r} has no {ADAPTER_WEIGHTS} (jaxppo reads safetensors adapters only; never "
                         "adapter_model.bin, whose unpickling can run code)")
    lora_model, variables = add_lora(model, params, lora, jax.random.key(0))
    plain = dataclasses.replace(lora_model, scan_layers=False)
    template = traverse_util.flatten_dict(jax.eval_shape(lambda: plain.init(jax.random.key(0), seq_len=2))["lora"])
    tensors = load_file(weights)
    out, missing, mismatched, used = {}, [], [], set()
    for p, spec in template.items():
        name = _peft_name(p, model.config)
        alt = name.replace(".weight", ".default.weight")
        name = name if name in tensors else (alt if alt in tensors else name)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        value = np.asarray(tensors[name], np.float32).T
        if value.shape != tuple(spec.shape):
            mismatched.append(f"{name}: adapter {tuple(value.shape[::-1])} vs model {tuple(spec.shape[::-1])}")
            continue
        out[p] = jnp.asarray(value)
    unexpected = sorted(set(tensors) - used)
    problems = ([f"missing tensors: {missing}"] if missing else []) + (
        [f"shape mismatches: {mismatched}"] if mismatched else []) + (
        [f"unexpected tensors: {unexpected}"] if unexpected else [])
    if problems:
        raise ValueError(f"{path!r} does not fit this {model.config.model_type} model: " + "; ".join(problems))
    adapters = traverse_util.unflatten_dict(out)
    if model.scan_layers:
        adapters = stack_layers({"params": adapters}, model.config)["params"]
    return lora_model, {**variables, "lora": adapters}
