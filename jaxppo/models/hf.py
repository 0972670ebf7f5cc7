"""Import and export of Hugging Face checkpoints (config.json + safetensors), local only."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxppo.files import verify_if_present
from jaxppo.models.adapters import merge_lora
from jaxppo.models.config import ModelConfig
from jaxppo.models.family import family_of, from_hf_layout, model_types, to_hf_layout
from jaxppo.models.gguf import check_gguf, is_gguf, read_gguf
from jaxppo.models.model import KINDS, Model, stack_layers, trunk_name, unstack_layers

__all__ = ["from_pretrained", "ConfigOnly", "save_pretrained", "params_from_hf_tensors", "params_to_hf_tensors", "hf_arrays", "check_checkpoint_dir",
           "checkpoint_config", "layer_count"]

_LEAF_NAMES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "weight": "weight", "bias": "bias"}
# Buffers some checkpoints carry that are not parameters.
_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
# The field of a per-expert tensor name (`hf_name`), e.g. "...mlp.experts.{expert}.up_proj.weight".
EXPERT_FIELD = "{expert}"
# jaxppo-only heads, not part of Hugging Face checkpoints.
_VALUE_HEAD_FILE = "value_head.safetensors"


def hf_name(path, config: ModelConfig):
    """Our flat param path (without the 'params' root) -> (HF tensor name, transpose?), or
    None for jaxppo-only parameters (the value head). A mixture of experts' stacked kernel
    maps to a name with an `{expert}` field (one tensor per expert, each transposed). The
    family names its block's modules
    (`hf_block_names`) and the kernels Hugging Face stores as Flax does (`hf_untransposed`,
    GPT-2's Conv1D); every other kernel is a torch Linear's (out, in), transposed. A family
    names the parameters outside its blocks (a vision encoder) with `hf_extra_name`; there
    the second element may be a shape: a convolution whose stride is its kernel (a patch
    embedding), stored (out, ...) by Hugging Face and as a flat (in, out) kernel here
    (`jaxppo.models.family.to_hf_layout`, `from_hf_layout`)."""
    family = family_of(config)
    if path[0] == "value_head":
        return None
    extra = None if family.hf_extra_name is None else family.hf_extra_name(path, config)
    if extra is not None:
        return extra
    experts = len(path) > 2 and path[-2] == "experts" and path[-1] in family.hf_expert_names
    leaf = "weight" if experts else _LEAF_NAMES[path[-1]]
    if path[0] in ("lm_head", "score"):
        return f"{path[0]}.{leaf}", path[-1] == "kernel"
    parts = [family.hf_trunk_name if path[0] == family.trunk_name and family.hf_trunk_name else path[0]]
    module = path[-2]
    for p in path[1:-1]:
        if "_" in p and p.rsplit("_", 1)[1].isdigit() and p.rsplit("_", 1)[0] == family.layers_prefix:
            parts.extend(p.rsplit("_", 1))
        else:
            parts.append(family.hf_block_names.get(p, p))
    if experts:  # one tensor per expert: the name holds an {expert} field
        return ".".join(parts + [EXPERT_FIELD, family.hf_expert_names[path[-1]], leaf]), True
    transpose = path[-1] == "kernel" and module not in family.hf_untransposed
    return ".".join(parts + [leaf]), transpose


class _Tensors:
    """Lazy access to the tensors of a checkpoint directory (single or sharded safetensors)."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = _weight_files(path)
        self._handles = {}
        self.where = {}
        for file in sorted(files):
            try:
                handle = safe_open(file, framework="numpy")
            except Exception as err:  # safetensors raises its own error type for a torn or foreign file
                raise ValueError(f"{file} is not a readable safetensors file ({type(err).__name__}: {err})") from None
            self._handles[file] = handle
            for name in handle.keys():
                self.where[name] = file

    def names(self):
        return set(self.where)

    def get(self, name):
        return self._handles[self.where[name]].get_tensor(name)


def read_json_object(file: str) -> dict:
    """A JSON file holding an object, as a dict; ValueError naming the file otherwise."""
    try:
        with open(file) as f:
            d = json.load(f)
    except ValueError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{file} holds a {type(d).__name__}; expected a JSON object")
    return d


def _read_config_dict(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"{path!r} is not a directory; give the local directory of a Hugging Face checkpoint")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{path!r} is not a Hugging Face checkpoint: it has no config.json")
    d = read_json_object(config_file)
    remote = _remote_code(path, d)
    if remote:
        raise ValueError(
            f"{path!r} asks for code shipped with the checkpoint ({remote}); jaxppo never runs code from a checkpoint. "
            f"Supported model types: {', '.join(model_types())}")
    try:
        family_of(d.get("model_type"))
    except ValueError as err:
        raise ValueError(f"{config_file}: {err}") from None
    return d


def _remote_code(path: str, config: dict) -> str:
    """What in a checkpoint directory asks for remote code ("" if nothing): an `auto_map`
    in config.json or tokenizer_config.json (transformers' pointer to Python files in the
    checkpoint)."""
    found = []
    if config.get("auto_map"):
        found.append(f"config.json auto_map {config['auto_map']}")
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):
        try:
            with open(tokenizer_config) as f:
                t = json.load(f)
        except ValueError:
            t = {}
        if isinstance(t, dict) and t.get("auto_map"):
            found.append(f"tokenizer_config.json auto_map {t['auto_map']}")
    return "; ".join(found)


