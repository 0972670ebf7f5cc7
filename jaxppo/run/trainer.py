"""`Trainer`: RLHF with PPO or a critic-free method, coordinating the parts of a run.

    trainer = jaxppo.Trainer(config, policy=..., tokenizer=..., prompts=..., reward_fns=...)
    trainer.train()          # every iteration, with checkpoints, logs, evaluation, exports
    trainer.step()           # or one iteration at a time

One iteration is `jaxppo.run.iteration`'s stages, in the order the data flows: select
prompts -> sample -> reward -> build the rollout (the forward pass) -> evaluate -> check ->
update -> metrics (`iteration.prepare` runs the first six, `iteration.complete` the rest).
Everything carried from one iteration to the next is one `RunState` (`run`), which is what
a checkpoint holds; the keys of iteration i are `fold_in(key(seed), i)` and its prompts are
a function of i, so a run resumed from a checkpoint produces exactly the metrics of an
uninterrupted one.

The trainer is a facade over the run's parts, each an object of its own: the `Session`
(`jaxppo.run.session`: the `RunParts` (models, rollout spec and engine, prompt table,
compiled update, ...) and the `RunState` reached), the `RunDirectory` (the lock, the
settings, checkpoints), the `Outputs` (exports, Hugging Face checkpoints, completion
tables), the logger and the callbacks; the loop (`jaxppo.run.loop.run_loop`) is given them.

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
from jaxppo.run import iteration, loop
from jaxppo.run.callbacks import Hooks
from jaxppo.run.directory import RunDirectory, run_settings
from jaxppo.run.logger import Logger, tracked_settings
from jaxppo.run.parts import Inputs, build
from jaxppo.run.session import Session

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
        parts = build(config, Inputs(policy, tokenizer, prompts, reward_model, reward_fns, reward_fn_on, reward_weights,
                                     ref_policy, critic, environment, tools, eval_prompts, eval_reward_fns, teacher))
        self.session = Session(parts, parts.run)
        self.config, self.tokenizer, self.callbacks = parts.config, tokenizer, list(callbacks)
        self.directory, self.outputs, self.history = RunDirectory(self.config.run), parts.outputs, []

    @property
    def parts(self):
        """The run's parts (`jaxppo.run.parts.RunParts`)."""
        return self.session.parts

    @property
    def run(self):
        """The `RunState` reached: everything carried to the next iteration."""
        return self.session.run

    @run.setter
    def run(self, run):
        self.session.run = run

    @property
    def last(self):
        """The last iteration's `jaxppo.run.iteration.Outcome` (None before the first)."""
        return self.session.last

    @property
    def train_step(self):
        """The compiled update (`jaxppo.run.compiled`)."""
        return self.parts.train_step

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

    def step(self) -> dict:
        """Run one iteration (`jaxppo.run.iteration.prepare`, then `complete`); return its
        metrics (floats)."""
        return self.session.step().metrics

    def precompile(self):
        """Start the update's compile in the background (once: `jaxppo.run.compiled.precompile`),
        so that it overlaps the first iteration's sampling and forward pass; single-turn only."""
        self.session.precompile()

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
        session, run_config = self.session, self.config.run
        session.run = self.directory.open(session.run, self.settings())
        session.precompile()  # from here the update compiles beside the run's other start-up work
        logger = Logger(self.directory.log_dir, start_iteration=self.iteration,
                        report_to=run_config.trackers if jax.process_index() == 0 else ("jsonl",),
                        config=tracked_settings(self.config))
        self.history = logger.history  # the lines of the iterations before this start, and this run's
        hooks = Hooks(self.callbacks, self)
        try:
            hooks.begin()
            loop.run_loop(session, directory=self.directory, logger=logger, hooks=hooks, run_config=run_config)
        finally:
            self.parts.pipeline and self.parts.pipeline.close()
            self.directory.close()
        loop.finish_run(session, directory=self.directory, logger=logger, run_config=run_config)
        hooks.end(self.history)
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
        return self.session.evaluate()

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
        return self.session.summary(self.history)


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
