"""What a run writes out besides its metrics and checkpoints, as one object (`Outputs`):
the policy as a Hugging Face directory (LoRA merged) and its PEFT adapter, Hugging Face
checkpoints during the run (every `save_hf_every` iterations under
`<output_dir>/hf/iteration_<n>`, the newest `keep_hf` kept; the best by `best_metric` under
`<output_dir>/hf/best`, with `best.json`), and the completion tables of an iteration.

Each write is atomic (a kill leaves the old directory or the new one, whole) and carries
the SHA-256 of its files (`jaxppo_checksums.json`, checked when jaxppo loads it:
`jaxppo.files.verify_if_present`); in multi-host runs only process 0 writes, after
gathering what it writes to its host."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text, write_checksums
from jaxppo.models import hf as hf_io
from jaxppo.models.peft import save_peft_adapter
from jaxppo.models.tokenizer import decode_responses
from jaxppo.run.directory import atomic_replace_dir
from jaxppo.sharding import to_host

__all__ = ["Outputs", "for_writer", "export_policy", "export_reward_model", "export_adapter", "export_checkpoint",
           "completion_table", "table_rows", "stopped_rows", "HfCheckpoints", "HF_DIR", "BEST_FILE"]

HF_DIR = "hf"
BEST_FILE = "best.json"
_PERIODIC = re.compile(r"^iteration_(\d+)$")


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
    _export_model(model, params, tokenizer, path)


def _save_beside(tokenizer, directory: str):
    """Save `tokenizer` (or each of a tuple: a tokenizer and an image processor) in `directory`."""
    for saved in tokenizer if isinstance(tokenizer, tuple) else (tokenizer,):
        if hasattr(saved, "save_pretrained"):
            saved.save_pretrained(directory)


def _export_model(model, params, tokenizer, path: str):
    """`model` / `params` and `tokenizer` as a Hugging Face directory in `path`, written
    atomically with checksums by the one process that writes exports. `tokenizer` may be a
    tuple of what is saved with the weights (a vision-language policy's tokenizer and image
    processor)."""
    params = for_writer(params)
    if params is None:
        return

    def write(directory):
        hf_io.save_pretrained(model, params, directory)
        _save_beside(tokenizer, directory)

    _replace_with_checksums(write, path)


def export_reward_model(model, params, tokenizer, path: str):
    """Save a reward model (kind "reward", one label) and `tokenizer` as a Hugging Face
    `...ForSequenceClassification` directory, LoRA adapters merged, checksummed; its
    `pad_token_id` is the tokenizer's (transformers reads the score at the last token that
    is not padding)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, pad_token_id=int(pad)))
    _export_model(model, params, tokenizer, path)


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
        _save_beside(tokenizer, directory)

    _replace_with_checksums(write, path)


def _replace_with_checksums(write, path: str):
    """`jaxppo.run.directory.atomic_replace_dir`, the folder's checksum file written last."""

    def write_with_checksums(directory):
        write(directory)
        write_checksums(directory)

    atomic_replace_dir(write_with_checksums, path)




def stopped_rows(tokens: np.ndarray, mask: np.ndarray, stop_ids, stop_strings=None) -> np.ndarray:
    """(B,) bool: the row's completion holds a stop token or completes one of
    `stop_strings` (a `jaxppo.models.stops.StopStrings`, or None): it ended with one."""
    stopped = (np.isin(tokens, np.asarray(stop_ids, dtype=tokens.dtype)) & (mask > 0)).any(axis=1)
    return stopped if stop_strings is None else stopped | stop_strings.completed(tokens, mask)


