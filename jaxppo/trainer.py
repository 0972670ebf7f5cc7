"""`PPOTrainer`: the RLHF loop around `train_step`.

Each iteration: a batch of prompts (shuffled per dataset epoch with the PRNG key) ->
compiled sampling -> scores -> compiled rollout (log-probs, reference, values, KL-shaped
rewards) -> one compiled `train_step` applying `ppo_epochs * batch_size / mini_batch_size`
updates -> adaptive KL update -> logging, samples, checkpoints. The key of iteration i is
`fold_in(key(seed), i)` and its prompts are a function of i, so a run resumed from a
checkpoint produces exactly the metrics of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import signal
import sys
import time
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxppo import checkpoint
from jaxppo import math as ppo_math
from jaxppo import sharding
from jaxppo.config import PPOConfig, _is_int
from jaxppo.engine import TrainState, clip_by_global_norm
from jaxppo.models import hf as hf_io
from jaxppo.models.model import Model, PolicyAndCritic, stack_layers, trunk_name, unstack_layers
from jaxppo.models.tokenizer import decode_responses, encode_prompts
from jaxppo.logger import Logger, read_metrics
from jaxppo.ppo import train_step_fn
from jaxppo.rundir import RunError, RunLock, atomic_replace_dir, check_settings
from jaxppo.rollout import RewardError, RolloutSpec, check_scores, finish_rollout, nonfinite_rows, sample_responses

__all__ = ["TrainerConfig", "PPOTrainer", "load_prompts", "RunError", "RewardError"]


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Settings of the RLHF loop (the update itself is in `PPOConfig`).

    Run: seed; iterations (PPO iterations, each `batch_size` episodes) or total_episodes
      (must be a multiple of batch_size; overrides iterations); query_length and
      response_length (tokens; prompts are left-padded to query_length, longer prompts are
      an error unless truncate_prompts).
    Rewards: kl_estimator ("k1", "k3", "abs", "mse"); kl_target and kl_horizon (adaptive
      KL controller; None = fixed `PPOConfig.kl_coef`); missing_eos_penalty (subtracted
      from scores of responses without a stop token); normalize_scores (running mean/std);
      score_clip; stop_token_id (default: the tokenizer's EOS).
    Optimisation: learning_rate (policy), critic_learning_rate (default: learning_rate),
      lr_schedule ("constant", "linear" decay to 0, "cosine"), warmup_updates,
      max_grad_norm (None: no clipping), adam_eps, shared_trunk (value head on the policy).
    Output: output_dir; log_every; sample_every and num_samples (printed completions);
      checkpoint_every (iterations; 0 = only on interrupt and at the end), keep_checkpoints,
      resume (continue from the latest checkpoint in output_dir; False refuses a directory
      that already holds a run); tensorboard; progress; export_final (policy as a Hugging
      Face directory); plot (PNG of score, KL, reward).
    Faults: skip_nonfinite_scores (an iteration whose scores include NaN or inf is skipped
      and counted in `objective/skipped_nonfinite_scores` instead of stopping the run with
      an error naming the rows).
    """

    seed: int = 0
    iterations: int = 100
    total_episodes: Optional[int] = None
    query_length: int = 32
    response_length: int = 32
    truncate_prompts: bool = False
    kl_estimator: str = "k1"
    kl_target: Optional[float] = None
    kl_horizon: int = 10000
    missing_eos_penalty: Optional[float] = None
    normalize_scores: bool = False
    score_clip: Optional[float] = None
    stop_token_id: Optional[int] = None
    learning_rate: float = 1e-5
    critic_learning_rate: Optional[float] = None
    lr_schedule: str = "constant"
    warmup_updates: int = 0
    max_grad_norm: Optional[float] = 1.0
    adam_eps: float = 1e-5
    shared_trunk: bool = False
    output_dir: str = "runs/jaxppo"
    log_every: int = 1
    sample_every: int = 10
    num_samples: int = 2
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = True
    tensorboard: bool = True
    progress: bool = True
    export_final: bool = True
    plot: bool = True
    skip_nonfinite_scores: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.type in (bool, "bool") and not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"TrainerConfig.{field.name}={getattr(self, field.name)!r} is invalid: "
                                 f"{field.name} must be a bool (True or False)")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError(f"TrainerConfig.output_dir={self.output_dir!r} is invalid: output_dir must be a non-empty "
                             "path string")
        if self.total_episodes is not None and (not _is_int(self.total_episodes) or self.total_episodes <= 0):
            raise ValueError(f"TrainerConfig.total_episodes={self.total_episodes!r} is invalid: total_episodes must be "
                             "None or a positive int")
        if self.stop_token_id is not None and (not _is_int(self.stop_token_id) or self.stop_token_id < 0):
            raise ValueError(f"TrainerConfig.stop_token_id={self.stop_token_id!r} is invalid: stop_token_id must be "
                             "None or a token id >= 0")
        positive = ("iterations", "query_length", "response_length", "kl_horizon", "log_every", "keep_checkpoints")
        for name in positive:
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be a positive int")
        for name in ("sample_every", "num_samples", "checkpoint_every", "warmup_updates", "seed"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be an int >= 0")
        if self.kl_estimator not in ppo_math.KL_ESTIMATORS:
            raise ValueError(f"TrainerConfig.kl_estimator={self.kl_estimator!r} is invalid; valid: "
                             f"{', '.join(ppo_math.KL_ESTIMATORS)}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"TrainerConfig.lr_schedule={self.lr_schedule!r} is invalid; valid: constant, linear, cosine")
        for name in ("learning_rate", "adam_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be > 0")
        for name in ("critic_learning_rate", "kl_target", "max_grad_norm", "score_clip", "missing_eos_penalty"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or (name != "missing_eos_penalty" and value <= 0)):
                raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be None or a finite number"
                                 + ("" if name == "missing_eos_penalty" else " > 0"))


def load_prompts(source, prompt_column: str = "prompt") -> list:
    """Prompts from a list of strings, a `datasets.Dataset` (or anything with
    `column_names`) holding `prompt_column`, or a file: .txt (one prompt per line),
    .jsonl (one object per line with `prompt_column`), .json (a list of strings or objects).

    Errors name the file and line (or row) and say what was expected: a missing or empty
    file, a line that is not JSON, a record without the column, a prompt that is not a
    string."""
    where = "the prompt list"
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"prompts file {path!r} does not exist (give a .txt, .jsonl or .json file)")
        where = path
        if path.endswith(".jsonl"):
            rows, lines = [], []
            with open(path) as f:
                for n, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        rows.append(json.loads(line))
                    except ValueError as err:
                        raise ValueError(f"{path} line {n} is not valid JSON ({err}): {line.strip()[:60]!r}; each "
                                         f'line must be an object such as {{"{prompt_column}": "..."}}') from None
                    lines.append(n)
            prompts = [_prompt_of(row, prompt_column, f"{path} line {n}") for row, n in zip(rows, lines)]
            labels = [f"{path} line {n}" for n in lines]
        elif path.endswith(".json"):
            with open(path) as f:
                try:
                    rows = json.load(f)
                except ValueError as err:
                    raise ValueError(f"{path} is not valid JSON ({err}); expected a list of strings or of objects "
                                     f"with a {prompt_column!r} field") from None
            if not isinstance(rows, list):
                raise ValueError(f"{path} holds a {type(rows).__name__}; expected a list of strings or of objects "
                                 f"with a {prompt_column!r} field")
            prompts = [_prompt_of(row, prompt_column, f"{path} item {i}") for i, row in enumerate(rows)]
            labels = [f"{path} item {i}" for i in range(len(rows))]
        else:
            with open(path) as f:
                numbered = [(n, line.rstrip("\n")) for n, line in enumerate(f, start=1) if line.strip()]
            prompts = [line for _, line in numbered]
            labels = [f"{path} line {n}" for n, _ in numbered]
    elif hasattr(source, "column_names"):
        if prompt_column not in source.column_names:
            raise ValueError(f"the dataset has no column {prompt_column!r}; columns: {list(source.column_names)} "
                             "(set prompt_column / --prompt-column)")
        prompts = list(source[prompt_column])
        labels = [f"dataset row {i}" for i in range(len(prompts))]
    else:
        if isinstance(source, (str, bytes)):
            raise TypeError("prompts must be a list of strings or a file path, not a single string")
        prompts = list(source)
        labels = [f"prompt {i}" for i in range(len(prompts))]
    if not prompts:
        raise ValueError(f"no prompts: {where} is empty")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        i = bad[0]
        raise TypeError(f"prompts must be strings; {labels[i]} is a {type(prompts[i]).__name__} ({prompts[i]!r:.60})"
                        + (f" ({len(bad)} such rows)" if len(bad) > 1 else ""))
    return prompts


