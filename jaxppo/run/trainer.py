"""`Trainer` (also `PPOTrainer`): the loop around one iteration's stages, for PPO and the
critic-free family.

Each iteration runs the stages of `jaxppo.run.stages`: select prompts (`batch_size /
num_generations` of them, shuffled per dataset epoch with the PRNG key, each sampled
`num_generations` times) -> sample (compiled) -> score (text reward functions on the host)
-> build the rollout (compiled: log-probs, reference, values with a critic, scores,
KL-shaped rewards) -> update (one compiled `train_step` of `ppo_epochs * batch_size /
mini_batch_size` optimizer updates, then the KL controller's step). Everything carried
from one iteration to the next is one `RunState`, which is what a checkpoint holds; the
keys of iteration i are `fold_in(key(seed), i)` and its prompts are a function of i, so a
run resumed from a checkpoint produces exactly the metrics of an uninterrupted one.

The trainer itself is the loop: progress, signals, logging, checkpoints, callbacks, export.
Model assembly (assembly), rewards (rewards), prompts (prompts), checkpoints and the run
directory (resume), export (export) and reports (report) live beside it.

Words: an *iteration* is one pass of the stages (one rollout of `batch_size` completions);
an *update* is one optimizer step on one mini-batch (`ppo/updates_*`, `TrainState.step`);
`train_step` is the compiled function applying an iteration's updates; `Trainer.step()`
runs one iteration.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jaxppo.config import PPOConfig
from jaxppo.errors import RewardError, RunError
from jaxppo.rollout.prompts import load_prompts
from jaxppo.run import export as exporting
from jaxppo.run import report, save_restore, stages, watch
from jaxppo.run.directory import make_output_dir
from jaxppo.run.callbacks import call_hook
from jaxppo.run.iteration import check_scores, complete, evaluate, prepare
from jaxppo.run.logger import Logger, tracked_settings
from jaxppo.run.loop import finish_run, run_loop
from jaxppo.run.parts import build
from jaxppo.trainer_config import TrainerConfig

__all__ = ["TrainerConfig", "Trainer", "PPOTrainer", "load_prompts", "RunError", "RewardError"]


class Trainer(save_restore.Resumable, exporting.Exportable, watch.Watchable):
    """RLHF with PPO or a critic-free method (GRPO, Dr. GRPO, DAPO, RLOO, REINFORCE++,
    GSPO: `PPOConfig.advantage_estimator` and its neighbours): rollouts from prompts,
    rewards, and compiled `train_step` updates.

    Args:
      config: `PPOConfig` (sizes, algorithm, clipping, coefficients, `kl_coef`,
        `temperature`; `PPOConfig.for_algorithm(name)` for a method's defaults).
      trainer_config: `TrainerConfig`.
      policy: a local Hugging Face causal-LM directory, or `(Model, params)`. The trainer
        owns the parameters it trains: each update donates the old train state's buffers,
        so arrays passed in `(Model, params)` (policy, critic) are invalid after the first
        iteration; pass `jax.tree.map(jnp.copy, params)` to keep yours.
      tokenizer: a transformers tokenizer (see `jaxppo.models.load_tokenizer`).
      prompts: list of strings, a `datasets.Dataset`, or a file path (see `load_prompts`).
      reward_model: a local `...ForSequenceClassification` directory or `(Model, params)`
        of kind "reward"; or
      reward_fn: a Python function. With `reward_fn_on="text"` (default) it is called
        outside jit as `reward_fn(prompts: list[str], responses: list[str], **columns)
        -> (B,)`; with `reward_fn_on="tokens"` it is jitted: `fn(prompt_ids, prompt_mask,
        response_ids, response_mask) -> (B,)`; or
      reward_fns: several text reward functions (one entry may be a reward model: a path or
        `(Model, params)`), combined as the sum of `reward_weights[i] * f_i` (default
        weights 1). Each is called as `f(prompts, completions, **columns)` with the prompt
        dataset's other columns that it accepts; None for a row means no opinion (see
        `jaxppo.rollout.rewards`). Metrics `rewards/<name>/mean` and `/std` per function.
      ref_policy: the frozen reference; default: a copy of the initial policy. None is
        built when nothing uses it (kl_coef and kl_loss_coef 0, no kl_target).
      critic: a local directory or `(Model, params)` for the critic (separate trunk);
        default: initialised from the reward model when it is a model, else from the
        policy (value head at zero). Ignored with `shared_trunk`. Only PPO ("gae") has a
        critic; the critic-free algorithms refuse one.
      dtype: compute dtype of models loaded from paths ("float32", "bfloat16", "float16").
        Trained models (policy, critic) keep float32 master parameters and optimizer
        states whatever the compute dtype; log-softmax is computed in float32.
      ref_dtype, reward_dtype: compute and storage dtype of the frozen reference and
        reward model (default: `dtype`); "bfloat16" halves their memory.
      prompt_column: column or field holding prompts in datasets and JSON files. A prompt
        may be a list of chat messages ({"role", "content"} dicts), rendered with the
        tokenizer's chat template (see `jaxppo.rollout.prompts.render_prompts`); reward functions
        then receive the messages as `prompts`.
      chat_template: None renders chat-message prompts with the tokenizer's template (an
        error when it has none); False refuses them; True is None made explicit.
      callbacks: functions `cb(iteration, metrics)` called after each iteration, or objects
        with the hooks of `jaxppo.Callback` (`on_train_begin`, `on_iteration_end`,
        `on_train_end`); either may return a `jaxppo.Control` to stop the run (saved,
        resumable) or save a checkpoint now (`jaxppo.run.callbacks`).
      remat, scan_layers, logits_chunk_size: the models' memory and compile-time settings
        (see `jaxppo.models.Model`; they change memory and compute, not results): remat
        of the trained models' blocks (False, True or a `jax.checkpoint_policies` name;
        None keeps each model's own), blocks as one scan over stacked layers (True or
        False; "auto", the default: the layout of the run being resumed, else scanned for a
        checkpoint path of `jaxppo.run.assembly.AUTO_SCAN_MIN_LAYERS` (16) layers or more, as
        given for a `(Model, params)` pair; None: as loaded or given), and the LM head's chunk
        of response positions.
      lora: a `jaxppo.models.LoraConfig`: train low-rank adapters instead of all weights.
        The base is frozen (held in `dtype`), the reference is the same weights with the
        adapters off, checkpoints hold the adapters (and critic), and the final export
        writes `final_policy/` (merged) and `final_adapter/` (PEFT format).
      lora_init: a PEFT LoRA adapter directory to start from (its rank, alpha and targets
        apply); the reference is then the base model.
      mesh: None (one device), a `jaxppo.sharding.MeshConfig`, or a `jax.sharding.Mesh`
        with axes ("data", "fsdp", "tensor"): parameters and optimizer states are sharded
        by `jaxppo.sharding.tree_shardings`, rollout rows split over the data axes.
      environment: a factory of multi-turn environments (`jaxppo.rollout.environments`): each
        episode calls `factory()`, `reset(prompt, **columns)`, then `step(turn text) ->
        jaxppo.StepResult(observation, reward, done)` after every model turn; the
        environments' rewards add to the score (no other reward is then needed). Turns,
        timeouts and faults: `TrainerConfig.max_turns` and neighbours.
      tools: functions the policy may call (`jaxppo.rollout.tools`; instead of `environment`):
        shown to the model through the chat template (`tools=`), called when a turn holds
        tool calls, their results returned as "tool" messages; a turn without a call ends
        the episode. Needs chat-message prompts.
      eval_prompts: prompts to evaluate the policy on during training (the forms `prompts`
        takes, columns included; `TrainerConfig.eval_every` and neighbours say when and
        how): `eval/...` metrics in the iteration's line (`jaxppo.run.evaluation`).
      eval_reward_fns: the text reward functions that score the evaluation (default: the
        run's own text reward functions).
      optimizer: an optax `GradientTransformation`, or a function of the learning-rate
        schedule returning one, instead of the built-in Adam / AdamW (`TrainerConfig`'s
        `weight_decay`, betas, schedule); `max_grad_norm` clipping still comes first.
    """

    def __init__(self, config: PPOConfig, trainer_config: TrainerConfig, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fn: Optional[Callable] = None, reward_fn_on: str = "text",
                 reward_fns: Optional[Sequence] = None, reward_weights: Optional[Sequence[float]] = None,
                 ref_policy=None, critic=None, dtype: str = "float32", ref_dtype: Optional[str] = None,
                 reward_dtype: Optional[str] = None, prompt_column: str = "prompt",
                 callbacks: Sequence[Callable] = (), mesh=None, remat=None, scan_layers="auto",
                 logits_chunk_size: Optional[int] = None, chat_template: Optional[bool] = None,
                 lora=None, lora_init: Optional[str] = None, environment: Optional[Callable] = None,
                 tools: Optional[Sequence[Callable]] = None, eval_prompts=None,
                 eval_reward_fns: Optional[Sequence[Callable]] = None, optimizer=None):
        if not isinstance(config, PPOConfig):
            raise TypeError(f"config must be a jaxppo.PPOConfig, got {type(config).__name__}")
        if not isinstance(trainer_config, TrainerConfig):
            raise TypeError(f"trainer_config must be a jaxppo.TrainerConfig, got {type(trainer_config).__name__}")
        parts = build(config, trainer_config, policy=policy, tokenizer=tokenizer, prompts=prompts,
                      reward_model=reward_model, reward_fn=reward_fn, reward_fn_on=reward_fn_on, reward_fns=reward_fns,
                      reward_weights=reward_weights, ref_policy=ref_policy, critic=critic, dtype=dtype,
                      ref_dtype=ref_dtype, reward_dtype=reward_dtype, prompt_column=prompt_column, mesh=mesh,
                      remat=remat, scan_layers=scan_layers, logits_chunk_size=logits_chunk_size,
                      chat_template=chat_template, lora=lora, lora_init=lora_init, environment=environment,
                      tools=tools, eval_prompts=eval_prompts, eval_reward_fns=eval_reward_fns, optimizer=optimizer)
        self.parts, self.config, self.tc, self.tokenizer = parts, parts.config, trainer_config, tokenizer
        self.callbacks, self.iterations, self.run = list(callbacks), parts.iterations, parts.run
        self.table, self.prompt_ids, self.prompt_mask = parts.table, parts.table.ids, parts.table.mask
        self.policy_model, self.reward_model = parts.models.policy_model, parts.models.reward_model
        self.history, self.last, self._warned_unknown, self.train_step = [], None, False, parts.train_step

    # What the run is made of (`RunParts`), by the names they have always had.
    environment = property(lambda self: self.parts.environment, doc="The multi-turn environment, or None.")
    rewards = property(lambda self: self.parts.rewards, doc="The reward sources.")
    host_rewards = property(lambda self: self.parts.host_rewards, doc="The text reward functions, or None.")
    spec = property(lambda self: self.parts.spec, doc="The `RolloutSpec`.")
    rollout_engine = property(lambda self: self.parts.rollout_engine, doc="The `RolloutEngine`.")
    collector = property(lambda self: self.parts.collector, doc="What samples and scores an iteration.")
    pipelined = property(lambda self: self.parts.pipelined, doc="The producer of pipelined iterations, or None.")
    mesh = property(lambda self: self.parts.mesh, doc="The trainer's mesh, or None.")
    sampler_mesh = property(lambda self: self.parts.sampler_mesh, doc="The sampler's mesh (`sampler_devices`), or None.")
    ref_params = property(lambda self: self.parts.ref_params, doc="The reference's frozen parameters, or None.")
    reward_params = property(lambda self: self.parts.reward_params, doc="The reward model's parameters, or None.")
    policy_schedule = property(lambda self: self.parts.policy_schedule, doc="The policy's learning rate by update.")
    description = property(lambda self: self.parts.description, doc="What a resumed run must match.")
    hf_checkpoints = property(lambda self: self.parts.hf_checkpoints, doc="The Hugging Face checkpoints of the run.")


    # The run state's parts, by the names they have always had.
    state = property(lambda self: self.run.train, doc="The `TrainState` (parameters, optimizer, update counters).")
    kl_state = property(lambda self: self.run.kl, doc="The KL controller's state.")
    score_moments = property(lambda self: self.run.score_moments, doc="Running moments of the scores.")
    iteration = property(lambda self: self.run.iteration, doc="Iterations completed.")
    skipped_iterations = property(lambda self: self.run.skipped_iterations, doc="Iterations skipped (non-finite).")

    def add_callback(self, callback):
        """Add a callback (a function `cb(iteration, metrics)` or a `jaxppo.Callback`), after
        those given."""
        self.callbacks.append(callback)

    def prompt_indices(self, iteration: int) -> np.ndarray:
        """Rows of the prompt set behind the completions of `iteration` (see
        `jaxppo.run.stages.prompt_rows`)."""
        return stages.prompt_rows(self.table, self.run.key, iteration, self.config)

    # ------------------------------------------------------------------ one iteration

    def step(self):
        """Run one iteration; return its metrics (floats)."""
        return self.prepare_iteration()()

    def prepare_iteration(self):
        """Sample, score and build the rollout of the next iteration without touching the
        trainer (`jaxppo.run.iteration.prepare`); return `finish()`, which runs the update
        (`jaxppo.run.iteration.complete`: consuming the old train state, whose buffers are donated),
        installs the new run state and returns the metrics. An interrupt before `finish`
        leaves the trainer as it was; the loop runs `finish` and the metrics write with
        interrupts held, so a checkpoint never holds an update whose metrics line is missing."""
        self.precompile()  # where train() has not started it already
        pipelined = self.pipelined  # sampled ahead by the producer, from version max(0, it - k)
        collect = self.collector.collect if pipelined is None else lambda run, it, key: pipelined.take(run)
        prepared = prepare(self.run, collect, self.spec, self.ref_params, self.reward_params, self.mesh)
        evaluated, eval_table = evaluate(prepared, self.parts.evaluator, self.hf_checkpoints,  # before the update
                                         self.reward_params)
        self._warn_unknown(prepared.iteration, prepared.scores.unknown_tokens)
        check_scores(prepared, self.rewards.source(), self.tc.skip_nonfinite_scores, self.table.texts)

        def finish():
            outcome = complete(prepared, train_step=self.train_step, config=self.config, pipelined=pipelined,
                               lr=self.policy_schedule, with_functions=self.host_rewards is not None,
                               advantages=bool(self.tc.sample_every and self.tc.num_samples))
            data = {"data/prompts_filtered": self.table.filtered} if self.tc.overlong == "filter" else {}
            self.last = outcome._replace(metrics={**outcome.metrics, **data, **evaluated}, eval_table=eval_table)
            self.run = outcome.run
            pipelined and pipelined.push(self.run)
            return self.last.metrics

        return finish

    def close(self):
        """Stop the producer of pipelined iterations (if any; `train()` does at its end: a
        later iteration starts a new one) and close the rollout engine (vLLM's: one may be
        open in a process at a time; `train()` keeps it for another call). Idempotent."""
        self.pipelined and self.pipelined.close()
        self.rollout_engine.close()

    def precompile(self):
        """Start the update's compile in the background (once: see `stages.precompile`), so
        that it overlaps the first iteration's sampling and scoring; single-turn only."""
        if self.environment is None:
            self.train_step = stages.precompile(self.train_step, self.spec, self.run, self.ref_params,
                                                self.reward_params, self.table, self.config,
                                                self.host_rewards is not None, self.run.key)

    def _warn_unknown(self, it: int, unknown: int):
        if unknown and not self._warned_unknown:
            self._warned_unknown = True
            warnings.warn(_unknown_tokens_message(it, unknown, self.tokenizer, self.policy_model), RuntimeWarning,
                          stacklevel=4)

    # ------------------------------------------------------------------ the loop

    def train(self):
        """Run until `iterations` iterations are done; return the list of per-iteration
        metrics. Writes output_dir/metrics.jsonl (and TensorBoard events), prints progress
        and samples, checkpoints, and at the end exports the policy and plots.

        Before any compilation: takes the directory's lock (a second run on it is refused),
        checks the saved settings (`settings()`), restores the newest readable checkpoint.
        On Ctrl-C or SIGTERM: saves a checkpoint (a second Ctrl-C meanwhile is held off until
        the checkpoint is complete) and raises KeyboardInterrupt."""
        if self.rollout_engine.closed:
            raise RuntimeError("this Trainer was closed (Trainer.close()): its rollout engine is shut down")
        make_output_dir(self.tc.output_dir)
        self.open_run()
        self.precompile()  # from here the update compiles beside the run's other start-up work
        logger = Logger(save_restore.log_dir(self.tc), start_iteration=self.iteration,
                        report_to=self.tc.trackers if jax.process_index() == 0 else ("jsonl",),
                        config=tracked_settings(self.config, self.tc, self.iterations))
        self.history = logger.history  # the lines of the iterations before this start, and this run's
        try:
            call_hook(self.callbacks, "on_train_begin", self)
            run_loop(self, logger)
        finally:
            self.pipelined and self.pipelined.close()
            self.close_run()
        finish_run(self, logger)
        call_hook(self.callbacks, "on_train_end", self, self.history)
        return self.history

    # ------------------------------------------------------------------ output

    def summary(self) -> str:
        return report.summary(self)


PPOTrainer = Trainer  # the documented name since 0.1: the same class, for PPO and every critic-free method


def _unknown_tokens_message(it, unknown, tokenizer, policy_model) -> str:
    return (f"iteration {it}: the policy sampled {unknown} token ids that the tokenizer does not know (>= "
            f"{len(tokenizer)}: its vocabulary of {policy_model.config.vocab_size} is padded beyond the tokenizer's); "
            "the reward functions see them as the tokenizer's unknown token (warned once)")
