"""What a team watches of a run besides its metrics: the completions table of an iteration,
and the Hugging Face checkpoints written while it trains (every `save_hf_every` iterations
under `<output_dir>/hf/iteration_<n>`, the newest `keep_hf` kept; and the best by
`best_metric` under `<output_dir>/hf/best`, with `best.json`). Each checkpoint directory is
written atomically: a kill leaves the old one or the new one, whole."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text
from jaxppo.models.tokenizer import decode_responses
from jaxppo.sharding import to_host

__all__ = ["completion_table", "table_rows", "stopped_rows", "HfCheckpoints", "Watchable", "HF_DIR", "BEST_FILE"]

HF_DIR = "hf"
BEST_FILE = "best.json"
_PERIODIC = re.compile(r"^iteration_(\d+)$")


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


class Watchable:
    """What a trainer shows of its last iteration and its policy (`jaxppo.Trainer` is one):
    reads its `last` (`jaxppo.run.iteration.Outcome`), `parts` (the evaluator), `run`,
    `tokenizer`, `table`, `spec` and `reward_params`."""

    last_samples = property(lambda self: self.last and self.last.samples, doc="(prompt rows, samples), or None.")
    last_eval_table = property(lambda self: self.last and self.last.eval_table, doc="Its evaluation's table, or None.")

    def evaluate(self) -> dict:
        """The `eval/...` metrics of the current policy on the eval prompts (the evaluation
        an iteration starting now would run; `jaxppo.run.evaluation`)."""
        if self.parts.evaluator is None:
            raise RuntimeError("this Trainer has no eval_prompts to evaluate on")
        return self.parts.evaluator.evaluate(self.run.train.params, self.run.key, self.iteration, self.reward_params)[0]

    def samples(self, n: int):
        """(prompt, response) texts of the first `n` rows of the last iteration."""
        return [(row[0], row[1]) for row in self.completion_table(n)[1]]

    def completion_table(self, n: int):
        """(columns, rows) of the first `n` completions of the last iteration
        (`completion_table`; its "advantage" column when tables are on: `sample_every` and
        `num_samples`)."""
        return completion_table(self.tokenizer, self.table.texts, self.last.samples, self.last.scores,
                                self.spec.stop_token_ids, n, self.spec.stop_strings, self.last.advantages)


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
