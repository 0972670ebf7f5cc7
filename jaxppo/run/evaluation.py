"""Evaluation during training: held-out prompts sampled from the policy and scored by
reward functions, as `eval/...` metrics in the metrics line of the iteration it runs at.

The policy evaluated at iteration i is the one that sampled iteration i's rollout (the
parameters after i updates' iterations, before iteration i's update), the one its
`objective/scores` describe; so `eval_before_training` is the evaluation at iteration 0.
An evaluation is due at iteration 0 (with `eval_before_training`) and at every iteration i
> 0 with i % `eval_every` == 0. Its key is a function of the run's seed and i alone, and
its metrics travel in the iteration's line: a run killed and resumed computes the same
evaluation again where the line is recomputed and never twice in a tracker.

Sampling runs on the run's rollout engine (the built-in static or continuous sampler, vLLM,
or a registered one), given the evaluated parameters under the engine's lock, with the eval
prompts in chunks of at most a training batch's rows (one compile of a built-in sampler at
that shape; the training program is not touched). `eval_temperature` 0 is greedy decoding.
A run with an environment (multi-turn episodes, tools) evaluates episodes: each eval prompt
plays `eval_generations` episodes as training plays them, scored by the environment's
rewards plus the eval reward functions on the whole conversation (failed episodes score 0).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from math import comb
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.models.tokenizer import decode_responses
from jaxppo.rollout.environments import EpisodeSetup, run_episodes
from jaxppo.rollout.forward import reward_inputs
from jaxppo.rollout.prompts import PromptTable, prompt_batch
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.run.outputs import stopped_rows, table_rows
from jaxppo.run.report import MODEL_REWARD_NAME
from jaxppo.sharding import mesh_context, to_host

__all__ = ["Evaluator", "pass_at_k", "pass_ks", "check_best_metric", "build_evaluator", "evaluate_due", "EVAL_KEY"]

EVAL_KEY = 0x5EED_E7A1  # folded into the run's key: evaluation keys never meet the training ones


@functools.partial(jax.jit, static_argnums=0)
def _device_scores(spec: RolloutSpec, reward_params, ids, mask, tokens, token_mask, images=None):
    """(B,) float32: the reward model's scores of prompt + completion (with the prompts'
    `images`, an `ImagePrompt` without ids, where they have them), or the token-level
    reward function's."""
    if spec.reward_apply is not None:
        rows = {"query_tokens": ids, "query_mask": mask, "response_tokens": tokens, "response_mask": token_mask,
                **({} if images is None else {"images": images})}
        return spec.reward_apply(reward_params, *reward_inputs(spec, rows)).astype(jnp.float32)
    return jnp.asarray(spec.token_reward_fn(ids, mask, tokens, token_mask), jnp.float32)


def pass_ks(g: int) -> list:
    """The k of the pass@k metrics with g samples per prompt: 1, 2, 4, ... up to g, and g."""
    return sorted({2 ** i for i in range(g.bit_length()) if 2 ** i <= g} | {g})


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c are correct (Chen et al.,
    2021): 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclasses.dataclass(frozen=True)
