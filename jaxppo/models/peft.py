"""PEFT's LoRA adapter format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(base, dir)` loads onto the base checkpoint. Tensor names
are the Hugging Face names of the targeted kernels (`jaxppo.models.hf.hf_name`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxppo.files import verify_if_present
from jaxppo.models.adapters import add_lora, check_model
from jaxppo.models.family import family_of
from jaxppo.models.hf import hf_name, read_json_object
from jaxppo.models.lora import LoraConfig
from jaxppo.models.model import stack_layers, unstack_layers

__all__ = ["save_peft_adapter", "load_peft_adapter", "read_peft_config", "peft_name", "ADAPTER_CONFIG",
           "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Where a vision-language model's encoder sits in transformers' module names (Qwen's
# "visual", Gemma 3's "vision_tower" and "multi_modal_projector").
VISION_TOWERS = ("visual", "vision_tower", "multi_modal_projector")


def peft_name(path, config):
    """Our adapter path (without the "lora" root) -> PEFT's tensor name of lora_A / lora_B.
    A mixture's expert adapters (`<projection>_lora_a` beside the stacked kernel) name one
    tensor per expert, with an `{expert}` field (Hugging Face's per-expert modules)."""
    leaf = path[-1]
    kernel = ("kernel",) if leaf in ("lora_a", "lora_b") else (leaf[: -len("_lora_a")],)
    name, _ = hf_name(path[:-1] + kernel, config)  # e.g. model.layers.0.self_attn.q_proj.weight
    family = family_of(config)
    saved = family.hf_trunk_name or family.trunk_name
    renames = [(saved, family.peft_trunk_name), family.peft_tower_name or (None, None)]
    for old, new in renames:  # the modules' names, not the file's
        if new and name.startswith(old + "."):
            name = new + name[len(old):]
            break
    which = "lora_A" if leaf.endswith("lora_a") else "lora_B"
    return f"base_model.model.{name[: -len('.weight')]}.{which}.weight"


def _one_per_expert(name: str, value):
    """{PEFT name: tensor} of one adapter leaf: itself, or one (transposed) per expert."""
    if "{expert}" not in name:
        return {name: np.ascontiguousarray(np.asarray(value, np.float32).T)}
    return {name.format(expert=e): np.ascontiguousarray(np.asarray(value[e], np.float32).T)
            for e in range(value.shape[0])}


def _per_layer_adapters(model, adapters):
    """The "lora" collection in the per-layer layout, flattened."""
    if model.scan_layers:
        adapters = unstack_layers({"params": adapters}, model.config)["params"]
    return traverse_util.flatten_dict(jax.device_get(adapters))


def save_peft_adapter(model, variables, path: str, base_model_name_or_path: str = None):
    """Write the adapters in PEFT's format: `adapter_config.json` and
    `adapter_model.safetensors` (lora_A (rank, in), lora_B (out, rank) per module), for a
    causal LM. `peft.PeftModel.from_pretrained(base, path)` loads it onto the base model."""
    from safetensors.numpy import save_file

    check_model(model)
    if model.lora is None:
        raise ValueError("the model has no LoRA adapters to save")
    tensors = {}
    for p, value in _per_layer_adapters(model, variables["lora"]).items():
        tensors.update(_one_per_expert(peft_name(p, model.config), value))
    # With the vision encoder's adapters, which share names with the language model's
    # (Gemma 3's q_proj; Qwen's gate_proj), the modules are named exactly: a pattern PEFT
    # matches against each module's whole name.
    targets = _module_pattern(tensors) if model.lora.vision else model.lora.hf_targets(model.config)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": model.lora.rank,
        "lora_alpha": model.lora.alpha,
        "target_modules": targets,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": family_of(model.config).peft_fan_in_fan_out,  # (in, out) layers: GPT-2's Conv1D
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "exclude_modules": None if model.lora.vision else family_of(model.config).peft_exclude,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})


def _module_pattern(tensors) -> str:
    """A regular expression (PEFT's `target_modules` as a string: matched against a
    module's whole name) for exactly the modules of these PEFT tensor names, the layer
    numbers as \\d+."""
    modules = {re.sub(r"\.\d+\.", ".0.", n[len("base_model.model."):].rsplit(".lora_", 1)[0]) for n in tensors}
    return "|".join(re.escape(m).replace(r"\.0\.", r"\.\d+\.") for m in sorted(modules))


def _adapter_modules(path: str) -> list:
    """The module names of a PEFT adapter directory's tensors (from the safetensors header;
    no tensor is read), or [] where it has no safetensors file."""
    from safetensors import safe_open

    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        return []
    with safe_open(file, framework="numpy") as f:
        return sorted({n.replace("base_model.model.", "", 1).rsplit(".lora_", 1)[0] for n in f.keys()})


def _in_tower(module: str) -> bool:
    return any(part in module.split(".") for part in VISION_TOWERS)


def _targets(path: str, file: str, targets):
    """(language-model targets, whether the vision encoder has adapters) of an adapter:
    its `target_modules` (a list of names, or "all-linear"); where the vision encoder has
    adapters, or the targets are a pattern (a string that is not a name, as jaxppo writes
    with the encoder's adapters), the last names of its language-model modules (PEFT
    saves "all-linear" over a whole vision-language model as the names of both)."""
    modules = _adapter_modules(path)
    tower = any(_in_tower(m) for m in modules)
    if tower or (isinstance(targets, str) and not re.fullmatch(r"[\w-]+", targets)):
        found = sorted({m.rsplit(".", 1)[-1] for m in modules if not _in_tower(m)})
        if not found:
            raise ValueError(f"{file}: target_modules {targets!r} is a pattern or reaches a vision encoder, and the "
                             "adapter has no language-model tensors to read its targets from")
        return tuple(found), tower
    return ((targets,) if isinstance(targets, str) else tuple(targets or ())), tower


def read_peft_config(path: str) -> LoraConfig:
    """The `LoraConfig` of a PEFT adapter directory; ValueError for what jaxppo cannot load
    the same way (DoRA, rsLoRA, trained biases, extra saved modules, per-layer ranks)."""
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
    targets, tower = _targets(path, file, c.get("target_modules"))
    try:
        return LoraConfig(rank=c.get("r"), alpha=c.get("lora_alpha", c.get("r")), targets=targets, vision=tower)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{file}: {err}") from None


def load_peft_adapter(model, params, path: str):
    """(model with LoRA, variables) from a model without adapters and a PEFT adapter
    directory saved for the same base architecture. ValueError lists missing, unexpected
    and mis-shaped tensors."""
    from safetensors.numpy import load_file


    check_model(model)
    verify_if_present(os.fspath(path), "the PEFT adapter")
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
        pattern = peft_name(p, model.config)
        names = [pattern.format(expert=e) for e in range(spec.shape[0])] if "{expert}" in pattern else [pattern]
        found = []
        for name in names:
            alt = name.replace(".weight", ".default.weight")
            found.append(name if name in tensors else (alt if alt in tensors else None))
        if None in found:
            missing.extend(n for n, f in zip(names, found) if f is None)
            continue
        used.update(found)
        value = np.stack([np.asarray(tensors[f], np.float32).T for f in found]) if "{expert}" in pattern \
            else np.asarray(tensors[found[0]], np.float32).T
        name = pattern
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