def _prompt_of(row, column: str, label: str):
    if isinstance(row, dict):
        if column not in row:
            raise ValueError(f"{label} has no {column!r} field (fields: {sorted(row)}); set prompt_column / "
                             "--prompt-column to the field holding the prompt")
        return row[column]
    return row


def _load_model(spec, kind, dtype, param_dtype=None, scan_layers=None):
    """(model, params) from a checkpoint path or a (Model, params) pair; `scan_layers`
    True/False puts the layers in that layout (None: as loaded / as given)."""
    if isinstance(spec, (str, os.PathLike)):
        return hf_io.from_pretrained(os.fspath(spec), dtype=dtype, param_dtype=param_dtype or dtype, kind=kind,
                                     scan_layers=bool(scan_layers))
    model, params = spec
    if not isinstance(model, Model):
        raise TypeError(f"expected a checkpoint path or a (jaxppo.models.Model, params) pair, got {type(model).__name__}")
    if scan_layers is not None and model.scan_layers != scan_layers:
        convert = stack_layers if scan_layers else unstack_layers
        model, params = dataclasses.replace(model, scan_layers=scan_layers), convert(params, model.config)
    return model, params


def _critic_from(model: Model, params, zero_head: bool, dtype=None):
    """A "value" Model + params whose trunk is a copy of `model`'s trunk, with float32
    parameters (the critic is trained: master weights in float32) and compute `dtype`
    (default: `model`'s)."""
    critic = dataclasses.replace(model, kind="value", dtype=dtype or model.dtype, param_dtype="float32")
    trunk = trunk_name(model.config)
    inner = params["params"]
    # Copies (jnp.array copies, also where no cast is needed): the critic is trained and its
    # buffers donated; the model it comes from is not.
    as_master = lambda x: jnp.array(x, dtype=jnp.float32)
    if zero_head or "score" not in inner:
        head = {"kernel": jnp.zeros((model.config.hidden_size, 1), jnp.float32)}
    else:
        head = {"kernel": as_master(inner["score"]["kernel"][:, :1])}
    return critic, {"params": {trunk: jax.tree.map(as_master, inner[trunk]), "score": head}}


