"""Writing a trained policy out: a Hugging Face directory (LoRA merged) and a PEFT adapter.
Each write is atomic (a kill mid-export leaves the old export or the new one, whole), and
in multi-host runs only process 0 writes, after gathering what it writes to its host."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxppo.models import hf as hf_io
from jaxppo.models.peft import save_peft_adapter
from jaxppo.run.directory import atomic_replace_dir
from jaxppo.sharding import to_host

__all__ = ["for_writer", "export_policy", "export_adapter"]


def for_writer(tree):
    """`tree` for the one process that writes exports (gathered to its host in multi-host
    runs), or None on the others."""
    if jax.process_count() > 1:
        tree = jax.tree.map(to_host, tree)
        if jax.process_index() != 0:
            return None
    return tree


def export_policy(model, params, tokenizer, path: str, drop_value_head: bool = False):
    """Save the policy `model` / `params` (and `tokenizer`) as a Hugging Face causal-LM
    directory; a LoRA policy with its adapters merged into the base weights; a shared
    trunk's value head left out (`drop_value_head`)."""
    model = dataclasses.replace(model, kind="causal_lm")
    if drop_value_head:
        params = {**params, "params": {k: v for k, v in params["params"].items() if k != "value_head"}}
    params = for_writer(params)
    if params is None:
        return

    def write(directory):
        hf_io.save_pretrained(model, params, directory)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(directory)

    atomic_replace_dir(write, path)


def export_adapter(model, params, path: str, base_path=None):
    """Save a LoRA policy's adapters in PEFT's format for the base checkpoint at
    `base_path` (recorded as `base_model_name_or_path`)."""
    if model.lora is None:
        raise ValueError("export_adapter needs a LoRA policy (PPOTrainer(lora=...) or lora_init=...)")
    adapters = for_writer({"lora": params["lora"]})  # the adapters alone, not the base
    if adapters is None:
        return
    base = os.path.abspath(os.fspath(base_path)) if base_path is not None else None
    atomic_replace_dir(lambda directory: save_peft_adapter(model, adapters, directory, base_model_name_or_path=base),
                       path)
