"""GGUF checkpoints (llama.cpp's format): read and dequantized by transformers' own GGUF
reader, then loaded like a Hugging Face checkpoint.

A `.gguf` file holds the weights (often quantized: Q4_0, Q4_1, Q8_0, K-quants, ...), the
model's configuration and its tokenizer. `read_gguf` returns the configuration as a
Hugging Face `config.json` dict and every weight dequantized to float32 under its Hugging
Face name; `jaxppo.models.from_pretrained` and `load_tokenizer` accept the file's path.
Needs the `gguf` package and PyTorch (transformers' reader works in PyTorch): `pip install
'jaxppo[gguf]'`. Nothing is downloaded and no code from the file runs (it holds none).
"""

from __future__ import annotations

import os

from jaxppo.models.family import family_of, model_types

__all__ = ["is_gguf", "read_gguf", "gguf_tokenizer", "check_gguf"]


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (by its extension)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(".gguf")


def check_gguf(path) -> tuple:
    """(directory, file name) of an existing GGUF file, with the packages its reader needs;
    ValueError / ImportError saying what is missing."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file; give the path of a .gguf file")
    missing = [name for name in ("gguf", "torch") if not _importable(name)]
    if missing:
        raise ImportError(f"reading {os.path.basename(path)} needs {' and '.join(missing)} (transformers' GGUF reader "
                          "dequantizes in PyTorch): pip install 'jaxppo[gguf]'")
    return os.path.split(path)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def read_gguf(path) -> tuple:
    """(config dict in Hugging Face's `config.json` form, {Hugging Face tensor name: float32
    numpy array}) of a GGUF file, dequantized by transformers.

    Raises ValueError for an architecture jaxppo does not build (before anything is
    dequantized) or one transformers cannot read, and for a quantization type its reader
    cannot dequantize; ImportError without `gguf` or PyTorch."""
    directory, name = check_gguf(path)
    import torch
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError) as err:
        raise ValueError(f"{name}: transformers cannot read this GGUF file's model ({_first_line(err)}); jaxppo "
                         f"builds {', '.join(model_types())}") from None
    try:
        family_of(config.model_type)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # one bar per tensor group: noise in a log
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32,
                                                                  local_files_only=True)
    except (NotImplementedError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{name}: its weights cannot be dequantized by transformers' GGUF reader "
                         f"({type(err).__name__}: {_first_line(err)}); a quantization type it reads (Q4_0, Q4_1, "
                         "Q8_0, K-quants, F16, F32, ...) or a Hugging Face checkpoint directory would load") from None
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    hf = config.to_dict()
    # transformers' defaults for a causal LM, not the file's: the labels of a classification head it has not got.
    for key in ("quantization_config", "id2label", "label2id", "num_labels"):
        hf.pop(key, None)
    hf["architectures"] = [type(model).__name__]
    tensors = {key: value.detach().to(torch.float32).numpy() for key, value in model.state_dict().items()}
    return hf, tensors


def gguf_tokenizer(path):
    """transformers' tokenizer of a GGUF file (its vocabulary, merges, special tokens and
    chat template), with its EOS token as pad token when it has none."""
    directory, name = check_gguf(path)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True,
                                                           trust_remote_code=False)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _first_line(err) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else type(err).__name__