def table_rows(texts, completions, total, per_function: dict, tokens, mask, stop_ids, stop_strings=None,
               advantages=None):
    """(columns, rows) of completions: "prompt" (`texts`, one per row), "completion",
    "reward" (`total`, or None), one column per reward function (None where it gave no
    opinion), "advantage" (each row's, averaged over its policy tokens; with `advantages`),
    "length" (the policy's response tokens) and "stopped" (ended with a stop token)."""
    stopped = stopped_rows(tokens, mask, stop_ids, stop_strings)
    with_advantages = advantages is not None
    columns = ["prompt", "completion", "reward", *per_function, *(["advantage"] if with_advantages else []), "length",
               "stopped"]
    table = []
    for i, (text, completion) in enumerate(zip(texts, completions)):
        functions = [float(v[i]) if g[i] else None for v, g in per_function.values()]
        advantage = [float(advantages[i])] if with_advantages else []
        table.append([text, completion, None if total is None else float(total[i]), *functions, *advantage,
                      int(mask[i].sum()), bool(stopped[i])])
    return columns, table


def completion_table(tokenizer, texts, samples, scores, stop_ids, n: int, stop_strings=None, advantages=None):
    """(columns, rows) of the first `n` completions of an iteration (`samples`: its prompt
    rows and `GenerationOutput`; `scores`: the combined raw scores and the reward functions'
    `{name: (values, given)}`; `advantages`: each row's, or None), as `table_rows` lays them
    out (the reward model as "reward_model")."""
    raw, per_function = scores
    rows, gen = samples
    tokens, mask = to_host(gen.tokens)[:n], to_host(gen.mask)[:n]
    shown = to_host(getattr(gen, "attention_mask", gen.mask))[:n]  # a multi-turn episode: the whole conversation
    return table_rows([texts[r] for r in rows[:n]], decode_responses(tokenizer, tokens, shown), raw, per_function,
                      tokens, mask, stop_ids, stop_strings, None if advantages is None else to_host(advantages)[:n])


class HfCheckpoints:
    """The run's Hugging Face checkpoints. `write(path, params)` writes the policy of the
    train parameters `params` (merged weights, or the PEFT adapter with LoRA) and the
    tokenizer to `path`, atomically (`jaxppo.run.export.export_checkpoint`)."""

    def __init__(self, output_dir: str, write: Callable[[str, Any], None], *, every: int, keep: int,
                 best_metric: Optional[str], mode: str):
        self.root, self.write, self.every, self.keep = os.path.join(output_dir, HF_DIR), write, every, keep
        self.best_metric, self.mode = best_metric, mode

    def periodic(self, iterations_done: int, params) -> Optional[str]:
        """After `iterations_done` iterations (`params`: the train parameters then):
        `hf/iteration_<n>` when due, the oldest beyond `keep` removed; the path written, or
        None."""
        if not self.every or iterations_done % self.every:
            return None
        path = os.path.join(self.root, f"iteration_{iterations_done}")
        self.write(path, params)
        if self.keep and jax.process_index() == 0:
            done = sorted((int(m.group(1)), name) for name in os.listdir(self.root)
                          if (m := _PERIODIC.match(name)))
            for _, name in done[:-self.keep]:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return path

    def best(self) -> Optional[dict]:
        """The best so far (`hf/best.json`: iteration, metric, value), or None."""
        path = os.path.join(self.root, BEST_FILE)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as f:
                best = json.load(f)
            float(best["value"]), int(best["iteration"])
        except (ValueError, KeyError, TypeError) as err:
            raise RunError(f"{path} is not jaxppo's record of the best checkpoint ({err}); delete it (and "
                           f"{os.path.join(self.root, 'best')}) to choose the best again from here on") from None
        return best

    def consider(self, iteration: int, metrics: dict, params) -> bool:
        """With `best_metric` among `metrics` (those of the policy in the train parameters
        `params`, which samples `iteration`) and better than the best so far: write it to
        `hf/best` and record it (`hf/best.json`, after the directory). Returns whether it was
        written."""
        if self.best_metric is None or not metrics:
            return False
        if self.best_metric not in metrics:
            raise RunError(f"best_metric={self.best_metric!r} is not among the evaluation's metrics at iteration "
                           f"{iteration}: {', '.join(sorted(metrics))} (pass@k needs rewards of 0 or 1)")
        value = float(metrics[self.best_metric])
        best = self.best()
        better = (best is None or (value > best["value"] if self.mode == "max" else value < best["value"]))
        if not math.isfinite(value) or not better:
            return False
        self.write(os.path.join(self.root, "best"), params)
        if jax.process_index() == 0:
            atomic_write_text(os.path.join(self.root, BEST_FILE), json.dumps(
                {"iteration": iteration, "metric": self.best_metric, "value": value, "mode": self.mode}) + "\n")
        return True


