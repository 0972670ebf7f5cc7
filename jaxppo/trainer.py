"""`PPOTrainer`: the RLHF loop around `train_step`, for PPO and the critic-free family.

Each iteration: `batch_size / num_generations` prompts (shuffled per dataset epoch with the
PRNG key), each sampled `num_generations` times -> compiled sampling -> scores (reward
model, reward functions) -> compiled rollout (log-probs, reference, values, KL-shaped
rewards) -> one compiled `train_step` applying `ppo_epochs * batch_size / mini_batch_size`
updates -> adaptive KL update -> logging, samples, checkpoints. The key of iteration i is
`fold_in(key(seed), i)` and its prompts are a function of i, so a run resumed from a
checkpoint produces exactly the metrics of an uninterrupted one.

The pieces live beside it: `TrainerConfig` (trainer_config), prompts and their order
(prompts), model assembly and the optimizer (assembly), reward functions (rewards),
checkpoints and the run directory (trainer_checkpoint), signal handling (interrupts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import warnings
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo import math as ppo_math
from jaxppo import sharding
from jaxppo.assembly import (LogitsOf, assemble, describe_model, is_model_spec, optimizer, prompts_digest,
                             qualified_name, schedule)
from jaxppo.config import PPOConfig
from jaxppo.engine import TrainState
from jaxppo.interrupts import interrupts_held, interrupts_raise
from jaxppo.logger import Logger
from jaxppo.models import hf as hf_io
from jaxppo.models.peft import save_peft_adapter
from jaxppo.models.tokenizer import decode_responses, encode_prompts, unknown_token_count
from jaxppo.ppo import train_step_fn
from jaxppo.prompts import load_prompt_table, load_prompts, prompt_order, render_prompts
from jaxppo.rewards import HostRewards, RewardFunction, reward_name
from jaxppo.rollout import RewardError, RolloutSpec, finish_rollout, nonfinite_rows, sample_responses
from jaxppo.rundir import RunError, atomic_replace_dir
from jaxppo.sharding import to_host
from jaxppo.trainer_checkpoint import CheckpointedRun
from jaxppo.trainer_config import TrainerConfig

__all__ = ["TrainerConfig", "PPOTrainer", "load_prompts", "RunError", "RewardError"]


class PPOTrainer(CheckpointedRun):
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
        `jaxppo.rewards`). Metrics `rewards/<name>/mean` and `/std` per function.
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
        tokenizer's chat template (see `jaxppo.prompts.render_prompts`); reward functions
        then receive the messages as `prompts`.
      chat_template: None renders chat-message prompts with the tokenizer's template (an
        error when it has none); False refuses them; True is None made explicit.
      callbacks: functions `cb(iteration, metrics)` called after each iteration.
      remat: rematerialisation of the trained models' blocks (policy and critic): False,
        True or a `jax.checkpoint_policies` name (see `jaxppo.models.Model`); None keeps
        each model's own setting. It changes memory and compute, not results.
      scan_layers: True runs every model's blocks as one scan over layer-stacked parameters
        (compile time independent of depth; see `jaxppo.models.Model`), False unrolls
        them; models given as `(Model, params)` are converted. None: checkpoints load
        unrolled and given models keep their layout. Results are the same either way.
      logits_chunk_size: the policy's and reference's LM head runs at response positions
        only (never on full (B, L, V) logits); with this set, that many positions at a
        time, each chunk recomputed in the backward pass (see `jaxppo.models.Model`).
      lora: a `jaxppo.models.LoraConfig` (rank, alpha, targets): train low-rank adapters on
        the policy's linear layers instead of all its weights. The base weights are frozen
        (held in `dtype`; no gradient, no optimizer state), the reference policy is the
        same weights with the adapters off (no second copy), checkpoints hold the
        adapters (and critic) and their optimizer state, and the final export writes
        `final_policy/` (merged) and `final_adapter/` (PEFT format).
      lora_init: a PEFT LoRA adapter directory to start from (its rank, alpha and targets
        apply); the reference is then the base model.
      mesh: None (one device), a `jaxppo.sharding.MeshConfig`, or a `jax.sharding.Mesh`
        with axes ("data", "fsdp", "tensor"): parameters and optimizer states are sharded
        by `jaxppo.sharding.tree_shardings`, rollout rows split over the data axes.
    """

    def __init__(self, config: PPOConfig, trainer_config: TrainerConfig, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fn: Optional[Callable] = None, reward_fn_on: str = "text",
                 reward_fns: Optional[Sequence] = None, reward_weights: Optional[Sequence[float]] = None,
                 ref_policy=None, critic=None, dtype: str = "float32", ref_dtype: Optional[str] = None,
                 reward_dtype: Optional[str] = None, prompt_column: str = "prompt",
                 callbacks: Sequence[Callable] = (), mesh=None, remat=None, scan_layers: Optional[bool] = None,
                 logits_chunk_size: Optional[int] = None, chat_template: Optional[bool] = None,
                 lora=None, lora_init: Optional[str] = None):
        if not isinstance(config, PPOConfig):
            raise TypeError(f"config must be a jaxppo.PPOConfig, got {type(config).__name__}")
        if not isinstance(trainer_config, TrainerConfig):
            raise TypeError(f"trainer_config must be a jaxppo.TrainerConfig, got {type(trainer_config).__name__}")
        if reward_fn_on not in ("text", "tokens"):
            raise ValueError(f"reward_fn_on={reward_fn_on!r} is invalid; valid: 'text', 'tokens'")
        reward_model, host_fns, token_fn, model_weight = _rewards_from(reward_model, reward_fn, reward_fn_on,
                                                                        reward_fns, reward_weights)
        self.config = config
        self.tc = trainer_config
        self.tokenizer = tokenizer
        self.callbacks = list(callbacks)
        tc = trainer_config
        if tc.total_episodes is not None:
            if tc.total_episodes % config.batch_size:
                raise ValueError(f"TrainerConfig.total_episodes={tc.total_episodes} is not a multiple of "
                                 f"PPOConfig.batch_size={config.batch_size}")
            self.iterations = tc.total_episodes // config.batch_size
        else:
            self.iterations = tc.iterations

        # Prompts (and the dataset's other columns, for reward functions): all tokenised
        # once, to fixed-length left-padded arrays.
        self.prompts, self.columns = load_prompt_table(prompts, prompt_column)
        self.prompt_texts, is_chat = render_prompts(tokenizer, self.prompts, chat_template)
        self.prompt_ids, self.prompt_mask = encode_prompts(tokenizer, self.prompt_texts, tc.query_length,
                                                           truncate=tc.truncate_prompts, add_special_tokens=not is_chat)

        # Models.
        built = assemble(config, tc, policy=policy, reward_model=reward_model, ref_policy=ref_policy, critic=critic,
                         dtype=dtype, ref_dtype=ref_dtype, reward_dtype=reward_dtype, remat=remat,
                         scan_layers=scan_layers, logits_chunk_size=logits_chunk_size, lora=lora,
                         lora_init=lora_init)
        self._policy_source = policy if isinstance(policy, (str, os.PathLike)) else None
        self.policy_model, self.reward_model = built.policy_model, built.reward_model
        self.ref_params, self.reward_params = built.ref_params, built.reward_params
        vocab = self.policy_model.config.vocab_size
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocabulary has {vocab} "
                             "(config.json vocab_size); token ids past the vocabulary would index out of range. Use the "
                             "tokenizer saved with the policy, or resize the policy's embeddings")

        # Rewards: text functions on the host, a reward model or token function compiled.
        self.host_rewards = HostRewards(host_fns) if host_fns else None
        stop = tc.stop_token_id if tc.stop_token_id is not None else tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop or 0)
        self.spec = RolloutSpec(
            policy=self.policy_model,
            apply_fn=built.apply_fn,
            ref_apply=LogitsOf(built.ref_model) if built.ref_model is not None else None,
            keep_ref_logprobs=bool(config.kl_loss_coef),
            ref_is_policy=built.ref_is_policy,
            response_length=tc.response_length,
            temperature=float(config.temperature),
            policy_params_key=built.params_key,
            reward_apply=self.reward_model.apply if self.reward_model is not None else None,
            reward_weight=float(model_weight),
            token_reward_fn=token_fn,
            stop_token_ids=() if stop is None else (int(stop),),
            pad_token_id=int(pad),
            kl_estimator=tc.kl_estimator,
            missing_eos_penalty=tc.missing_eos_penalty,
            normalize_scores=tc.normalize_scores,
            score_clip=tc.score_clip,
        )

        # The train state: policy (and critic) parameters, optimizer, update counters.
        total_updates = self.iterations * config.updates_per_step
        self.policy_schedule = schedule(tc.learning_rate, tc.lr_schedule, tc.warmup_updates, total_updates)
        critic_lr = tc.critic_learning_rate or tc.learning_rate
        tx = optimizer(self.policy_schedule, schedule(critic_lr, tc.lr_schedule, tc.warmup_updates, total_updates),
                       tc, shared=tc.shared_trunk, critic=config.uses_critic)
        self.state = TrainState.create(apply_fn=built.apply_fn, params=built.params, tx=tx, freeze=built.freeze)
        kl_target = tc.kl_target if tc.kl_target is not None else 0.0
        self.kl_state = ppo_math.KLControllerState(jnp.float32(config.kl_coef), jnp.float32(kl_target),
                                                   jnp.float32(tc.kl_horizon))
        self.score_moments = ppo_math.RunningMoments.zeros()
        self.mesh = None
        self._train_step = functools.partial(_train_step_donating, config=config)
        if mesh is not None:
            self.mesh = mesh if isinstance(mesh, jax.sharding.Mesh) else sharding.make_mesh(mesh)
            sharding.check_batch_divides(config, self.mesh)
            self.state = sharding.shard_state(self.state, self.mesh)
            if self.ref_params is not None:
                self.ref_params = sharding.shard_state(self.ref_params, self.mesh)
            if self.reward_params is not None:
                self.reward_params = sharding.shard_state(self.reward_params, self.mesh)
            self._train_step = sharding.sharded_train_step(self.state, config, self.mesh, donate=True)
        self.iteration = 0
        self.history: list = []
        self._base_key = jax.random.key(tc.seed)
        self.skipped_iterations = 0  # iterations skipped for non-finite scores (skip_nonfinite_scores)
        self._warned_unknown = False
        self._describe = {
            **built.description,
            "reward": _describe_rewards(reward_model, self.reward_model, host_fns, token_fn, reward_fn_on, model_weight,
                                        dtype, legacy=reward_fns is None),
            "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer)},
            "prompts": prompts_digest(self.prompt_texts),
            "prompt_column": prompt_column,
        }

    # ------------------------------------------------------------------ data

    def _mesh_context(self):
        """The mesh in context for compiled calls (axis names resolve inside them)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def prompt_indices(self, iteration: int) -> np.ndarray:
        """Rows of the prompt set behind the `batch_size` completions of `iteration`: its
        `batch_size / num_generations` prompts (walked in an order reshuffled every dataset
        epoch, see `jaxppo.prompts.prompt_order`), each repeated `num_generations` times
        in consecutive rows (a prompt's group)."""
        c = self.config
        rows = prompt_order(self._base_key, len(self.prompts), c.prompts_per_batch, iteration)
        return np.repeat(rows, c.num_generations)

    # ------------------------------------------------------------------ one iteration

    def step(self):
        """Run one iteration; return its metrics (floats)."""
        return self._prepare_iteration()()

    def _prepare_iteration(self):
        """Sampling, scores and the rollout of the next iteration, without touching the
        trainer; returns `finish()`, which runs the update (consuming the old train state,
        whose buffers are donated), installs the new state, KL controller, score statistics
        and iteration, and returns the metrics. An interrupt before `finish` leaves the
        trainer as it was; the loop runs `finish` and the metrics write with interrupts held,
        so a checkpoint never holds an update whose metrics line is missing."""
        it = self.iteration
        key = jax.random.fold_in(self._base_key, it)
        k_sample, k_train = jax.random.split(key)
        rows = self.prompt_indices(it)
        if self.mesh is None:
            ids, mask = jnp.asarray(self.prompt_ids[rows]), jnp.asarray(self.prompt_mask[rows])
        else:
            # Every process holds all prompts and materialises only its own rows.
            ids = sharding.global_batch(self.prompt_ids[rows], self.mesh)
            mask = sharding.global_batch(self.prompt_mask[rows], self.mesh)

        t0 = time.perf_counter()
        with self._mesh_context():
            gen = sample_responses(self.spec, self.state.params, ids, mask, k_sample)
        jax.block_until_ready(gen.tokens)
        t1 = time.perf_counter()
        host_scores, per_function = None, {}
        if self.host_rewards is not None:
            prompts = [self.prompts[r] for r in rows]
            tokens, token_mask = to_host(gen.tokens), to_host(gen.mask)
            completions = decode_responses(self.tokenizer, tokens, token_mask)
            unknown = unknown_token_count(self.tokenizer, tokens, token_mask)
            if unknown and not self._warned_unknown:
                self._warned_unknown = True
                warnings.warn(f"iteration {it}: the policy sampled {unknown} token ids that the tokenizer does not know "
                              f"(>= {len(self.tokenizer)}: its vocabulary of {self.policy_model.config.vocab_size} is "
                              "padded beyond the tokenizer's); the reward functions see them as the tokenizer's unknown "
                              "token (warned once)", RuntimeWarning, stacklevel=3)
            columns = {name: [values[r] for r in rows] for name, values in self.columns.items()}
            scores, per_function = self.host_rewards(it, prompts, completions, columns)
            host_scores = jnp.asarray(scores)
        with self._mesh_context():
            rollout, stats, moments = finish_rollout(self.spec, self.state.params, self.ref_params, self.reward_params,
                                                     ids, mask, gen, host_scores, self.kl_state, self.score_moments)
        raw_scores = to_host(stats.pop("per_row/raw_scores"))
        model_scores = stats.pop("per_row/model_scores", None)
        bad = nonfinite_rows(raw_scores)
        if bad.size:
            source = self._reward_name()
            if not self.tc.skip_nonfinite_scores:
                raise RewardError(
                    f"iteration {it}: {source} gave non-finite scores {raw_scores[bad[:5]].tolist()} at rows "
                    f"{bad[:5].tolist()}" + (f" (and {bad.size - 5} more)" if bad.size > 5 else "") +
                    f" (prompts {[self.prompt_texts[rows[i]][:40] for i in bad[:3]]}); nothing was updated. Fix the reward, "
                    "or set skip_nonfinite_scores (--skip-nonfinite-scores) to skip such iterations")
            return self._skip_iteration(it, rows, gen, bad, source, t0)
        jax.block_until_ready(rollout.rewards)
        if self.mesh is not None:
            rollout = sharding.shard_batch(rollout, self.mesh)
        kl_state = ppo_math.adaptive_kl_update(self.kl_state, stats.get("objective/kl", 0.0), self.config.batch_size)
        reward_stats = self._reward_statistics(raw_scores, per_function, model_scores, stats)

        def finish():
            # The update consumes the current train state (its buffers are donated), so from
            # here on the iteration completes: the loop runs this with interrupts held.
            t2 = time.perf_counter()
            step_before = int(self.state.step)
            state, metrics = self._train_step(self.state, rollout, k_train)
            jax.block_until_ready(state.params)
            t3 = time.perf_counter()
            self.state, self.score_moments, self.kl_state = state, moments, kl_state
            self.iteration = it + 1
            self._last_samples = (rows, gen)
            nonfinite = int(metrics["ppo/updates_nonfinite"])
            if nonfinite:
                warnings.warn(f"iteration {it}: {nonfinite} of {self.config.updates_per_step} updates had a non-finite "
                              "loss or gradient and were skipped (parameters untouched)", RuntimeWarning, stacklevel=3)
            out = {"iteration": it, "episode": (it + 1) * self.config.batch_size}
            for name, value in {**stats, **metrics}.items():
                if not name.startswith("per_minibatch/"):
                    out[name] = float(value)
            out.update(reward_stats)
            out["ppo/updates_applied"] = int(state.step) - step_before
            out["ppo/updates_total"] = int(state.step)
            out["lr"] = float(self.policy_schedule(step_before))
            out["time/generation"] = t1 - t0
            out["time/scoring"] = t2 - t1
            out["time/update"] = t3 - t2
            out["eps"] = self.config.batch_size / (t3 - t0)
            out["objective/skipped_nonfinite_scores"] = self.skipped_iterations
            return out

        return finish

    def _reward_statistics(self, raw_scores, per_function, model_scores, stats) -> dict:
        """TRL's GRPO-style reward and completion metrics of an iteration (host floats):
        reward (mean of the combined scores), reward_std (the mean over prompts of their
        group's std; the batch's std with one completion per prompt),
        rewards/<name>/mean and /std (over the rows the function scored),
        completions/mean_length, completions/clipped_ratio (no stop token)."""
        g = self.config.num_generations
        scores = raw_scores.astype(np.float64)
        out = {"reward": float(np.mean(scores)),
               "reward_std": float(np.mean(np.std(scores.reshape(-1, g), axis=1, ddof=1)) if g > 1
                                   else np.std(scores, ddof=1) if scores.size > 1 else 0.0)}
        if model_scores is not None and self.host_rewards is not None:
            values = to_host(model_scores).astype(np.float64)
            per_function = {self._model_reward_name: (values, np.ones(values.shape, bool)), **per_function}
        for name, (values, given) in per_function.items():
            if given.any():
                out[f"rewards/{name}/mean"] = float(np.mean(values[given]))
                out[f"rewards/{name}/std"] = float(np.std(values[given], ddof=1)) if given.sum() > 1 else 0.0
            out[f"rewards/{name}/scored_fraction"] = float(np.mean(given))
        # From the rollout's own statistics: mean response length, responses with a stop token.
        out["completions/mean_length"] = float(stats["val/response_length"])
        out["completions/clipped_ratio"] = 1.0 - float(stats["val/num_eos_tokens"]) / len(scores)
        return out

    _model_reward_name = "reward_model"

    def _reward_name(self) -> str:
        if self.reward_model is not None and self.host_rewards is None:
            return "the reward model"
        if self.host_rewards is not None:
            names = [f.name for f in self.host_rewards.functions]
            what = (f"reward function {qualified_name(self.host_rewards.functions[0].fn)!r}" if len(names) == 1
                    else f"the reward functions {names}")
            return what + (" with the reward model" if self.reward_model is not None else "")
        return f"token reward function {qualified_name(self.spec.token_reward_fn)!r}"

    def _skip_iteration(self, it, rows, gen, bad, source, t0):
        """skip_nonfinite_scores: no update, no KL or score-statistics change; the iteration
        and the data position advance, the skip is counted and warned about."""
        warnings.warn(f"iteration {it} skipped: {source} gave non-finite scores at rows {bad[:5].tolist()}",
                      RuntimeWarning, stacklevel=3)
        def finish():
            self.skipped_iterations += 1
            self.iteration = it + 1
            self._last_samples = (rows, gen)
            return {"iteration": it, "episode": (it + 1) * self.config.batch_size, "ppo/updates_applied": 0,
                    "ppo/updates_total": int(self.state.step), "objective/nonfinite_score_rows": int(bad.size),
                    "objective/skipped_nonfinite_scores": self.skipped_iterations,
                    "time/generation": time.perf_counter() - t0}

        return finish

    def samples(self, n: int):
        """(prompt, response) texts of the first `n` rows of the last iteration."""
        rows, gen = self._last_samples
        responses = decode_responses(self.tokenizer, to_host(gen.tokens)[:n], to_host(gen.mask)[:n])
        return [(self.prompt_texts[r], text) for r, text in zip(rows[:n], responses)]

    # ------------------------------------------------------------------ the loop

    def train(self):
        """Run until `iterations` iterations are done; return the list of per-iteration
        metrics. Writes output_dir/metrics.jsonl (and TensorBoard events), prints progress
        and samples, checkpoints, and at the end exports the policy and plots.

        Before any compilation: takes the directory's lock (a second run on it is refused),
        checks the saved settings (`settings()`), restores the newest readable checkpoint.
        On Ctrl-C or SIGTERM: saves a checkpoint (a second Ctrl-C meanwhile is held off until
        the checkpoint is complete) and raises KeyboardInterrupt."""
        tc = self.tc
        os.makedirs(tc.output_dir, exist_ok=True)
        self._open_run()
        try:
            return self._train_locked()
        finally:
            self._lock.release()

    def _train_locked(self):
        tc = self.tc
        logger = Logger(self._log_dir(), start_iteration=self.iteration, tensorboard=tc.tensorboard)
        self.history = logger.history
        c = self.config
        groups = (f" ({c.prompts_per_batch} prompts x {c.num_generations} completions)" if c.num_generations > 1
                  else "")
        bar = None
        try:
            with interrupts_raise():
                # The SIGTERM handler is in place before the first line: a signal from here on
                # is a checkpoint and a clean exit, never the default kill.
                print(f"jaxppo: {self.iterations} iterations x {c.batch_size} episodes{groups}; updates per "
                      f"iteration = ppo_epochs * batch_size / mini_batch_size = {c.ppo_epochs} * {c.batch_size} / "
                      f"{c.mini_batch_size} = {c.updates_per_step}; advantages: {c.advantage_estimator}", flush=True)
                if tc.progress:
                    from tqdm.auto import tqdm

                    bar = tqdm(total=self.iterations, initial=self.iteration, desc=self.config.advantage_estimator,
                               dynamic_ncols=True)
                while self.iteration < self.iterations:
                    finish = self._prepare_iteration()
                    with interrupts_held(what="this iteration's update"):  # the new state and its line land together
                        metrics = finish()
                        logger.log(metrics, echo=bar is None and (metrics["iteration"] % tc.log_every == 0))
                    if bar is not None:
                        bar.update(1)
                        if "objective/scores" in metrics:
                            bar.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                                            **({"kl": f"{metrics['objective/kl']:.3f}"} if "objective/kl" in metrics
                                               else {}))
                    if tc.sample_every and self.iteration % tc.sample_every == 0 and tc.num_samples:
                        for prompt, response in self.samples(tc.num_samples):
                            text = f"  [{self.iteration}] {prompt!r} -> {response!r}"
                            (bar.write if bar is not None else print)(text)
                    for cb in self.callbacks:
                        cb(metrics["iteration"], metrics)
                    if tc.checkpoint_every and self.iteration % tc.checkpoint_every == 0:
                        with interrupts_held():  # a signal now would tear the save; it is served after
                            self.save_checkpoint()
        except KeyboardInterrupt:
            logger.close()
            if bar is not None:
                bar.close()
            print(f"\ninterrupted: saving a checkpoint at iteration {self.iteration} ...", flush=True)
            with interrupts_held(reraise=False):  # a KeyboardInterrupt is on its way out already
                self.save_checkpoint()
            print(f"checkpoint saved at iteration {self.iteration}; run the same command again to resume", flush=True)
            raise
        finally:
            logger.close()
            if bar is not None:
                bar.close()
        with interrupts_held():
            self.save_checkpoint()  # at the end, whatever checkpoint_every says: a finished run is not redone
        if tc.export_final:
            self.export(os.path.join(tc.output_dir, "final_policy"))
            if self.policy_model.lora is not None:
                self.export_adapter(os.path.join(tc.output_dir, "final_adapter"))
        if tc.plot:
            logger.plot(os.path.join(tc.output_dir, "metrics.png"))
        print(self.summary())
        return self.history

    def policy_params(self):
        return self.spec.policy_params(self.state.params)

    @staticmethod
    def _for_writer(tree):
        """`tree` for the one process that writes exports (gathered to its host in
        multi-host runs), or None on the others."""
        if jax.process_count() > 1:
            tree = jax.tree.map(to_host, tree)
            if jax.process_index() != 0:
                return None
        return tree

    def export(self, path: str):
        """Save the current policy (and tokenizer) as a Hugging Face directory; a LoRA
        policy with its adapters merged into the base weights."""
        model = dataclasses.replace(self.policy_model, kind="causal_lm")
        params = self.policy_params()
        if self.tc.shared_trunk:
            params = {**params, "params": {k: v for k, v in params["params"].items() if k != "value_head"}}
        params = self._for_writer(params)
        if params is None:
            return

        def write(directory):
            hf_io.save_pretrained(model, params, directory)
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(directory)

        atomic_replace_dir(write, path)  # a kill mid-export leaves the old export or the new one, whole

    def export_adapter(self, path: str):
        """Save a LoRA policy's adapters in PEFT's format (`adapter_config.json`,
        `adapter_model.safetensors`) for the base checkpoint it was loaded from."""
        if self.policy_model.lora is None:
            raise ValueError("export_adapter needs a LoRA policy (PPOTrainer(lora=...) or lora_init=...)")
        adapters = self._for_writer({"lora": self.policy_params()["lora"]})  # the adapters alone, not the base
        if adapters is None:
            return
        base = os.path.abspath(os.fspath(self._policy_source)) if self._policy_source is not None else None
        atomic_replace_dir(lambda directory: save_peft_adapter(self.policy_model, adapters, directory,
                                                               base_model_name_or_path=base), path)

    def summary(self) -> str:
        h = self.history
        if not h:
            return "no iterations were run"
        lines = [
            "",
            "== summary ==",
            f"iterations: {len(h)} (of {self.iterations}), episodes: {h[-1]['episode']}",
            f"updates per iteration: {self.config.updates_per_step} = ppo_epochs {self.config.ppo_epochs} * "
            f"batch_size {self.config.batch_size} / mini_batch_size {self.config.mini_batch_size}; "
            f"applied in total: {int(self.state.step)}",
        ]
        lora = self.policy_model.lora
        if lora is not None:
            count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
            frozen = count(self.state.params) - count(self.state.trained_params())  # not the value head or critic
            lines.append(f"LoRA: rank {lora.rank}, alpha {lora.alpha:g}, targets {', '.join(lora.targets)}; "
                         f"{count(self.policy_params()['lora']):,} adapter parameters trained, "
                         f"{frozen:,} base parameters frozen")
        # Iterations skipped for non-finite scores (skip_nonfinite_scores) have no scores.
        scored = [m for m in h if "objective/scores" in m]
        if len(scored) < len(h):
            lines.append(f"iterations skipped for non-finite scores: {len(h) - len(scored)}")
        if scored:
            n = min(10, max(1, len(scored) // 2))
            first = float(np.mean([m["objective/scores"] for m in scored[:n]]))
            last = float(np.mean([m["objective/scores"] for m in scored[-n:]]))
            lines.append(f"mean score: first {n} iterations {first:.4f}, last {n} iterations {last:.4f} "
                         f"({last - first:+.4f})")
            if "objective/kl" in scored[-1]:
                kl_last = float(np.mean([m["objective/kl"] for m in scored[-n:]]))
                where = (f"KL term in the loss, coefficient {self.config.kl_loss_coef}" if self.config.kl_loss_coef
                         else f"kl_coef now {float(self.kl_state.beta):.4f}")
                lines.append(f"mean KL (last {n}): {kl_last:.4f}; {where}")
        lines.append(f"metrics: {os.path.join(self.tc.output_dir, 'metrics.jsonl')}")
        return "\n".join(lines)



# train_step with the old train state donated (its buffers become the new state's): one
# train state in memory during the update instead of two. Module-level, so every trainer
# in a process shares its compiled programs.
_train_step_donating = jax.jit(train_step_fn, static_argnames=("config", "minibatch_sharding"), donate_argnums=(0,))


def _rewards_from(reward_model, reward_fn, reward_fn_on, reward_fns, reward_weights):
    """Sort the reward arguments: (reward model spec or None, [RewardFunction] on text,
    token function or None, the reward model's weight). Errors name what was wrong."""
    if reward_fns is not None:
        if reward_fn is not None:
            raise ValueError("give reward_fn or reward_fns, not both (reward_fns=[f] is reward_fn=f)")
        if isinstance(reward_fns, (str, bytes)) or not isinstance(reward_fns, (list, tuple)) or not reward_fns:
            raise ValueError(f"reward_fns must be a non-empty list of functions (one may be a reward model); got "
                             f"{reward_fns!r:.80}")
        if reward_fn_on != "text":
            raise ValueError("reward_fns are called on text; token-level reward functions go in reward_fn with "
                             "reward_fn_on='tokens'")
    entries = list(reward_fns) if reward_fns is not None else ([reward_fn] if reward_fn is not None else [])
    if reward_weights is None:
        weights = [1.0] * len(entries)
    else:
        if reward_fns is None:
            raise ValueError("reward_weights needs reward_fns (one weight per entry)")
        weights = list(reward_weights)
        if len(weights) != len(entries):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(entries)} reward_fns; give one "
                             "weight per entry, in the same order")
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w):
                raise ValueError(f"reward_weights[{i}]={w!r} is invalid: a weight must be a finite number")
    model_weight = 1.0
    fns = []
    for entry, weight in zip(entries, weights):
        if is_model_spec(entry):
            if reward_model is not None:
                raise ValueError("one reward model at most: reward_model and a model in reward_fns were both given")
            reward_model, model_weight = entry, weight
        elif callable(entry):
            fns.append((entry, weight))
        else:
            raise ValueError(f"reward_fns entry {entry!r:.60} is neither a function nor a reward model (a checkpoint "
                             "path or a (Model, params) pair)")
    if reward_model is None and not fns:
        raise ValueError("give exactly one of reward_model (a reward model), reward_fn (a function) or reward_fns (a "
                         "list of functions, one of which may be a reward model)")
    if reward_fns is None and reward_model is not None and reward_fn is not None:
        raise ValueError("give exactly one of reward_model (a reward model) or reward_fn (a function); to combine "
                         "them, list both in reward_fns")
    token_fn = None
    if reward_fn_on == "tokens":
        token_fn, fns = fns[0][0], []
    names = {}
    host = []
    for fn, weight in fns:
        name = reward_name(fn)
        names[name] = names.get(name, 0) + 1
        host.append(RewardFunction(name if names[name] == 1 else f"{name}_{names[name]}", fn, float(weight)))
    return reward_model, host, token_fn, model_weight


def _describe_rewards(spec, model, host_fns, token_fn, reward_fn_on, model_weight, dtype, legacy: bool) -> dict:
    """The reward's identity for the run settings (the layout of single-reward runs is
    kept as it was, so their runs resume)."""
    if legacy:
        if model is not None:
            return describe_model(spec, model, dtype)
        fn = token_fn if token_fn is not None else host_fns[0].fn
        return {"function": qualified_name(fn), "on": reward_fn_on}
    out = {"functions": [{"function": qualified_name(f.fn), "name": f.name, "weight": f.weight} for f in host_fns]}
    if model is not None:
        out["model"] = describe_model(spec, model, dtype)
        out["model_weight"] = model_weight
    return out
