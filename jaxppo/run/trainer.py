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

import functools
import os
import time
import warnings
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from jaxppo import sharding
from jaxppo.config import PPOConfig
from jaxppo.errors import RewardError, RunError
from jaxppo.models.tokenizer import decode_responses, encode_prompts
from jaxppo.rollout import vllm as vllm_engine
from jaxppo.rollout.environments import EnvironmentSpec
from jaxppo.rollout.prompts import PromptTable, load_prompt_table, load_prompts, render_prompts
from jaxppo.rollout.rewards import sort_rewards
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.rollout.tools import check_tools, tool_environment
from jaxppo.run import export as exporting
from jaxppo.run import pipeline as pipelining
from jaxppo.run import report, resume, stages
from jaxppo.run.assembly import LogitsOf, assemble, optimizer, prompts_digest, schedule
from jaxppo.run.collect import Collector
from jaxppo.run.loop import finish_run, run_loop
from jaxppo.run.state import RunState
from jaxppo.sharding import to_host
from jaxppo.trainer_config import TrainerConfig
from jaxppo.update.engine import TrainState
from jaxppo.update.ppo import train_step_donating

__all__ = ["TrainerConfig", "Trainer", "PPOTrainer", "load_prompts", "RunError", "RewardError"]


class Trainer(resume.Resumable):
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
      callbacks: functions `cb(iteration, metrics)` called after each iteration.
      remat, scan_layers, logits_chunk_size: the models' memory and compile-time settings
        (see `jaxppo.models.Model`; they change memory and compute, not results): remat
        of the trained models' blocks (False, True or a `jax.checkpoint_policies` name;
        None keeps each model's own), blocks as one scan over stacked layers (None: as
        loaded or given), and the LM head's chunk of response positions.
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
    """

    def __init__(self, config: PPOConfig, trainer_config: TrainerConfig, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fn: Optional[Callable] = None, reward_fn_on: str = "text",
                 reward_fns: Optional[Sequence] = None, reward_weights: Optional[Sequence[float]] = None,
                 ref_policy=None, critic=None, dtype: str = "float32", ref_dtype: Optional[str] = None,
                 reward_dtype: Optional[str] = None, prompt_column: str = "prompt",
                 callbacks: Sequence[Callable] = (), mesh=None, remat=None, scan_layers: Optional[bool] = None,
                 logits_chunk_size: Optional[int] = None, chat_template: Optional[bool] = None,
                 lora=None, lora_init: Optional[str] = None, environment: Optional[Callable] = None,
                 tools: Optional[Sequence[Callable]] = None):
        if not isinstance(config, PPOConfig):
            raise TypeError(f"config must be a jaxppo.PPOConfig, got {type(config).__name__}")
        if not isinstance(trainer_config, TrainerConfig):
            raise TypeError(f"trainer_config must be a jaxppo.TrainerConfig, got {type(trainer_config).__name__}")
        self.environment = _environment(environment, tools, trainer_config)
        self.rewards = sort_rewards(reward_model, reward_fn, reward_fn_on, reward_fns, reward_weights,
                                    environment=self.environment is not None)
        _check_settings(config, trainer_config, self.rewards, self.environment, mesh)
        config = config.replace(share_prompts=True) if config.share_prompts is None else config  # groups share prompts
        self.config, self.tc, self.tokenizer, self.callbacks = config, trainer_config, tokenizer, list(callbacks)
        self.iterations = _iterations(config, trainer_config)
        self.table = _prompt_table(tokenizer, prompts, prompt_column, chat_template, trainer_config,
                                   self.environment and self.environment.tools)
        self.prompt_ids, self.prompt_mask = self.table.ids, self.table.mask
        built = assemble(config, trainer_config, policy=policy, reward_model=self.rewards.model_spec,
                         ref_policy=ref_policy, critic=critic, dtype=dtype, ref_dtype=ref_dtype,
                         reward_dtype=reward_dtype, remat=remat, scan_layers=scan_layers,
                         logits_chunk_size=logits_chunk_size, lora=lora, lora_init=lora_init)
        self._policy_source = policy if isinstance(policy, (str, os.PathLike)) else None
        self.policy_model, self.reward_model = built.policy_model, built.reward_model
        self.ref_params, self.reward_params = built.ref_params, built.reward_params
        _check_vocabulary(tokenizer, self.policy_model)
        self.host_rewards = self.rewards.host_rewards()
        self.spec = _rollout_spec(config, trainer_config, built, tokenizer, self.rewards, self.table.ids.shape[1])
        self.engine = vllm_engine.create(trainer_config, self.spec, built.params, self.table.ids.shape[1])
        self.policy_schedule, tx = _optimizer(config, trainer_config, self.iterations)
        train = TrainState.create(apply_fn=built.apply_fn, params=built.params, tx=tx, freeze=built.freeze)
        self.run = _run_state(config, trainer_config, train)
        self.mesh, make_step = None, lambda c: functools.partial(train_step_donating, config=c)
        mesh, self.sampler_mesh = _split_mesh(mesh, trainer_config, config)
        if mesh is not None:
            self.mesh, self.run, self.ref_params, self.reward_params, make_step = sharding.place_run(
                mesh, config, self.run, self.ref_params, self.reward_params)
        self.train_step = stages.update_step(make_step, config)
        self.collector = Collector(config, trainer_config, self.spec, self.table, tokenizer, self.host_rewards,
                                   self.environment, self.engine, self.mesh)
        self.pipelined = None
        if trainer_config.max_staleness:
            self.pipelined = pipelining.Pipelined(self.collector, self.table, self.mesh, self.sampler_mesh,
                                                  trainer_config.max_staleness, self.iterations, self.run.train)
            self.run = self.pipelined.initial(self.run)
        self.history, self.last_samples, self._warned_unknown = [], None, False
        self.description = {**built.description, "reward": self.rewards.describe(self.reward_model, dtype),
                          "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer)},
                          "prompts": prompts_digest(self.table.texts), "prompt_column": prompt_column,
                          **({} if self.environment is None else {"environment": self.environment.name})}

    # The run state's parts, by the names they have always had.
    state = property(lambda self: self.run.train, doc="The `TrainState` (parameters, optimizer, update counters).")
    kl_state = property(lambda self: self.run.kl, doc="The KL controller's state.")
    score_moments = property(lambda self: self.run.score_moments, doc="Running moments of the scores.")
    iteration = property(lambda self: self.run.iteration, doc="Iterations completed.")
    skipped_iterations = property(lambda self: self.run.skipped_iterations, doc="Iterations skipped (non-finite).")

    def prompt_indices(self, iteration: int) -> np.ndarray:
        """Rows of the prompt set behind the completions of `iteration` (see
        `jaxppo.run.stages.prompt_rows`)."""
        return stages.prompt_rows(len(self.table.prompts), self.run.key, iteration, self.config)

    # ------------------------------------------------------------------ one iteration

    def step(self):
        """Run one iteration; return its metrics (floats)."""
        return self.prepare_iteration()()

    def prepare_iteration(self):
        """Sample, score and build the rollout of the next iteration without touching the
        trainer; return `finish()`, which runs the update (consuming the old train state,
        whose buffers are donated), installs the new run state and returns the metrics. An
        interrupt before `finish` leaves the trainer as it was; the loop runs `finish` and
        the metrics write with interrupts held, so a checkpoint never holds an update whose
        metrics line is missing."""
        run = self.run
        it = run.iteration
        k_sample, k_train = run.iteration_keys(it)
        t0 = time.perf_counter()
        self.precompile()  # where train() has not started it already
        if self.pipelined is not None:  # sampled ahead by the producer, from version max(0, it - k)
            batch, gen, episodes, scores, extra, consumed = self.pipelined.take(run)
        else:
            batch, gen, episodes, scores, extra, consumed = self.collector.collect(run, it, k_sample)
        self._warn_unknown(it, scores.unknown_tokens)
        t1 = time.perf_counter()
        built = stages.build_rollout(self.spec, run.train.params, self.ref_params, self.reward_params, batch, gen,
                                     scores, run, self.mesh)
        t2 = time.perf_counter()
        bad = stages.bad_rows(built)
        if bad.size:
            return _skipping(self, it, batch, gen, built, bad, t0, consumed)

        def finish():
            new_run, device = stages.update(run, built, k_train, self.train_step, self.config)
            new_run = _advance(self.pipelined, run, new_run.replace(prompts_consumed=consumed))
            host = jax.device_get(device)  # every metric of the iteration in one transfer
            host.update({**(episodes.metrics if episodes is not None else {}), **extra})
            t3 = time.perf_counter()
            self.run, self.last_samples = new_run, (batch.rows, gen)
            self.pipelined and self.pipelined.push(self.run)
            return report.iteration_metrics(self, it, host, built.raw_scores, scores.per_function, built.model_scores,
                                            (t0, t1, t2, t3))

        return finish

    def close(self):
        """Stop the producer of pipelined iterations (if any; `train()` does at its end: a
        later iteration starts a new one) and shut the vLLM engine down (if any: one may be
        open in a process at a time; `train()` keeps it for another call). Idempotent."""
        self.pipelined and self.pipelined.close()
        self.engine and self.engine.close()

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

    def samples(self, n: int):
        """(prompt, response) texts of the first `n` rows of the last iteration."""
        rows, gen = self.last_samples
        mask = getattr(gen, "attention_mask", gen.mask)  # a multi-turn episode: the whole conversation
        responses = decode_responses(self.tokenizer, to_host(gen.tokens)[:n], to_host(mask)[:n])
        return [(self.table.texts[r], text) for r, text in zip(rows[:n], responses)]

    # ------------------------------------------------------------------ the loop

    def train(self):
        """Run until `iterations` iterations are done; return the list of per-iteration
        metrics. Writes output_dir/metrics.jsonl (and TensorBoard events), prints progress
        and samples, checkpoints, and at the end exports the policy and plots.

        Before any compilation: takes the directory's lock (a second run on it is refused),
        checks the saved settings (`settings()`), restores the newest readable checkpoint.
        On Ctrl-C or SIGTERM: saves a checkpoint (a second Ctrl-C meanwhile is held off until
        the checkpoint is complete) and raises KeyboardInterrupt."""
        vllm_engine.check_not_closed(self.engine)
        os.makedirs(self.tc.output_dir, exist_ok=True)
        self.open_run()
        self.precompile()  # from here the update compiles beside the run's other start-up work
        try:
            logger = run_loop(self)
        finally:
            self.pipelined and self.pipelined.close()
            self.close_run()
        finish_run(self, logger)
        return self.history

    # ------------------------------------------------------------------ output

    def policy_params(self):
        return self.spec.policy_params(self.state.params)

    def export(self, path: str):
        """Save the current policy (and tokenizer) as a Hugging Face directory; a LoRA
        policy with its adapters merged into the base weights."""
        exporting.export_policy(self.policy_model, self.policy_params(), self.tokenizer, path,
                                drop_value_head=self.tc.shared_trunk)

    def export_adapter(self, path: str):
        """Save a LoRA policy's adapters in PEFT's format for the base checkpoint it was
        loaded from."""
        exporting.export_adapter(self.policy_model, self.policy_params(), path, self._policy_source)

    def summary(self) -> str:
        return report.summary(self)


PPOTrainer = Trainer  # the documented name since 0.1: the same class, for PPO and every critic-free method


def _skipping(trainer, it, batch, gen, built, bad, t0, consumed):
    """An iteration of `trainer` with non-finite scores: a `RewardError` (nothing updated),
    or with skip_nonfinite_scores a `finish` that skips the iteration (`jaxppo.run.stages.skip`)."""
    source = trainer.rewards.source()
    if not trainer.tc.skip_nonfinite_scores:
        raise stages.nonfinite_error(it, source, built, bad, [trainer.table.texts[r] for r in batch.rows])
    warnings.warn(f"iteration {it} skipped: {source} gave non-finite scores at rows {bad[:5].tolist()}",
                  RuntimeWarning, stacklevel=4)

    def finish():
        skipped = stages.skip(trainer.run).replace(prompts_consumed=consumed)
        trainer.run = _advance(trainer.pipelined, trainer.run, skipped)
        trainer.last_samples = (batch.rows, gen)
        trainer.pipelined and trainer.pipelined.push(trainer.run)
        return {"iteration": it, "episode": (it + 1) * trainer.config.batch_size, "ppo/updates_applied": 0,
                "ppo/updates_total": int(trainer.state.step), "objective/nonfinite_score_rows": int(bad.size),
                "objective/skipped_nonfinite_scores": trainer.skipped_iterations,
                "time/generation": time.perf_counter() - t0}

    return finish


def _advance(pipelined, run, new_run):
    return new_run if pipelined is None else pipelined.advance(run, new_run)


def _check_settings(config: PPOConfig, tc: TrainerConfig, rewards, environment, mesh):
    _check_dynamic_sampling(config, tc, rewards)
    if tc.inflight_updates and environment is not None:
        raise ValueError(f"TrainerConfig.inflight_updates={tc.inflight_updates!r} works on single-turn rollouts; "
                         "multi-turn episodes (an environment or tools) sample every turn from one version: set "
                         "inflight_updates=None")
    if tc.max_staleness and jax.process_count() > 1:
        raise ValueError(f"TrainerConfig.max_staleness={tc.max_staleness}: pipelined iterations run in one process; "
                         f"this run has {jax.process_count()} (multi-host runs are synchronous: max_staleness=0)")
    if tc.rollout_engine == "vllm":
        vllm_engine.check_settings(tc, environment is not None, mesh)


def _check_dynamic_sampling(config: PPOConfig, tc: TrainerConfig, rewards):
    if not tc.dynamic_sampling:
        return
    if config.num_generations < 2:
        raise ValueError(f"TrainerConfig.dynamic_sampling=True needs groups: PPOConfig.num_generations="
                         f"{config.num_generations}; give num_generations >= 2 (a group's scores must be able to "
                         "differ), or turn dynamic sampling off")
    if rewards.model_spec is not None or rewards.token_fn is not None:
        raise ValueError("TrainerConfig.dynamic_sampling=True filters groups on scores computed on the host (reward "
                         "functions on text, environments); a reward model or a token-level reward function scores "
                         "on the device after the filter would run. Score with reward functions, or turn it off")


def _split_mesh(mesh, tc: TrainerConfig, config: PPOConfig):
    """(the trainer's mesh, the sampler's mesh or None). With `sampler_devices` n the last n
    devices form the sampler's mesh (every device on the "fsdp" axis) and the trainer's mesh
    (`mesh`, a `MeshConfig` or None for one over all the rest) takes the others."""
    n = tc.sampler_devices
    if not n:
        return mesh, None
    devices = jax.devices()
    if n >= len(devices):
        raise ValueError(f"TrainerConfig.sampler_devices={n} leaves no device to train on: {len(devices)} devices "
                         f"exist; give sampler_devices in [1, {len(devices) - 1}]")
    trainer_devices, sampler_devices = devices[:-n], devices[-n:]
    if isinstance(mesh, jax.sharding.Mesh):
        if set(mesh.devices.flat) & set(sampler_devices):
            raise ValueError(f"the trainer's mesh uses devices {sorted(d.id for d in mesh.devices.flat)}, but with "
                             f"sampler_devices={n} the last {n} (ids {[d.id for d in sampler_devices]}) sample; "
                             "build the mesh over the others, or give a MeshConfig")
    else:
        mesh = sharding.make_mesh(mesh or sharding.MeshConfig(), trainer_devices)
    sampler_mesh = sharding.make_mesh(sharding.MeshConfig(), sampler_devices)
    if config.batch_size % n:
        raise ValueError(f"PPOConfig.batch_size={config.batch_size} must split evenly over the {n} sampler devices "
                         "(TrainerConfig.sampler_devices)")
    return mesh, sampler_mesh


def _environment(factory, tools, tc: TrainerConfig) -> Optional[EnvironmentSpec]:
    schemas = None
    if tools is not None:
        if factory is not None:
            raise ValueError("give environment or tools, not both (tools= builds the environment that calls them)")
        schemas = check_tools(tools)
        factory = tool_environment(tools, timeout=tc.environment_timeout)
    if factory is None:
        return None
    if not callable(factory):
        raise TypeError(f"environment must be a factory (a callable returning an environment with reset and step), "
                        f"got {type(factory).__name__} {factory!r:.60}")
    return EnvironmentSpec(factory, max_turns=tc.max_turns, turn_length=tc.turn_length, timeout=tc.environment_timeout,
                           on_error=tc.environment_errors, workers=tc.environment_workers, tools=schemas)


def _unknown_tokens_message(it, unknown, tokenizer, policy_model) -> str:
    return (f"iteration {it}: the policy sampled {unknown} token ids that the tokenizer does not know (>= "
            f"{len(tokenizer)}: its vocabulary of {policy_model.config.vocab_size} is padded beyond the tokenizer's); "
            "the reward functions see them as the tokenizer's unknown token (warned once)")


def _iterations(config: PPOConfig, tc: TrainerConfig) -> int:
    if tc.total_episodes is None:
        return tc.iterations
    if tc.total_episodes % config.batch_size:
        raise ValueError(f"TrainerConfig.total_episodes={tc.total_episodes} is not a multiple of "
                         f"PPOConfig.batch_size={config.batch_size}")
    return tc.total_episodes // config.batch_size


def _prompt_table(tokenizer, prompts, prompt_column, chat_template, tc: TrainerConfig,
                  tools=None) -> PromptTable:
    table, columns = load_prompt_table(prompts, prompt_column)
    texts, is_chat = render_prompts(tokenizer, table, chat_template, tools)
    if tools and not is_chat:
        raise ValueError("tools are shown to the model through the chat template: give the prompts as chat messages "
                         "(lists of {role, content} dicts), or use an environment with plain-text prompts")
    ids, mask = encode_prompts(tokenizer, texts, tc.query_length, truncate=tc.truncate_prompts,
                               add_special_tokens=not is_chat)
    return PromptTable(table, columns, texts, ids, mask)


def _check_vocabulary(tokenizer, policy_model):
    vocab = policy_model.config.vocab_size
    if len(tokenizer) > vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocabulary has {vocab} "
                         "(config.json vocab_size); token ids past the vocabulary would index out of range. Use the "
                         "tokenizer saved with the policy, or resize the policy's embeddings")


def _rollout_spec(config: PPOConfig, tc: TrainerConfig, built, tokenizer, rewards, query_width: int) -> RolloutSpec:
    width = query_width + tc.response_length
    if config.pack_length is not None and config.pack_length < width:
        raise ValueError(f"PPOConfig.pack_length={config.pack_length} is shorter than a row can be: the prompts are "
                         f"padded to {query_width} tokens and responses get up to response_length="
                         f"{tc.response_length}; use pack_length >= {width} or None (that width)")
    stop = tc.stop_token_id if tc.stop_token_id is not None else tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop or 0)
    return RolloutSpec.from_configs(
        config, tc, policy=built.policy_model, apply_fn=built.apply_fn,
        ref_apply=LogitsOf(built.ref_model) if built.ref_model is not None else None,
        ref_is_policy=built.ref_is_policy, policy_params_key=built.params_key,
        reward_apply=built.reward_model.apply if built.reward_model is not None else None,
        reward_weight=float(rewards.model_weight), token_reward_fn=rewards.token_fn,
        stop_token_ids=() if stop is None else (int(stop),), pad_token_id=int(pad))


def _run_state(config: PPOConfig, tc: TrainerConfig, train: TrainState) -> RunState:
    """Iteration 0: the KL controller (adaptive with `kl_target`), and the entropy
    coefficient as run state when it adapts (`entropy_target`)."""
    return RunState.create(train, seed=tc.seed, kl_coef=config.kl_coef, kl_target=tc.kl_target or 0.0,
                           kl_horizon=tc.kl_horizon,
                           entropy_coef=config.ent_coef if config.entropy_target is not None else None,
                           dynamic_sampling=tc.dynamic_sampling)


def _optimizer(config: PPOConfig, tc: TrainerConfig, iterations: int):
    """(the policy's learning-rate schedule, the optimizer) over the run's updates."""
    total_updates = iterations * config.updates_per_step
    policy_schedule = schedule(tc.learning_rate, tc.lr_schedule, tc.warmup_updates, total_updates)
    critic_schedule = schedule(tc.critic_learning_rate or tc.learning_rate, tc.lr_schedule, tc.warmup_updates,
                               total_updates)
    return policy_schedule, optimizer(policy_schedule, critic_schedule, tc, shared=tc.shared_trunk,
                                      critic=config.uses_critic)