class Outputs:
    """A run's outputs: the policy `Model` it trains, the `RolloutSpec` (where the policy's
    parameters sit in the train parameters, the stop tokens), the tokenizer, the policy's
    checkpoint directory (None for a given `(Model, params)`: the PEFT adapter's base),
    whether the train parameters hold a shared trunk's value head (left out of exports),
    and the run's `RunConfig` and `EvalConfig` (the directory, the Hugging Face checkpoints'
    cadence, the best metric); a vision-language policy's image processor, saved with every
    export."""

    def __init__(self, policy_model, spec, tokenizer, policy_source: Optional[str], run_config, eval_config,
                 shared_trunk: bool = False, image_processor=None):
        self.policy_model, self.spec, self.tokenizer, self.policy_source = policy_model, spec, tokenizer, policy_source
        self.saved = tokenizer if image_processor is None else (tokenizer, image_processor)
        self.shared_trunk, self.sample_every, self.num_samples = shared_trunk, run_config.sample_every, run_config.num_samples
        self.hf = HfCheckpoints(run_config.output_dir, self.export_checkpoint_of, every=run_config.save_hf_every,
                                keep=run_config.keep_hf, best_metric=eval_config.best_metric,
                                mode=eval_config.best_metric_mode)

    def export(self, params, path: str):
        """The policy of the train `params` (and the tokenizer) as a Hugging Face directory;
        a LoRA policy with its adapters merged into the base weights."""
        export_policy(self.policy_model, self.spec.policy_params(params), self.saved, path,
                      drop_value_head=self.shared_trunk)

    def export_adapter(self, params, path: str):
        """A LoRA policy's adapters in PEFT's format, for the base checkpoint it was loaded
        from."""
        export_adapter(self.policy_model, self.spec.policy_params(params), path, self.policy_source)

    def export_checkpoint_of(self, path: str, params):
        """A Hugging Face checkpoint of the policy of the train `params` at `path` (with the
        tokenizer): the merged policy, or with LoRA the PEFT adapter."""
        export_checkpoint(self.policy_model, self.spec.policy_params(params), self.saved, path,
                          base_path=self.policy_source, drop_value_head=self.shared_trunk)

    def final(self, params, output_dir: str):
        """The final export: `final_policy/`, and with LoRA `final_adapter/`."""
        self.export(params, os.path.join(output_dir, "final_policy"))
        if self.policy_model.lora is not None:
            self.export_adapter(params, os.path.join(output_dir, "final_adapter"))

    def tables(self, texts, outcome, iterations_done: int) -> list:
        """[(name, columns, rows)] an iteration logs besides its line: its completions every
        `sample_every` iterations, every completion of its evaluation."""
        out = []
        if self.sample_every and self.num_samples and iterations_done % self.sample_every == 0:
            out.append(("completions", *self.table(texts, outcome, self.num_samples)))
        if outcome.eval_table is not None:
            out.append(("eval_completions", *outcome.eval_table))
        return out

    def table(self, texts, outcome, n: int):
        """(columns, rows) of the first `n` completions of an iteration's `Outcome`
        (`completion_table`; "advantage" where the outcome kept them)."""
        return completion_table(self.tokenizer, texts, outcome.samples, outcome.scores, self.spec.stop_token_ids, n,
                                self.spec.stop_strings, outcome.advantages)