class Evaluator:
    """What a run evaluates with: the eval `PromptTable`, the text reward functions
    (`HostRewards`, or None), the rollout spec (the policy and its stop tokens; its reward
    model or token-level function), the tokenizer, the schedule (`every`,
    `before_training`), `generations` per prompt, `temperature` (None: the spec's; 0:
    greedy), `chunk` (prompts sampled together), `collector`: the run's
    `jaxppo.run.iteration.Collector`, whose rollout engine samples (under its lock) and whose
    environment (or None) plays episodes; the mesh (or None), and `device_scores`: the run's
    reward model (weighted as in training) or token-level reward function scores too."""

    table: PromptTable
    rewards: Any
    spec: RolloutSpec
    tokenizer: Any
    every: int
    before_training: bool
    generations: int
    temperature: Optional[float]
    chunk: int
    collector: Any
    mesh: Any = None
    device_scores: bool = False

    def due(self, iteration: int) -> bool:
        if iteration == 0:
            return self.before_training
        return bool(self.every) and iteration % self.every == 0

    def evaluate(self, params, key, iteration: int, reward_params=None):
        """(the `eval/...` metrics of the policy in the train `params` (host floats), the
        table of its completions: (columns, rows), one row per eval completion).
        `params` are after `iteration` iterations (the engine's weight version);
        `reward_params`: the reward model's, where it scores."""
        t0 = time.perf_counter()
        n, g = len(self.table.prompts), self.generations
        key = jax.random.fold_in(jax.random.fold_in(key, EVAL_KEY), iteration)
        tokens, masks, shown, device, episodes = [], [], [], [], []
        for start in range(0, n, self.chunk):
            prompts = np.arange(start, start + self.chunk) % n  # the last chunk padded with the first prompts
            batch = prompt_batch(self.table, np.repeat(prompts, g), self.mesh)
            keep = min(self.chunk, n - start) * g
            gen, played = self._sample(params, batch, jax.random.fold_in(key, start), iteration)
            attention = getattr(gen, "attention_mask", gen.mask)  # an episode's whole conversation
            if self.device_scores:
                with mesh_context(self.mesh):
                    scores = _device_scores(self.spec, reward_params, batch.ids, batch.mask, gen.tokens, attention,
                                            batch.images)
                device.append(to_host(scores)[:keep])
            tokens.append(to_host(gen.tokens)[:keep])
            masks.append(to_host(gen.mask)[:keep])
            shown.append(to_host(attention)[:keep])
            if played is not None:
                episodes.append((played.rewards[:keep], played.failed[:keep], played.conversations[:keep]))
        tokens, mask, shown = np.concatenate(tokens), np.concatenate(masks), np.concatenate(shown)
        rows = np.repeat(np.arange(n), g)
        completions = (decode_responses(self.tokenizer, tokens, shown) if not episodes else
                       [text for _, _, texts in episodes for text in texts])
        total, per_function = np.zeros(len(rows), np.float64), {}
        if self.device_scores:  # the reward model's own scores (the table's column), weighted into the total
            scores = np.concatenate(device).astype(np.float64)
            name = MODEL_REWARD_NAME if self.spec.reward_apply is not None else "token_reward"
            weight = self.spec.reward_weight if self.spec.reward_apply is not None else 1.0
            per_function[name] = (scores, np.ones(len(rows), bool))
            total = total + weight * scores
        if self.rewards is not None:
            columns = {name: [values[r] for r in rows] for name, values in self.table.columns.items()}
            host, functions, _ = self.rewards(iteration, [self.table.prompts[r] for r in rows], completions, columns)
            total, per_function = total + np.asarray(host, np.float64), {**per_function, **functions}
        if episodes:  # the environments' rewards added; a failed episode scores 0 (as in training)
            env_rewards = np.concatenate([r for r, _, _ in episodes]).astype(np.float64)
            failed = np.concatenate([f for _, f, _ in episodes])
            total = np.where(failed, 0.0, total + env_rewards)
            per_function["environment"] = (env_rewards, ~failed)
        out = summarize(total, per_function, mask, tokens, self.spec.stop_token_ids, g, self.spec.stop_strings)
        out["eval/time"] = time.perf_counter() - t0
        return out, self._table(rows, completions, total, per_function, mask, tokens)

    def _sample(self, params, batch, key, iteration: int):
        """(a chunk's samples: `GenerationOutput`, or an episode batch's `EpisodeOutput`; the
        `Episodes`, or None), from the run's engine holding the policy of `params`."""
        collector, spec = self.collector, self.spec
        engine, environment = collector.rollout_engine, collector.environment
        settings = {} if self.temperature is None else {"temperature": self.temperature}
        with collector.lock, mesh_context(self.mesh):
            engine.set_weights(spec.policy_params(params), iteration)
            if environment is None:
                return engine.sample(batch.queries, batch.mask, key, num_generations=self.generations,
                                     response_length=spec.response_length, **settings), None
            setup = EpisodeSetup(environment, self.table, self.tokenizer, self.mesh)
            played = run_episodes(setup, dataclasses.replace(spec, num_generations=self.generations), params, batch,
                                  key, iteration, engine=engine, **settings)
        return played.output, played

    def _table(self, rows, completions, total, per_function, mask, tokens):
        """(columns, rows) of every eval completion, as the completions table has them."""
        return table_rows([self.table.texts[r] for r in rows], completions, total, per_function, tokens, mask,
                          self.spec.stop_token_ids, self.spec.stop_strings)


