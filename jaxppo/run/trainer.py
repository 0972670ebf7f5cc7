"""`Trainer`: RLHF with PPO or a critic-free method, coordinating the parts of a run.

    trainer = jaxppo.Trainer(config, policy=..., tokenizer=..., prompts=..., reward_fns=...)
    trainer.train()          # every iteration, with checkpoints, logs, evaluation, exports
    trainer.step()           # or one iteration at a time

One iteration is `jaxppo.run.iteration`'s stages, in the order the data flows: select
prompts -> sample -> reward -> build the rollout (the forward pass) -> check -> update ->
metrics; `prepare_iteration` below runs the first five and `finish` the rest. Everything
carried from one iteration to the next is one `RunState` (`run`), which is what a checkpoint
holds; the keys of iteration i are `fold_in(key(seed), i)` and its prompts are a function of
i, so a run resumed from a checkpoint produces exactly the metrics of an uninterrupted one.

The trainer holds explicit parts, each an object of its own: `parts` (`RunParts`: the
models, the rollout spec and engine, the prompt table, the compiled update, ...),
`directory` (`RunDirectory`: the lock, the settings, checkpoints), `outputs` (`Outputs`:
exports, Hugging Face checkpoints, completion tables), and the loop
(`jaxppo.run.loop.run_loop`) is given them.

Words: an *iteration* is one pass of the stages (one rollout of `batch_size` completions);
an *update* is one optimizer step on one mini-batch (`ppo/updates_*`, `TrainState.step`);
`train_step` is the compiled function applying an iteration's updates; `Trainer.step()`
runs one iteration.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Sequence

import jax

from jaxppo.config.adapters import AdapterConfig
from jaxppo.config.legacy import PPOConfig, TrainerConfig, joined
from jaxppo.config.settings import SETTINGS, Config
from jaxppo.errors import RewardError, RunError
from jaxppo.models.lora import LoraConfig
from jaxppo.run import compiled, iteration, loop, report
from jaxppo.run.callbacks import call_hook, call_iteration_end
from jaxppo.run.directory import RunDirectory, run_settings
from jaxppo.run.evaluation import evaluate_due
from jaxppo.run.logger import Logger, tracked_settings
from jaxppo.run.parts import Inputs, build

__all__ = ["Trainer", "PPOTrainer", "RunError", "RewardError"]

# The Trainer keywords of 0.4 that are settings now, by their new name (a DeprecationWarning
# says so); `reward_fn` is `reward_fns` given one function.
_MOVED = {"dtype": "dtype", "ref_dtype": "ref_dtype", "reward_dtype": "reward_dtype", "remat": "remat",
          "scan_layers": "scan_layers", "logits_chunk_size": "logits_chunk_size", "mesh": "mesh",
          "prompt_column": "prompt_column", "chat_template": "chat_template", "optimizer": "transformation"}


class Trainer:
    """RLHF with PPO or a critic-free method (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++,
    GSPO: `Config.for_algorithm`): rollouts from prompts, rewards, and compiled `train_step`
    updates.

    Args (docs/ppo.md has the long form):
      config: a `jaxppo.Config` (every setting, by concern).
      policy: a local Hugging Face causal-LM directory, or `(Model, params)` (the trainer
        owns them: updates donate the old buffers; pass copies to keep yours).
      tokenizer: a transformers tokenizer (`jaxppo.models.load_tokenizer`).
      prompts: strings, chat messages or records with columns, a `datasets.Dataset`, a file
        path, or a stream (`jaxppo.rollout.load_prompts`, `mix_prompts`; `DataConfig`).
      reward_model: a local `...ForSequenceClassification` directory or `(Model, params)`.
      reward_fns: a reward function, or a list of them (one entry may be a reward model),
        weighted by `reward_weights` (default 1 each); called on text, `f(prompts,
        completions, **columns)` -> one number or None per completion, or with
        `reward_fn_on="tokens"` one jittable `fn(prompt_ids, prompt_mask, response_ids,
        response_mask) -> (B,)` (`jaxppo.rollout.rewards`).
      ref_policy: the frozen reference (default: a copy of the initial policy; none where
        no KL needs it). critic: PPO's critic (default: from the reward model, else the
        policy with a zero value head).
      callbacks: functions `cb(iteration, metrics)` or `jaxppo.Callback` objects; either may
        return a `jaxppo.Control` (stop, checkpoint now).
      environment: a factory of multi-turn environments (`jaxppo.rollout.environments`), or
        tools: functions the policy may call (`jaxppo.rollout.tools`).
      eval_prompts, eval_reward_fns: the evaluation during training (`EvalConfig`).
      teacher: on-policy distillation's teacher (`Config.for_algorithm("distill")`): a local
        causal-LM checkpoint or `(Model, params)` with the policy's vocabulary, frozen and
        scored in the reference's place (docs/rlhf-pipeline.md).

    0.4's spellings work for one more release, each with a `DeprecationWarning`:
    `Trainer(ppo_config, trainer_config, ...)`, `reward_fn=`, and the keywords that are
    settings now (`dtype`, `ref_dtype`, `reward_dtype`, `remat`, `scan_layers`,
    `logits_chunk_size`, `mesh`: `LayoutConfig`; `prompt_column`, `chat_template`:
    `DataConfig`; `optimizer`: `OptimizerConfig.transformation`; `lora` (a
    `jaxppo.models.LoraConfig`) and `lora_init`: `AdapterConfig`'s `lora_rank`,
    `lora_alpha`, `lora_targets`, `lora_init`).
    """

    def __init__(self, config, trainer_config: Optional[TrainerConfig] = None, /, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fns=None, reward_fn_on: str = "text",
                 reward_weights: Optional[Sequence[float]] = None, ref_policy=None, critic=None,
                 callbacks: Sequence[Callable] = (), environment: Optional[Callable] = None, tools: Optional[Sequence[Callable]] = None, eval_prompts=None,
                 eval_reward_fns: Optional[Sequence[Callable]] = None, teacher=None, **deprecated):
        config, reward_fns = _config_of(config, trainer_config, reward_fns, deprecated)
        self.parts = build(config, Inputs(policy, tokenizer, prompts, reward_model, reward_fns, reward_fn_on,
                                          reward_weights, ref_policy, critic, environment, tools,
                                          eval_prompts, eval_reward_fns, teacher))
        self.config, self.tokenizer, self.callbacks = self.parts.config, tokenizer, list(callbacks)
        self.run, self.train_step = self.parts.run, self.parts.train_step
        self.directory, self.outputs = RunDirectory(self.config.run), self.parts.outputs
        self.history, self.last, self._warned_unknown = [], None, False

    @property
    def state(self):
        """The `TrainState`: parameters, optimizer state, update counters."""
        return self.run.train

    @property
    def iteration(self) -> int:
        """Iterations completed (the next iteration's index)."""
        return self.run.iteration

    @property
    def policy_model(self):
        """The policy `jaxppo.models.Model`."""
        return self.parts.models.policy_model

    def policy_params(self):
        """The policy's parameters (of the current train state)."""
        return self.parts.spec.policy_params(self.state.params)

    def add_callback(self, callback):
        """Add a callback (a function `cb(iteration, metrics)` or a `jaxppo.Callback`), after
        those given."""
        self.callbacks.append(callback)

    def prompt_indices(self, it: int):
        """Rows of the prompt set behind the completions of iteration `it`
        (`jaxppo.run.iteration.prompt_rows`)."""
        return iteration.prompt_rows(self.parts.table, self.run.key, it, self.config)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> dict:
        """Run one iteration; return its metrics (floats)."""
        return self.prepare_iteration()().metrics

    def prepare_iteration(self):
        """Sample, reward, build and check the next iteration without touching the trainer
        (`jaxppo.run.iteration.prepare`); return `finish()`, which runs the update
        (`jaxppo.run.iteration.complete`: consuming the old train state, whose buffers are
        donated), installs the new run state and returns the iteration's `Outcome`. An
        interrupt before `finish` leaves the trainer as it was; the loop runs `finish` and
        the metrics write with interrupts held, so a checkpoint never holds an update whose
        metrics line is missing."""
        self.precompile()  # where train() has not started it already
        p, config = self.parts, self.config
        pipeline = p.pipeline  # sampled ahead by the producer, from version max(0, it - k)
        collect = p.collector.collect if pipeline is None else lambda run, it, key: pipeline.take(run)
        prepared = iteration.prepare(self.run, collect, p.spec, p.ref_params, p.reward_params, p.mesh)
        evaluated, eval_table = evaluate_due(p.evaluator, prepared, self.outputs.hf, p.reward_params)
        self._warn_unknown(prepared.iteration, prepared.collected.scores.unknown_tokens)
        iteration.check(prepared, p.rewards.source(), config.rewards.skip_nonfinite_scores, p.table.texts)

        def finish():
            outcome = iteration.complete(prepared, train_step=self.train_step, config=config, pipeline=pipeline,
                                         lr=p.policy_schedule, with_functions=p.host_rewards is not None,
                                         advantages=bool(config.run.sample_every and config.run.num_samples))
            data = ({"data/prompts_filtered": p.table.filtered} if config.data.overlong_prompts == "filter" else {})
            self.last = outcome._replace(metrics={**outcome.metrics, **data, **evaluated}, eval_table=eval_table)
            self.run = outcome.run
            pipeline and pipeline.push(self.run)
            return self.last

        return finish

    def precompile(self):
        """Start the update's compile in the background (once: `jaxppo.run.compiled.precompile`),
        so that it overlaps the first iteration's sampling and scoring; single-turn only."""
        p = self.parts
        if p.environment is None:
            self.train_step = compiled.precompile(self.train_step, p.spec, self.run, p.ref_params, p.reward_params,
                                                  p.table, self.config, p.host_rewards is not None, self.run.key,
                                                  p.mesh)

    def _warn_unknown(self, it: int, unknown: int):
        if unknown and not self._warned_unknown:
            self._warned_unknown = True
            warnings.warn(f"iteration {it}: the policy sampled {unknown} token ids that the tokenizer does not know "
                          f"(>= {len(self.tokenizer)}: its vocabulary of {self.policy_model.config.vocab_size} is "
                          "padded beyond the tokenizer's); the reward functions see them as the tokenizer's unknown "
                          "token (warned once)", RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ the run

    def train(self) -> list:
        """Run until `RunConfig.iterations` iterations are done; return the list of
        per-iteration metrics. Writes output_dir/metrics.jsonl (and the trackers'), prints
        progress and samples, checkpoints, and at the end exports the policy and plots.

        Before any compilation: takes the directory's lock (a second run on it is refused),
        checks the saved settings (`settings()`), restores the newest readable checkpoint.
        On Ctrl-C or SIGTERM: saves a checkpoint (a second Ctrl-C meanwhile is held off until
        the checkpoint is complete) and raises KeyboardInterrupt."""
        if self.parts.rollout_engine.closed:
            raise RuntimeError("this Trainer was closed (Trainer.close()): its rollout engine is shut down")
        self.run = self.directory.open(self.run, self.settings())
        self.precompile()  # from here the update compiles beside the run's other start-up work
        logger = Logger(self.directory.log_dir, start_iteration=self.iteration,
                        report_to=self.config.run.trackers if jax.process_index() == 0 else ("jsonl",),
                        config=tracked_settings(self.config))
        self.history = logger.history  # the lines of the iterations before this start, and this run's
        try:
            call_hook(self.callbacks, "on_train_begin", self)
            loop.run_loop(prepare=self.prepare_iteration, current=lambda: self.run, directory=self.directory,
                          outputs=self.outputs, logger=logger, run_config=self.config.run,
                          tables=lambda outcome: self.outputs.tables(self.parts.table.texts, outcome, self.iteration),
                          notify=lambda it, metrics: call_iteration_end(self.callbacks, self, it, metrics),
                          title=loop.headline(self.config, self.parts.spec.common_prefix),
                          description=self.config.advantages.advantage_estimator)
        finally:
            self.parts.pipeline and self.parts.pipeline.close()
            self.directory.close()
        loop.finish_run(current=lambda: self.run, directory=self.directory, outputs=self.outputs, logger=logger,
                        evaluate=self.evaluate if self.parts.evaluator is not None else None,
                        run_config=self.config.run, summary=self.summary)
        call_hook(self.callbacks, "on_train_end", self, self.history)
        return self.history

    def settings(self) -> dict:
        """What a resumed run must match (`jaxppo.run.directory.run_settings`)."""
        return run_settings(self.config, self.config.run.iterations, self.parts.description)

    def close(self):
        """Stop the producer of pipelined iterations (if any; `train()` does at its end: a
        later iteration starts a new one) and close the rollout engine (vLLM's: one may be
        open in a process at a time; `train()` keeps it for another call). Idempotent."""
        self.parts.pipeline and self.parts.pipeline.close()
        self.parts.rollout_engine.close()

    # ------------------------------------------------------------------ what it shows and writes

    def evaluate(self) -> dict:
        """The `eval/...` metrics of the current policy on the eval prompts (the evaluation
        an iteration starting now would run; `jaxppo.run.evaluation`)."""
        if self.parts.evaluator is None:
            raise RuntimeError("this Trainer has no eval_prompts to evaluate on")
        return self.parts.evaluator.evaluate(self.state.params, self.run.key, self.iteration,
                                             self.parts.reward_params)[0]

    def completion_table(self, n: int):
        """(columns, rows) of the first `n` completions of the last iteration (its "advantage"
        column when tables are on: `sample_every` and `num_samples`)."""
        return self.outputs.table(self.parts.table.texts, self.last, n)

    def samples(self, n: int):
        """(prompt, response) texts of the first `n` rows of the last iteration."""
        return [(row[0], row[1]) for row in self.completion_table(n)[1]]

    def export(self, path: str):
        """Save the current policy (and tokenizer) as a Hugging Face directory; a LoRA
        policy with its adapters merged into the base weights."""
        self.outputs.export(self.state.params, path)

    def summary(self) -> str:
        return report.summary(self.history, self.config, self.run, self.policy_model, self.policy_params())


def _config_of(config, trainer_config, reward_fns, deprecated: dict):
    """(the `Config`, the reward functions) of the arguments, 0.4's spellings translated with
    a `DeprecationWarning` naming the new place of each."""
    moved = {k: deprecated.pop(k) for k in list(deprecated) if k in _MOVED}
    adapters = {k: deprecated.pop(k) for k in ("lora", "lora_init") if k in deprecated}
    reward_fn = deprecated.pop("reward_fn", None)
    if deprecated:
        raise TypeError(f"Trainer() got unexpected keyword argument(s) {sorted(deprecated)}")
    if isinstance(config, (PPOConfig, TrainerConfig)) or trainer_config is not None:
        if not isinstance(config, PPOConfig) or not isinstance(trainer_config, (TrainerConfig, type(None))):
            raise TypeError(f"Trainer takes a jaxppo.Config (or, deprecated, a PPOConfig and a TrainerConfig), got "
                            f"{type(config).__name__}" + ("" if trainer_config is None else
                                                         f" and {type(trainer_config).__name__}"))
        warnings.warn("Trainer(ppo_config, trainer_config, ...) is deprecated since 0.5 (removed in 0.6): give one "
                      "jaxppo.Config", DeprecationWarning, stacklevel=3)
        config = joined(config, trainer_config)
    if not isinstance(config, Config):
        raise TypeError(f"config must be a jaxppo.Config, got {type(config).__name__}")
    if moved:
        config = config.replace(**{_MOVED[k]: v for k, v in moved.items()})
        warnings.warn("Trainer keywords that are settings now (deprecated since 0.5, removed in 0.6): "
                      + ", ".join(f"{k} -> Config.{SETTINGS[_MOVED[k]]}.{_MOVED[k]}" for k in moved),
                      DeprecationWarning, stacklevel=3)
    if adapters:
        config = config.replace(**_adapter_settings(**adapters))
        warnings.warn("Trainer(lora=, lora_init=) are settings since 0.5 (the keywords are removed in 0.6): "
                      "Config.lora (AdapterConfig: lora_rank, lora_alpha, lora_targets, lora_init)",
                      DeprecationWarning, stacklevel=3)
    if reward_fn is not None:
        if reward_fns is not None:
            raise ValueError("give reward_fn or reward_fns, not both (reward_fns=f is reward_fn=f)")
        warnings.warn("Trainer(reward_fn=f) is deprecated since 0.5 (removed in 0.6): give reward_fns=f",
                      DeprecationWarning, stacklevel=3)
        reward_fns = reward_fn
    return config, reward_fns


def _adapter_settings(lora=None, lora_init=None) -> dict:
    """The `AdapterConfig` settings of 0.4's `Trainer(lora=LoraConfig, lora_init=path)`."""
    if lora is not None and not isinstance(lora, LoraConfig):
        raise TypeError(f"lora must be a jaxppo.models.LoraConfig or None, got {type(lora).__name__}")
    return AdapterConfig.of(lora, None if lora_init is None else os.fspath(lora_init))


def PPOTrainer(*args, **kwargs) -> Trainer:  # noqa: N802
    """Deprecated since 0.5 (removed in 0.6): `jaxppo.Trainer` (the same class)."""
    warnings.warn("jaxppo.PPOTrainer is deprecated since 0.5 and will be removed in 0.6: use jaxppo.Trainer (the same "
                  "trainer, for PPO and every critic-free method)", DeprecationWarning, stacklevel=2)
    return Trainer(*args, **kwargs)
