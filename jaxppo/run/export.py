"""Writing a trained policy out: a Hugging Face directory (LoRA merged) and a PEFT adapter.
Each write is atomic (a kill mid-export leaves the old export or the new one, whole) and
carries the SHA-256 of its files (`jaxppo_checksums.json`, checked when jaxppo loads it:
`jaxppo.files.verify_if_present`), and in multi-host runs only process 0 writes, after
gathering what it writes to its host."""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxppo.files import write_checksums
from jaxppo.models import hf as hf_io
from jaxppo.models.peft import save_peft_adapter
from jaxppo.run.directory import atomic_replace_dir
from jaxppo.sharding import to_host

__all__ = ["for_writer", "export_policy", "export_adapter", "export_checkpoint", "Exportable"]


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

    _replace_with_checksums(write, path)


def export_adapter(model, params, path: str, base_path=None):
    """Save a LoRA policy's adapters in PEFT's format for the base checkpoint at
    `base_path` (recorded as `base_model_name_or_path`)."""
    if model.lora is None:
        raise ValueError("export_adapter needs a LoRA policy (PPOTrainer(lora=...) or lora_init=...)")
    adapters = for_writer({"lora": params["lora"]})  # the adapters alone, not the base
    if adapters is None:
        return
    base = os.path.abspath(os.fspath(base_path)) if base_path is not None else None
    _replace_with_checksums(
        lambda directory: save_peft_adapter(model, adapters, directory, base_model_name_or_path=base), path)


def export_checkpoint(model, params, tokenizer, path: str, base_path=None, drop_value_head: bool = False):
    """A checkpoint that loads: without LoRA the policy as `export_policy` writes it; with
    LoRA the PEFT adapter (`export_adapter`) and the tokenizer, in one atomic write."""
    if model.lora is None:
        return export_policy(model, params, tokenizer, path, drop_value_head=drop_value_head)
    adapters = for_writer({"lora": params["lora"]})
    if adapters is None:
        return
    base = os.path.abspath(os.fspath(base_path)) if base_path is not None else None

    def write(directory):
        save_peft_adapter(model, adapters, directory, base_model_name_or_path=base)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(directory)

    _replace_with_checksums(write, path)


def _replace_with_checksums(write, path: str):
    """`jaxppo.run.directory.atomic_replace_dir`, the folder's checksum file written last."""

    def write_with_checksums(directory):
        write(directory)
        write_checksums(directory)

    atomic_replace_dir(write_with_checksums, path)


class Exportable:
    """The export side of a trainer (`jaxppo.Trainer` is one): reads its `spec`, `state`,
    `policy_model`, `tokenizer`, `tc` and `parts.policy_source`."""

    def policy_params(self):
        """The policy's parameters (of the current train state)."""
        return self.spec.policy_params(self.state.params)

    def export(self, path: str):
        """Save the current policy (and tokenizer) as a Hugging Face directory; a LoRA
        policy with its adapters merged into the base weights."""
        export_policy(self.policy_model, self.policy_params(), self.tokenizer, path, drop_value_head=self.tc.shared_trunk)

    def export_adapter(self, path: str):
        """Save a LoRA policy's adapters in PEFT's format for the base checkpoint it was
        loaded from."""
        export_adapter(self.policy_model, self.policy_params(), path, self.parts.policy_source)

    def export_checkpoint(self, path: str):
        """A Hugging Face checkpoint of the current policy at `path` (atomically, with the
        tokenizer): the merged policy, or with LoRA the PEFT adapter."""
        self.parts.hf_checkpoints.write(path, self.state.params)