def check_checkpoint_dir(path: str, what: str = "checkpoint"):
    """Check a local Hugging Face checkpoint directory without loading it: a config.json
    with a supported model_type and no remote code, and safetensors weights; or a `.gguf`
    file that exists, with its reader's packages installed. Raises ValueError (ImportError
    for a missing package) naming `what`, the path and the problem."""
    try:
        if is_gguf(path):
            check_gguf(path)
            return
        _read_config_dict(path)
        _weight_files(path)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None


def _weight_files(path: str) -> set:
    """The safetensors files of a checkpoint directory (single or sharded). Pickled weights
    (pytorch_model.bin) are never opened: unpickling can run code."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return {single}
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{index} is not a safetensors index (a JSON object with a weight_map): {err}") from None
        files = {os.path.join(path, name) for name in set(weight_map.values())}
        missing = sorted(f for f in files if not os.path.isfile(f))
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing}")
        return files
    present = sorted(os.listdir(path))
    pickled = [f for f in present if f.endswith((".bin", ".pt", ".pth", ".ckpt", ".pkl"))]
    raise ValueError(
        f"{path!r} has no model.safetensors or model.safetensors.index.json (files: {present}); jaxppo reads "
        "safetensors checkpoints only" + (f" and never unpickles {pickled} (unpickling can run code)" if pickled else "")
        + "; convert the weights with transformers' save_pretrained(..., safe_serialization=True) where you trust them"
    )


def params_from_hf_tensors(model: Model, get_tensor, names, *, strict: bool = True):
    """Build `model`'s params from Hugging Face tensors.

    Args:
      get_tensor: name -> numpy array, in Hugging Face layout.
      names: the set of tensor names available.
    Raises ValueError listing missing names, unexpected names and shape mismatches.
    With `model.scan_layers` the per-layer tensors are stacked on a leading layer axis.
    """
    if model.scan_layers:
        per_layer = params_from_hf_tensors(dataclasses.replace(model, scan_layers=False), get_tensor, names,
                                           strict=strict)
        return stack_layers(per_layer, model.config)
    c = model.config
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), seq_len=2))
    flat = traverse_util.flatten_dict(shapes["params"])
    trunk = trunk_name(c)
    # Base-model checkpoints (e.g. GPT2Model) carry no "transformer." / "model." prefix.
    has_prefix = any(n.startswith(trunk + ".") for n in names)

    def checkpoint_name(hf):
        if not has_prefix and hf.startswith(trunk + "."):
            return hf[len(trunk) + 1 :]
        return hf

    out, used, missing, mismatched = {}, set(), [], []
    param_dtype = jnp.dtype(model.param_dtype)
    for path, spec in flat.items():
        mapped = hf_name(path, c)
        if mapped is None or (model.kind == "value" and path[0] == "score" and "score.weight" not in names):
            out[path] = np.zeros(spec.shape, param_dtype)  # zero-initialised head
            continue
        hf, transpose = mapped
        expert_names = [checkpoint_name(hf).format(expert=e) for e in range(spec.shape[0])] \
            if EXPERT_FIELD in hf else [checkpoint_name(hf)]
        absent = [n for n in expert_names if n not in names]
        if absent:
            missing.extend(absent)
            continue
        tensors = [np.asarray(get_tensor(n)) for n in expert_names]
        used.update(expert_names)
        tensors = [from_hf_layout(t, transpose) for t in tensors]
        tensor, name = (np.stack(tensors), hf) if EXPERT_FIELD in hf else (tensors[0], expert_names[0])
        if tensor.shape != tuple(spec.shape):
            mismatched.append(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(spec.shape)}")
            continue
        out[path] = np.ascontiguousarray(tensor).astype(param_dtype)

    ignorable = {n for n in names if n.endswith(_BUFFER_SUFFIXES)}
    if c.tie_word_embeddings or model.kind in ("reward", "value"):
        ignorable.add("lm_head.weight")  # tied copy of the embeddings, or a head this kind drops
    unexpected = sorted(names - used - ignorable)
    problems = []
    if missing:
        problems.append(f"missing weights: {sorted(missing)}")
    if mismatched:
        problems.append(f"shape mismatches: {mismatched}")
    if unexpected and strict:
        problems.append(f"unexpected weights: {unexpected}")
    if problems:
        raise ValueError(f"checkpoint does not fit a {c.model_type} model of kind {model.kind!r}: " + "; ".join(problems))
    return {"params": traverse_util.unflatten_dict(jax.tree.map(jnp.asarray, out))}


@dataclasses.dataclass(frozen=True)
class ConfigOnly(os.PathLike):
    """A checkpoint directory of which only config.json is read: `from_pretrained` (and so a
    `Trainer`'s model loading) gives its model with random parameters of the checkpoint's
    shapes instead of its weights. Under `jax.eval_shape` nothing is allocated: how
    `jaxppo.plan` builds a run's programs before any weight is loaded (a directory holding
    config.json alone will do)."""

    path: str

    def __fspath__(self) -> str:
        return self.path


def checkpoint_config(path: str) -> Optional[ModelConfig]:
    """The `ModelConfig` of the Hugging Face checkpoint directory at `path`, read from its
    config.json without loading any weights; None for a .gguf file (its metadata is read
    when it loads). A ValueError naming the file when it is missing or wrong."""
    if is_gguf(path):
        return None
    return _model_config(_read_config_dict(path), os.path.join(path, "config.json"))


def layer_count(path: str) -> Optional[int]:
    """The number of transformer blocks of the checkpoint at `path` (a Hugging Face
    directory, or a .gguf file's `<arch>.block_count`), read without loading any weights;
    None when a .gguf file's metadata cannot be read that way."""
    if is_gguf(path):
        try:
            from gguf import GGUFReader

            reader = GGUFReader(os.fspath(path))
            arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
            return int(reader.fields[f"{arch}.block_count"].parts[-1][0])
        except Exception:  # noqa: BLE001 - no gguf package, another layout: loaded as it comes
            return None
    return checkpoint_config(path).num_layers


def _renamed(config: ModelConfig, get_tensor, names):
    """(get_tensor, names) by the family's names for the checkpoint's tensors
    (`ModelFamily.hf_checkpoint_name`; a tensor it names None is left out)."""
    rename = family_of(config).hf_checkpoint_name
    if rename is None:
        return get_tensor, names
    renamed = {rename(n): n for n in names}
    renamed.pop(None, None)
    return (lambda name: get_tensor(renamed[name])), set(renamed)


def _model_config(d: dict, source: str) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config dict read from `source`; a ValueError
    naming the file when a field is missing or wrong."""
    try:
        return ModelConfig.from_hf(d)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{source} lacks or misstates a field a {d['model_type']} config needs: {err!r}") from None


def from_pretrained(
    path: str,
    dtype="float32",
    *,
    param_dtype=None,
    kind: Optional[str] = None,
    remat=False,
    scan_layers: bool = False,
):
    """Load a local Hugging Face checkpoint directory -> (Model, params).

    Args:
      path: directory with config.json and model.safetensors (or a sharded
        model.safetensors.index.json), or a `.gguf` file (llama.cpp's format, quantized or
        not: dequantized to float32 by transformers' GGUF reader, `jaxppo.models.gguf`;
        needs `pip install 'jaxppo[gguf]'`). Nothing is downloaded.
      dtype: compute dtype ("float32", "bfloat16", "float16").
      param_dtype: storage dtype of the params; defaults to `dtype`.
      kind: "causal_lm", "causal_lm_value" (policy + zero-initialised value head),
        "reward" (sequence classification, score at the last real token that is not padding), or "value"
        (a critic: trunk + scalar head, initialised from the checkpoint's score head when it
        has one, else zeros). Default: "reward" for `...ForSequenceClassification`
        checkpoints, else "causal_lm".
      remat: rematerialise each block in the backward pass (less memory, more compute):
        False, True, or a `jax.checkpoint_policies` name (see `Model`).
      scan_layers: stack the per-layer tensors on a leading layer axis and run the blocks
        as one scan (see `Model`); `save_pretrained` writes them back per layer.

    Returns:
      (model, params) with `model.apply(params, input_ids, attention_mask)` pure.
    """
    if isinstance(path, ConfigOnly):  # the config's shapes, random weights: nothing read but config.json
        d = _read_config_dict(path.path)
        names = get_tensor = None
        source = os.path.join(path.path, "config.json")
    elif is_gguf(path):
        d, arrays = read_gguf(path)
        names, get_tensor, source = arrays.keys(), arrays.__getitem__, os.fspath(path)
    else:
        verify_if_present(os.fspath(path), "the checkpoint")  # an export of jaxppo's carries checksums
        d = _read_config_dict(path)
        tensors = _Tensors(path)
        names, get_tensor, source = tensors.names(), tensors.get, os.path.join(path, "config.json")
    config = _model_config(d, source)
    if kind is None:
        archs = d.get("architectures") or []
        kind = "reward" if any(a.endswith("ForSequenceClassification") for a in archs) else "causal_lm"
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid; valid kinds: {', '.join(KINDS)}")
    model = Model(config, kind=kind, dtype=dtype, param_dtype=param_dtype or dtype, remat=remat,
                  scan_layers=scan_layers)
    if get_tensor is None:
        return model, model.init(jax.random.key(0), seq_len=2)
    params = params_from_hf_tensors(model, *_renamed(config, get_tensor, names))
    value_head_file = os.path.join(path, _VALUE_HEAD_FILE)
    if kind == "causal_lm_value" and not is_gguf(path) and os.path.isfile(value_head_file):
        from safetensors.numpy import load_file

        head = load_file(value_head_file)
        params["params"]["value_head"] = {
            "kernel": jnp.asarray(head["kernel"], model.param_dtype),
            "bias": jnp.asarray(head["bias"], model.param_dtype),
        }
    return model, params


def hf_arrays(model: Model, params):
    """`model`'s params as [(Hugging Face name, array, transpose?)]: the arrays as they are
    held (device arrays, or host arrays where LoRA adapters were merged), one per layer also
    from the stacked layout of `scan_layers`; `transpose` where Hugging Face stores the
    transpose (torch `Linear` weights). jaxppo-only parameters (the value head) are left out."""
    model, params = merge_lora(model, params)
    if model.scan_layers:
        params = unstack_layers(params, model.config)
    out = []
    for path, value in traverse_util.flatten_dict(params["params"]).items():
        mapped = hf_name(path, model.config)
        if mapped is None:
            continue
        if EXPERT_FIELD in mapped[0]:  # stacked experts: one tensor each
            out.extend((mapped[0].format(expert=e), value[e], mapped[1]) for e in range(value.shape[0]))
        else:
            out.append((mapped[0], value, mapped[1]))
    return out


def params_to_hf_tensors(model: Model, params) -> dict:
    """`model`'s params as {Hugging Face name: numpy array}, in Hugging Face layout (one
    tensor per layer, also from the stacked layout of `scan_layers`; LoRA adapters merged)."""
    out = {}
    for name, value, transpose in hf_arrays(model, params):
        array = np.asarray(jax.device_get(value))
        out[name] = np.ascontiguousarray(to_hf_layout(array, transpose))
    return out


def save_pretrained(model: Model, params, path: str):
    """Write `params` as a Hugging Face checkpoint directory (config.json + model.safetensors)
    that `transformers.AutoModelForCausalLM` (causal LMs) or
    `AutoModelForSequenceClassification` (reward and value models) loads. A model with LoRA
    adapters is written with them merged into the base weights (`jm.save_peft_adapter`
    writes the adapters alone).

    A "causal_lm_value" model is saved as its causal LM plus `value_head.safetensors`, which
    `from_pretrained(..., kind="causal_lm_value")` reads back."""
    from safetensors.numpy import save_file


    model, params = merge_lora(model, params)
    os.makedirs(path, exist_ok=True)
    arch = family_of(model.config).architecture(model.config.model_type,
                                                "causal_lm" if model.is_causal_lm else "score")
    hf_config = model.config.to_hf(arch)
    import transformers

    # transformers >= 5 calls it `dtype`, earlier versions `torch_dtype`.
    dtype_attr = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    setattr(hf_config, dtype_attr, model.param_dtype)
    hf_config.save_pretrained(path)
    save_file(params_to_hf_tensors(model, params), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if model.kind == "causal_lm_value":
        head = params["params"]["value_head"]
        save_file({k: np.asarray(jax.device_get(v)) for k, v in head.items()}, os.path.join(path, _VALUE_HEAD_FILE))