def summarize(total: np.ndarray, per_function: dict, mask: np.ndarray, tokens: np.ndarray, stop_ids, g: int,
              stop_strings=None) -> dict:
    """The eval metrics of scored completions: reward_mean (the combined score), each
    function's mean over the rows it scored, pass@k for k in 1, 2, 4, ..., g (and g) when
    every combined score is 0 or 1, mean_length (the policy's tokens) and stopped_ratio
    (completions that ended with a stop token)."""
    out = {"eval/reward_mean": float(total.mean()), "eval/reward_std": float(total.std())}
    for name, (values, given) in per_function.items():
        if given.any():
            out[f"eval/rewards/{name}/mean"] = float(np.mean(np.asarray(values, np.float64)[given]))
    if np.isin(total, (0.0, 1.0)).all():
        correct = total.reshape(-1, g).sum(axis=1).astype(int)
        for k in pass_ks(g):
            out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(g, int(c), k) for c in correct]))
    stopped = stopped_rows(tokens, mask, stop_ids, stop_strings)
    out["eval/completions/mean_length"] = float(mask.sum(axis=1).mean())
    out["eval/completions/stopped_ratio"] = float(stopped.mean())
    return out


def check_best_metric(evaluation, function_names: Optional[list]) -> None:
    """A `ValueError` when `evaluation.best_metric` (an `EvalConfig`'s) names an `eval/`
    metric that this run's evaluation cannot produce (`function_names`: the eval reward
    functions, None without eval prompts), before any work."""
    name = evaluation.best_metric
    if name is None:
        return
    if function_names is None:
        raise ValueError(f"EvalConfig.best_metric={name!r} is chosen by an evaluation, and this run has none: give "
                         "eval_prompts (--eval-prompts), or leave best_metric unset")
    g = evaluation.eval_generations
    valid = ["eval/reward_mean", "eval/reward_std", "eval/completions/mean_length", "eval/completions/stopped_ratio",
             *[f"eval/rewards/{f}/mean" for f in function_names],
             *[f"eval/pass@{k}" for k in pass_ks(g)]]
    if name not in valid:
        raise ValueError(f"EvalConfig.best_metric={name!r} is not a metric this run's evaluation produces; valid: "
                         f"{', '.join(valid)} (pass@k for k up to eval_generations={g}, when the rewards are 0 or 1)")


def build_evaluator(table: Optional[PromptTable], rewards, spec: RolloutSpec, tokenizer, config, collector,
                    mesh=None) -> Optional[Evaluator]:
    """The run's `Evaluator` (None without eval prompts): prompts sampled in chunks of a
    training batch's rows at most (so sampling memory stays as in training) by the
    `collector`'s rollout engine (and environment), as `config.evaluation` says."""
    if table is None:
        return None
    e = config.evaluation
    before = e.eval_before_training if e.eval_before_training is not None else True
    temperature = None if e.eval_temperature is None else float(e.eval_temperature)
    chunk = max(1, min(len(table.prompts), config.batch.batch_size // e.eval_generations))
    rewards, device_scores = rewards
    return Evaluator(table, rewards, spec, tokenizer, e.eval_every, before, e.eval_generations, temperature, chunk,
                     collector, mesh, device_scores)


def evaluate_due(evaluator: Optional[Evaluator], prepared, hf_checkpoints, reward_params=None) -> tuple:
    """The evaluation due at a prepared iteration (`jaxppo.run.iteration.Prepared`), of the
    policy that sampled it (before its update: `prepared.run`'s parameters): (its metrics,
    its completions table), or ({}, None) when none is due; the best checkpoint by it
    written where it is the best (`jaxppo.run.outputs.HfCheckpoints.consider`)."""
    if evaluator is None or not evaluator.due(prepared.iteration):
        return {}, None
    params = prepared.run.train.params
    metrics, table = evaluator.evaluate(params, prepared.run.key, prepared.iteration, reward_params)
    hf_checkpoints.consider(prepared.iteration, metrics, params)
    return metrics, table