class PPOTrainer:
    """RLHF with PPO: rollouts from prompts, rewards, and compiled `train_step` updates.

    Args:
      config: `PPOConfig` (sizes, clipping, coefficients, `kl_coef`, `temperature`).
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
        outside jit as `reward_fn(prompts: list[str], responses: list[str]) -> (B,)`; with
        `reward_fn_on="tokens"` it is jitted: `fn(prompt_ids, prompt_mask, response_ids,
        response_mask) -> (B,)`.
      ref_policy: the frozen reference; default: a copy of the initial policy.
      critic: a local directory or `(Model, params)` for the critic (separate trunk);
        default: initialised from the reward model when it is a model, else from the
        policy (value head at zero). Ignored with `shared_trunk`.
      dtype: compute dtype of models loaded from paths ("float32", "bfloat16", "float16").
        Trained models (policy, critic) keep float32 master parameters and optimizer
        states whatever the compute dtype; log-softmax is computed in float32.
      ref_dtype, reward_dtype: compute and storage dtype of the frozen reference and
        reward model (default: `dtype`); "bfloat16" halves their memory.
      prompt_column: column or field holding prompts in datasets and JSON files.
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
      mesh: None (one device), a `jaxppo.sharding.MeshConfig`, or a `jax.sharding.Mesh`
        with axes ("data", "fsdp", "tensor"): parameters and optimizer states are sharded
        by `jaxppo.sharding.tree_shardings`, rollout rows split over the data axes.
    """

    def __init__(self, config: PPOConfig, trainer_config: TrainerConfig, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fn: Optional[Callable] = None, reward_fn_on: str = "text",
                 ref_policy=None, critic=None, dtype: str = "float32", ref_dtype: Optional[str] = None,
                 reward_dtype: Optional[str] = None, prompt_column: str = "prompt",
                 callbacks: Sequence[Callable] = (), mesh=None, remat=None, scan_layers: Optional[bool] = None,
                 logits_chunk_size: Optional[int] = None):
        if not isinstance(config, PPOConfig):
            raise TypeError(f"config must be a jaxppo.PPOConfig, got {type(config).__name__}")
        if not isinstance(trainer_config, TrainerConfig):
            raise TypeError(f"trainer_config must be a jaxppo.TrainerConfig, got {type(trainer_config).__name__}")
        if (reward_model is None) == (reward_fn is None):
            raise ValueError("give exactly one of reward_model (a reward model) or reward_fn (a function)")
        if reward_fn_on not in ("text", "tokens"):
            raise ValueError(f"reward_fn_on={reward_fn_on!r} is invalid; valid: 'text', 'tokens'")
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

        # Prompts: all tokenised once, to fixed-length left-padded arrays.
        self.prompts = load_prompts(prompts, prompt_column)
        self.prompt_ids, self.prompt_mask = encode_prompts(tokenizer, self.prompts, tc.query_length,
                                                           truncate=tc.truncate_prompts)

        # Models.
        ref_dtype, reward_dtype = ref_dtype or dtype, reward_dtype or dtype
        policy_model, policy_params = _load_model(policy, "causal_lm", dtype, "float32", scan_layers)
        if remat is not None:
            policy_model = dataclasses.replace(policy_model, remat=remat)
        if logits_chunk_size is not None:
            policy_model = dataclasses.replace(policy_model, logits_chunk_size=logits_chunk_size)
        if policy_model.kind != "causal_lm":
            policy_model = dataclasses.replace(policy_model, kind="causal_lm")
            policy_params = {"params": {k: v for k, v in policy_params["params"].items() if k != "value_head"}}
        if ref_policy is None:
            # A copy of the initial policy, held in ref_dtype (jnp.array copies even without a cast).
            ref_model = dataclasses.replace(policy_model, dtype=ref_dtype, param_dtype=ref_dtype)
            ref_params = jax.tree.map(lambda x: jnp.array(x, dtype=jnp.dtype(ref_dtype)), policy_params)
        else:
            ref_model, ref_params = _load_model(ref_policy, "causal_lm", ref_dtype, scan_layers=scan_layers)
            if logits_chunk_size is not None:
                ref_model = dataclasses.replace(ref_model, logits_chunk_size=logits_chunk_size)
        self.reward_model = None
        reward_params = None
        if reward_model is not None:
            self.reward_model, reward_params = _load_model(reward_model, "reward", reward_dtype, scan_layers=scan_layers)
            if self.reward_model.kind != "reward":
                raise ValueError(f"reward_model must be of kind 'reward', got {self.reward_model.kind!r}")
        if tc.shared_trunk:
            model = dataclasses.replace(policy_model, kind="causal_lm_value")
            head = {"kernel": jnp.zeros((model.config.hidden_size, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}
            params = {"params": dict(policy_params["params"], value_head=head)}
            apply_fn, params_key, self.policy_model = model.apply, None, model
        else:
            if critic is not None:
                critic_model, critic_params = _load_model(critic, "value", dtype, "float32", scan_layers)
                if critic_model.kind != "value":
                    critic_model, critic_params = _critic_from(critic_model, critic_params, zero_head=False)
            elif self.reward_model is not None:
                critic_model, critic_params = _critic_from(self.reward_model, reward_params, zero_head=False, dtype=dtype)
            else:
                critic_model, critic_params = _critic_from(policy_model, policy_params, zero_head=True)
            if remat is not None:
                critic_model = dataclasses.replace(critic_model, remat=remat)
            apply_fn = PolicyAndCritic(policy_model, critic_model)
            params = {"policy": policy_params, "critic": critic_params}
            params_key, self.policy_model = "policy", policy_model
        self.ref_params = ref_params
        vocab = policy_model.config.vocab_size
        if len(tokenizer) > vocab:
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the policy's vocabulary has {vocab} "
                             "(config.json vocab_size); token ids past the vocabulary would index out of range. Use the "
                             "tokenizer saved with the policy, or resize the policy's embeddings")
        self.reward_params = reward_params

        stop = tc.stop_token_id if tc.stop_token_id is not None else tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop or 0)
        self.reward_fn = reward_fn if reward_fn_on == "text" else None
        self.spec = RolloutSpec(
            policy=self.policy_model,
            apply_fn=apply_fn,
            ref_apply=_LogitsOf(ref_model),
            response_length=tc.response_length,
            temperature=float(config.temperature),
            policy_params_key=params_key,
            reward_apply=self.reward_model.apply if self.reward_model is not None else None,
            token_reward_fn=reward_fn if reward_fn_on == "tokens" else None,
            stop_token_ids=() if stop is None else (int(stop),),
            pad_token_id=int(pad),
            kl_estimator=tc.kl_estimator,
            missing_eos_penalty=tc.missing_eos_penalty,
            normalize_scores=tc.normalize_scores,
            score_clip=tc.score_clip,
        )
        total_updates = self.iterations * config.updates_per_step
        self.policy_schedule = _schedule(tc.learning_rate, tc.lr_schedule, tc.warmup_updates, total_updates)
        critic_lr = tc.critic_learning_rate or tc.learning_rate
        tx = _optimizer(self.policy_schedule, _schedule(critic_lr, tc.lr_schedule, tc.warmup_updates, total_updates),
                        tc, shared=tc.shared_trunk)
        self.state = TrainState.create(apply_fn=apply_fn, params=params, tx=tx)
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
            self.ref_params = sharding.shard_state(self.ref_params, self.mesh)
            if self.reward_params is not None:
                self.reward_params = sharding.shard_state(self.reward_params, self.mesh)
            self._train_step = sharding.sharded_train_step(self.state, config, self.mesh, donate=True)
        self.iteration = 0
        self.history: list = []
        self._base_key = jax.random.key(tc.seed)
        self.skipped_iterations = 0  # iterations skipped for non-finite scores (skip_nonfinite_scores)
        self._describe = {
            "policy": _describe_model(policy, policy_model, dtype),
            "reference": "initial policy" if ref_policy is None else _describe_model(ref_policy, ref_model, dtype),
            "reward": (_describe_model(reward_model, self.reward_model, dtype) if reward_model is not None
                       else {"function": _qualified_name(reward_fn), "on": reward_fn_on}),
            "critic": ("shared trunk" if tc.shared_trunk else
                       _describe_model(critic, None, dtype) if critic is not None else "default"),
            "tokenizer": {"class": type(tokenizer).__name__, "size": len(tokenizer)},
            "prompts": {"count": len(self.prompts),
                        "sha256": hashlib.sha256("\x00".join(self.prompts).encode()).hexdigest()},
            "prompt_column": prompt_column,
        }

    # ------------------------------------------------------------------ data

    def _mesh_context(self):
        """The mesh in context for compiled calls (axis names resolve inside them)."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def prompt_indices(self, iteration: int) -> np.ndarray:
        """Rows of the prompt set used by `iteration`: the prompts are walked in an order
        reshuffled every dataset epoch (epoch e: permutation with fold_in(data key, e))."""
        n, b = len(self.prompts), self.config.batch_size
        data_key = jax.random.fold_in(self._base_key, 1 << 30)
        start = iteration * b
        out = np.empty(b, np.int64)
        for j in range(b):
            g = start + j
            epoch = g // n
            if j == 0 or g % n == 0:
                perm = np.asarray(jax.random.permutation(jax.random.fold_in(data_key, epoch), n))
            out[j] = perm[g % n]
        return out

    # ------------------------------------------------------------------ one iteration

    def step(self):
        """Run one PPO iteration; return its metrics (floats)."""
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
        host_scores = None
        if self.reward_fn is not None:
            prompts = [self.prompts[r] for r in rows]
            responses = decode_responses(self.tokenizer, _to_host(gen.tokens), _to_host(gen.mask))
            host_scores = jnp.asarray(self._call_reward_fn(it, prompts, responses))
        with self._mesh_context():
            rollout, stats, moments = finish_rollout(self.spec, self.state.params, self.ref_params, self.reward_params,
                                                     ids, mask, gen, host_scores, self.kl_state, self.score_moments)
        raw_scores = _to_host(stats.pop("per_row/raw_scores"))
        bad = nonfinite_rows(raw_scores)
        if bad.size:
            source = self._reward_name()
            if not self.tc.skip_nonfinite_scores:
                raise RewardError(
                    f"iteration {it}: {source} gave non-finite scores {raw_scores[bad[:5]].tolist()} at rows "
                    f"{bad[:5].tolist()}" + (f" (and {bad.size - 5} more)" if bad.size > 5 else "") +
                    f" (prompts {[self.prompts[rows[i]][:40] for i in bad[:3]]}); nothing was updated. Fix the reward, "
                    "or set skip_nonfinite_scores (--skip-nonfinite-scores) to skip such iterations")
            return self._skip_iteration(it, rows, gen, bad, source, t0)
        jax.block_until_ready(rollout.rewards)
        if self.mesh is not None:
            rollout = sharding.shard_batch(rollout, self.mesh)
        kl_state = ppo_math.adaptive_kl_update(self.kl_state, stats["objective/kl"], self.config.batch_size)

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

    def _reward_name(self) -> str:
        if self.reward_model is not None:
            return "the reward model"
        if self.reward_fn is not None:
            return f"reward function {_qualified_name(self.reward_fn)!r}"
        return f"token reward function {_qualified_name(self.spec.token_reward_fn)!r}"

    def _call_reward_fn(self, it: int, prompts: list, responses: list) -> np.ndarray:
        """The text reward function's scores, checked: one real number per response."""
        name = self._reward_name()
        try:
            scores = self.reward_fn(prompts, responses)
        except Exception as err:
            raise RewardError(f"iteration {it}: {name} raised {type(err).__name__}: {err} (called on {len(prompts)} "
                              f"responses; first prompt {prompts[0][:40]!r}); nothing was updated") from err
        try:
            return check_scores(scores, len(prompts), name, prompts, responses)
        except RewardError as err:
            raise RewardError(f"iteration {it}: {err}; nothing was updated") from None

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
        responses = decode_responses(self.tokenizer, _to_host(gen.tokens)[:n], _to_host(gen.mask)[:n])
        return [(self.prompts[r], text) for r, text in zip(rows[:n], responses)]

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_tree(self):
        return {
            "params": self.state.params,
            "opt_state": self.state.opt_state,
            "step": self.state.step,
            "skipped_nonfinite": self.state.skipped_nonfinite,
            # Small host values as numpy: every process holds them whole (orbax cannot save
            # process-local jax arrays in multi-host runs).
            "kl": tuple(np.asarray(x) for x in self.kl_state),
            "score_moments": tuple(np.asarray(x) for x in self.score_moments),
            "iteration": np.asarray(self.iteration, np.int32),
            "skipped_iterations": np.asarray(self.skipped_iterations, np.int32),
            "key": np.asarray(jax.random.key_data(self._base_key)),
        }

    @property
    def checkpoint_dir(self) -> str:
        return os.path.abspath(os.path.join(self.tc.output_dir, "checkpoints"))

    def save_checkpoint(self):
        """Save params, optimizer state, KL controller, score statistics, data position and
        key at the current iteration (orbax; see `jaxppo.checkpoint`). A write error is a
        `RunError`; the checkpoints saved before stay intact."""
        checkpoint.save(self.checkpoint_dir, self.iteration, self._checkpoint_tree(), keep=self.tc.keep_checkpoints)

    def restore_checkpoint(self) -> bool:
        """Restore the newest readable checkpoint in output_dir, if any; True if one was
        restored. Unreadable ones are warned about and set aside (`jaxppo.checkpoint`)."""
        template = self._checkpoint_tree()
        found = checkpoint.restore_latest(self.checkpoint_dir, template)
        if found is None:
            return False
        _, restored = found
        if not np.array_equal(np.asarray(restored["key"]), np.asarray(template["key"])):
            raise RunError(f"the checkpoint in {self.tc.output_dir!r} was written with another seed; "
                           "use the same seed to resume, or another output_dir")
        self.state = self.state.replace(params=restored["params"], opt_state=restored["opt_state"],
                                        step=restored["step"], skipped_nonfinite=restored["skipped_nonfinite"])
        self.kl_state = ppo_math.KLControllerState(*(jnp.asarray(x, jnp.float32) for x in restored["kl"]))
        self.score_moments = ppo_math.RunningMoments(*(jnp.asarray(x, jnp.float32) for x in restored["score_moments"]))
        self.iteration = int(restored["iteration"])
        self.skipped_iterations = int(restored["skipped_iterations"])
        return True

    def settings(self) -> dict:
        """What must stay the same for a resumed run to continue this one: the checkpoint
        layout, every `PPOConfig` field, the `TrainerConfig` fields that shape the run, the
        models, reward, tokenizer and prompts. Output-only fields (logging, plots, checkpoint
        cadence, output_dir) may change; so may `iterations`/`total_episodes` under a
        constant learning rate (extending a run), since only decaying schedules depend on it."""
        free = {"output_dir", "resume", "progress", "log_every", "sample_every", "num_samples", "tensorboard", "plot",
                "export_final", "keep_checkpoints", "checkpoint_every", "iterations", "total_episodes"}
        trainer = {k: v for k, v in dataclasses.asdict(self.tc).items() if k not in free}
        if self.tc.lr_schedule != "constant":
            trainer["iterations"] = self.iterations
        return {"checkpoint_layout": checkpoint.LAYOUT, "ppo": dataclasses.asdict(self.config), "trainer": trainer,
                **self._describe}

    # ------------------------------------------------------------------ the loop

    def _open_run(self) -> int:
        """Claim output_dir (lock), check the saved settings, and restore the newest
        checkpoint: all before any compilation. Returns the first iteration to run."""
        tc = self.tc
        log_dir = self._log_dir()
        self._lock = RunLock(log_dir).acquire()
        try:
            saved_metrics = os.path.join(log_dir, "metrics.jsonl")
            existing = os.path.isfile(saved_metrics) or bool(checkpoint.steps(self.checkpoint_dir))
            if not tc.resume and existing:
                raise RunError(f"the output directory {tc.output_dir!r} already holds a run (metrics.jsonl or "
                               "checkpoints) and resume is off; give this run another output_dir, delete the old "
                               "run, or resume it")
            check_settings(tc.output_dir, self.settings(), write=jax.process_index() == 0)
            if tc.resume and self.restore_checkpoint():
                print(f"resumed from iteration {self.iteration} ({self.checkpoint_dir})")
            elif existing and read_metrics(saved_metrics):
                warnings.warn(f"{tc.output_dir!r} holds logged iterations but no checkpoint (none was saved before the "
                              "run stopped): starting again from iteration 0 with the same settings; the logged "
                              "iterations are recomputed", RuntimeWarning, stacklevel=3)
        except BaseException:
            self._lock.release()
            raise
        return self.iteration

    def _log_dir(self) -> str:
        # In multi-host runs process 0 logs to output_dir, the others to their own subfolder.
        if jax.process_index() == 0:
            return self.tc.output_dir
        return os.path.join(self.tc.output_dir, f"process_{jax.process_index()}")

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
        print(f"jaxppo: {self.iterations} iterations x {self.config.batch_size} episodes; updates per iteration = "
              f"ppo_epochs * batch_size / mini_batch_size = {self.config.ppo_epochs} * {self.config.batch_size} / "
              f"{self.config.mini_batch_size} = {self.config.updates_per_step}", flush=True)
        bar = None
        if tc.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.iterations, initial=self.iteration, desc="ppo", dynamic_ncols=True)
        try:
            with _interrupts_raise():
                while self.iteration < self.iterations:
                    finish = self._prepare_iteration()
                    with _interrupts_held(what="this iteration's update"):  # the new state and its line land together
                        metrics = finish()
                        logger.log(metrics, echo=bar is None and (metrics["iteration"] % tc.log_every == 0))
                    if bar is not None:
                        bar.update(1)
                        if "objective/scores" in metrics:
                            bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
                    if tc.sample_every and self.iteration % tc.sample_every == 0 and tc.num_samples:
                        for prompt, response in self.samples(tc.num_samples):
                            text = f"  [{self.iteration}] {prompt!r} -> {response!r}"
                            (bar.write if bar is not None else print)(text)
                    for cb in self.callbacks:
                        cb(metrics["iteration"], metrics)
                    if tc.checkpoint_every and self.iteration % tc.checkpoint_every == 0:
                        with _interrupts_held():  # a signal now would tear the save; it is served after
                            self.save_checkpoint()
        except KeyboardInterrupt:
            logger.close()
            if bar is not None:
                bar.close()
            print(f"\ninterrupted: saving a checkpoint at iteration {self.iteration} ...", flush=True)
            with _interrupts_held(reraise=False):  # a KeyboardInterrupt is on its way out already
                self.save_checkpoint()
            print(f"checkpoint saved at iteration {self.iteration}; run the same command again to resume", flush=True)
            raise
        finally:
            logger.close()
            if bar is not None:
                bar.close()
        with _interrupts_held():
            self.save_checkpoint()  # at the end, whatever checkpoint_every says: a finished run is not redone
        if tc.export_final:
            self.export(os.path.join(tc.output_dir, "final_policy"))
        if tc.plot:
            logger.plot(os.path.join(tc.output_dir, "metrics.png"))
        print(self.summary())
        return self.history

    def policy_params(self):
        return self.spec.policy_params(self.state.params)

    def export(self, path: str):
        """Save the current policy (and tokenizer) as a Hugging Face directory."""
        model = dataclasses.replace(self.policy_model, kind="causal_lm")
        params = self.policy_params()
        if self.tc.shared_trunk:
            params = {"params": {k: v for k, v in params["params"].items() if k != "value_head"}}
        if jax.process_count() > 1:
            params = jax.tree.map(_to_host, params)
            if jax.process_index() != 0:
                return  # one writer

        def write(directory):
            hf_io.save_pretrained(model, params, directory)
            if hasattr(self.tokenizer, "save_pretrained"):
                self.tokenizer.save_pretrained(directory)

        atomic_replace_dir(write, path)  # a kill mid-export leaves the old export or the new one, whole

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
        # Iterations skipped for non-finite scores (skip_nonfinite_scores) have no scores.
        scored = [m for m in h if "objective/scores" in m]
        if len(scored) < len(h):
            lines.append(f"iterations skipped for non-finite scores: {len(h) - len(scored)}")
        if scored:
            n = min(10, max(1, len(scored) // 2))
            first = float(np.mean([m["objective/scores"] for m in scored[:n]]))
            last = float(np.mean([m["objective/scores"] for m in scored[-n:]]))
            kl_last = float(np.mean([m["objective/kl"] for m in scored[-n:]]))
            lines += [f"mean score: first {n} iterations {first:.4f}, last {n} iterations {last:.4f} "
                      f"({last - first:+.4f})",
                      f"mean KL (last {n}): {kl_last:.4f}; kl_coef now {float(self.kl_state.beta):.4f}"]
        lines.append(f"metrics: {os.path.join(self.tc.output_dir, 'metrics.jsonl')}")
        return "\n".join(lines)


# train_step with the old train state donated (its buffers become the new state's): one
# train state in memory during the update instead of two. Module-level, so every trainer
# in a process shares its compiled programs.
_train_step_donating = jax.jit(train_step_fn, static_argnames=("config", "minibatch_sharding"), donate_argnums=(0,))


class _interrupts_raise:
    """SIGTERM raises KeyboardInterrupt (as Ctrl-C does) inside the block, so both end in
    the same checkpoint-and-exit path. Only in the main thread (signals cannot be set
    elsewhere)."""

    def __enter__(self):
        self.previous = None
        try:
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        except ValueError:  # not in the main thread
            pass
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class _interrupts_held:
    """Ctrl-C and SIGTERM inside the block (a checkpoint being written, an iteration's state
    and metrics line being committed) are held: a message says what is being finished, and
    a KeyboardInterrupt is raised once the block is complete (unless `reraise=False`, for a
    block inside the interrupt's own handling). SIGKILL cannot be held; a kill mid-save
    leaves the earlier checkpoints, a kill mid-line a torn line that the resume drops."""

    def __init__(self, reraise: bool = True, what: str = "the checkpoint"):
        self.reraise = reraise
        self.what = what

    def __enter__(self):
        self.received = None
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._hold)
            except ValueError:  # not in the main thread
                pass
        return self

    def _hold(self, signum, frame):
        self.received = signum
        print(f"\n{signal.Signals(signum).name} received: finishing {self.what} first (it takes a moment) ...",
              file=sys.stderr, flush=True)

    def __exit__(self, exc_type, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received is not None and exc_type is None and self.reraise:
            raise KeyboardInterrupt(signal.Signals(self.received).name)


def _qualified_name(fn) -> str:
    if fn is None:
        return "None"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def _describe_model(spec, model, dtype) -> dict:
    """A model's identity for the run settings: its checkpoint path (when loaded from one),
    its architecture, kind and dtypes."""
    out = {"path": os.path.abspath(os.fspath(spec))} if isinstance(spec, (str, os.PathLike)) else {}
    if model is None and isinstance(spec, tuple):
        model = spec[0]
    if model is not None:
        out.update(config=json.loads(model.config.to_json()), kind=model.kind, dtype=str(jnp.dtype(model.dtype)),
                   param_dtype=str(jnp.dtype(model.param_dtype)))
        if model.scan_layers:  # another parameter layout: its checkpoints do not fit the other
            out["scan_layers"] = True
    else:
        out["dtype"] = dtype
    return out


def _to_host(array) -> np.ndarray:
    """A global array as a host numpy array (gathered across processes in multi-host runs)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


@dataclasses.dataclass(frozen=True)
class _LogitsOf:
    """ref_apply for a policy Model: logits only (hashable)."""

    model: Model

    def __call__(self, params, tokens, mask):
        out = self.model.apply(params, tokens, mask)
        return out[0] if isinstance(out, tuple) else out

    def response_outputs(self, params, *args):
        return self.model.response_outputs(params, *args)


def _schedule(lr, kind, warmup, total):
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind == "linear":
        main = optax.linear_schedule(lr, 0.0, max(1, total - warmup))
    else:
        main = optax.cosine_decay_schedule(lr, max(1, total - warmup))
    if warmup:
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])
    return main


def _optimizer(policy_lr, critic_lr, tc: TrainerConfig, shared: bool):
    def adam(lr):
        parts = [clip_by_global_norm(tc.max_grad_norm)] if tc.max_grad_norm else []
        return optax.chain(*parts, optax.adam(lr, eps=tc.adam_eps))

    if shared:
        # One model: the value head gets the critic's learning rate.
        def labels(params):
            return {"params": {k: jax.tree.map(lambda _: "critic" if k == "value_head" else "policy", v)
                               for k, v in params["params"].items()}}
        return optax.multi_transform({"policy": adam(policy_lr), "critic": adam(critic_lr)}, labels)
    return optax.multi_transform({"policy": adam(policy_lr), "critic": adam(critic_lr)},
                                 {"policy": "policy", "critic": "critic"})
