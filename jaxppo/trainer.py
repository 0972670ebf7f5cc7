"""`PPOTrainer`: the RLHF loop around `train_step`.

Each iteration: a batch of prompts (shuffled per dataset epoch with the PRNG key) ->
compiled sampling -> scores -> compiled rollout (log-probs, reference, values, KL-shaped
rewards) -> one compiled `train_step` applying `ppo_epochs * batch_size / mini_batch_size`
updates -> adaptive KL update -> logging, samples, checkpoints. The key of iteration i is
`fold_in(key(seed), i)` and its prompts are a function of i, so a run resumed from a
checkpoint produces exactly the metrics of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import time
import warnings
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxppo import math as ppo_math
from jaxppo import sharding
from jaxppo.config import PPOConfig, _is_int
from jaxppo.engine import TrainState
from jaxppo.models import hf as hf_io
from jaxppo.models.model import Model, PolicyAndCritic
from jaxppo.models.tokenizer import decode_responses, encode_prompts
from jaxppo.ppo import train_step
from jaxppo.rollout import RolloutSpec, check_scores, finish_rollout, sample_responses

__all__ = ["TrainerConfig", "PPOTrainer", "load_prompts"]


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
      resume (continue from the latest checkpoint in output_dir); tensorboard; progress;
      export_final (policy as a Hugging Face directory); plot (PNG of score, KL, reward).
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

    def __post_init__(self):
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
    .jsonl (one object per line with `prompt_column`), .json (a list of strings or objects)."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(path):
            raise ValueError(f"prompts file {path!r} does not exist")
        if path.endswith(".jsonl"):
            with open(path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
            prompts = [row[prompt_column] if isinstance(row, dict) else row for row in rows]
        elif path.endswith(".json"):
            with open(path) as f:
                rows = json.load(f)
            prompts = [row[prompt_column] if isinstance(row, dict) else row for row in rows]
        else:
            with open(path) as f:
                prompts = [line.rstrip("\n") for line in f if line.strip()]
    elif hasattr(source, "column_names"):
        if prompt_column not in source.column_names:
            raise ValueError(f"the dataset has no column {prompt_column!r}; columns: {list(source.column_names)}")
        prompts = list(source[prompt_column])
    else:
        prompts = list(source)
    if not prompts:
        raise ValueError("no prompts: the prompt list is empty")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise TypeError(f"prompts must be strings; rows {bad[:5]} are not")
    return prompts


def _load_model(spec, kind, dtype):
    if isinstance(spec, (str, os.PathLike)):
        return hf_io.from_pretrained(os.fspath(spec), dtype=dtype, kind=kind)
    model, params = spec
    if not isinstance(model, Model):
        raise TypeError(f"expected a checkpoint path or a (jaxppo.models.Model, params) pair, got {type(model).__name__}")
    return model, params


def _trunk_key(model: Model) -> str:
    return "transformer" if model.config.model_type == "gpt2" else "model"


def _critic_from(model: Model, params, zero_head: bool):
    """A "value" Model + params whose trunk is a copy of `model`'s trunk."""
    critic = dataclasses.replace(model, kind="value")
    trunk = _trunk_key(model)
    inner = params["params"]
    if zero_head or "score" not in inner:
        head = {"kernel": jnp.zeros((model.config.hidden_size, 1), jnp.dtype(model.param_dtype))}
    else:
        head = {"kernel": inner["score"]["kernel"][:, :1]}
    return critic, {"params": {trunk: jax.tree.map(jnp.array, inner[trunk]), "score": head}}


class PPOTrainer:
    """RLHF with PPO: rollouts from prompts, rewards, and compiled `train_step` updates.

    Args:
      config: `PPOConfig` (sizes, clipping, coefficients, `kl_coef`, `temperature`).
      trainer_config: `TrainerConfig`.
      policy: a local Hugging Face causal-LM directory, or `(Model, params)`.
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
      dtype: compute/param dtype of models loaded from paths.
      prompt_column: column or field holding prompts in datasets and JSON files.
      callbacks: functions `cb(iteration, metrics)` called after each iteration.
      mesh: None (one device), a `jaxppo.sharding.MeshConfig`, or a `jax.sharding.Mesh`
        with axes ("data", "fsdp", "tensor"): parameters and optimizer states are sharded
        by `jaxppo.sharding.tree_shardings`, rollout rows split over the data axes.
    """

    def __init__(self, config: PPOConfig, trainer_config: TrainerConfig, *, policy, tokenizer, prompts,
                 reward_model=None, reward_fn: Optional[Callable] = None, reward_fn_on: str = "text",
                 ref_policy=None, critic=None, dtype: str = "float32", prompt_column: str = "prompt",
                 callbacks: Sequence[Callable] = (), mesh=None):
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
        policy_model, policy_params = _load_model(policy, "causal_lm", dtype)
        if policy_model.kind != "causal_lm":
            policy_model = dataclasses.replace(policy_model, kind="causal_lm")
            policy_params = {"params": {k: v for k, v in policy_params["params"].items() if k != "value_head"}}
        if ref_policy is None:
            ref_model, ref_params = policy_model, jax.tree.map(jnp.array, policy_params)
        else:
            ref_model, ref_params = _load_model(ref_policy, "causal_lm", dtype)
        self.reward_model = None
        reward_params = None
        if reward_model is not None:
            self.reward_model, reward_params = _load_model(reward_model, "reward", dtype)
            if self.reward_model.kind != "reward":
                raise ValueError(f"reward_model must be of kind 'reward', got {self.reward_model.kind!r}")
        if tc.shared_trunk:
            model = dataclasses.replace(policy_model, kind="causal_lm_value")
            head = {"kernel": jnp.zeros((model.config.hidden_size, 1), jnp.float32), "bias": jnp.zeros((1,), jnp.float32)}
            params = {"params": dict(policy_params["params"], value_head=head)}
            apply_fn, params_key, self.policy_model = model.apply, None, model
        else:
            if critic is not None:
                critic_model, critic_params = _load_model(critic, "value", dtype)
                if critic_model.kind != "value":
                    critic_model, critic_params = _critic_from(critic_model, critic_params, zero_head=False)
            elif self.reward_model is not None:
                critic_model, critic_params = _critic_from(self.reward_model, reward_params, zero_head=False)
            else:
                critic_model, critic_params = _critic_from(policy_model, policy_params, zero_head=True)
            apply_fn = PolicyAndCritic(policy_model, critic_model)
            params = {"policy": policy_params, "critic": critic_params}
            params_key, self.policy_model = "policy", policy_model
        self.ref_params = ref_params
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
        self._train_step = functools.partial(train_step, config=config)
        if mesh is not None:
            self.mesh = mesh if isinstance(mesh, jax.sharding.Mesh) else sharding.make_mesh(mesh)
            sharding.check_batch_divides(config, self.mesh)
            self.state = sharding.shard_state(self.state, self.mesh)
            self.ref_params = sharding.shard_state(self.ref_params, self.mesh)
            if self.reward_params is not None:
                self.reward_params = sharding.shard_state(self.reward_params, self.mesh)
            self._train_step = sharding.sharded_train_step(self.state, config, self.mesh)
        self.iteration = 0
        self.history: list = []
        self._base_key = jax.random.key(tc.seed)

    # ------------------------------------------------------------------ data

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
        gen = sample_responses(self.spec, self.state.params, ids, mask, k_sample)
        jax.block_until_ready(gen.tokens)
        t1 = time.perf_counter()
        host_scores = None
        if self.reward_fn is not None:
            responses = decode_responses(self.tokenizer, _to_host(gen.tokens), _to_host(gen.mask))
            host_scores = jnp.asarray(check_scores(self.reward_fn([self.prompts[r] for r in rows], responses), len(rows)))
        rollout, stats, moments = finish_rollout(self.spec, self.state.params, self.ref_params, self.reward_params,
                                                 ids, mask, gen, host_scores, self.kl_state, self.score_moments)
        jax.block_until_ready(rollout.rewards)
        t2 = time.perf_counter()
        step_before = int(self.state.step)
        if self.mesh is not None:
            rollout = sharding.shard_batch(rollout, self.mesh)
        state, metrics = self._train_step(self.state, rollout, k_train)
        jax.block_until_ready(state.params)
        t3 = time.perf_counter()
        applied = int(state.step) - step_before
        nonfinite = int(metrics["ppo/updates_nonfinite"])
        if nonfinite:
            warnings.warn(f"iteration {it}: {nonfinite} of {self.config.updates_per_step} updates had a non-finite "
                          "loss or gradient and were skipped (parameters untouched)", RuntimeWarning, stacklevel=2)
        self.state = state
        self.score_moments = moments
        self.kl_state = ppo_math.adaptive_kl_update(self.kl_state, stats["objective/kl"], self.config.batch_size)
        self.iteration = it + 1

        out = {"iteration": it, "episode": (it + 1) * self.config.batch_size}
        for name, value in {**stats, **metrics}.items():
            if not name.startswith("per_minibatch/"):
                out[name] = float(value)
        out["ppo/updates_applied"] = applied
        out["ppo/updates_total"] = int(state.step)
        out["lr"] = float(self.policy_schedule(step_before))
        out["time/generation"] = t1 - t0
        out["time/scoring"] = t2 - t1
        out["time/update"] = t3 - t2
        out["eps"] = self.config.batch_size / (t3 - t0)
        self._last_samples = (rows, gen)
        return out

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
            "key": np.asarray(jax.random.key_data(self._base_key)),
        }

    def _manager(self):
        import orbax.checkpoint as ocp

        directory = os.path.abspath(os.path.join(self.tc.output_dir, "checkpoints"))
        return ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.tc.keep_checkpoints))

    def save_checkpoint(self):
        """Save params, optimizer state, KL controller, score statistics, data position and
        key at the current iteration (orbax)."""
        import orbax.checkpoint as ocp

        manager = self._manager()
        if self.iteration not in manager.all_steps():
            manager.save(self.iteration, args=ocp.args.StandardSave(self._checkpoint_tree()))
        manager.wait_until_finished()
        manager.close()

    def restore_checkpoint(self) -> bool:
        """Restore the latest checkpoint in output_dir, if any; True if one was restored."""
        import orbax.checkpoint as ocp

        manager = self._manager()
        latest = manager.latest_step()
        if latest is None:
            manager.close()
            return False
        template = self._checkpoint_tree()
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
            template)
        restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
        manager.close()
        restored = jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(restored))
        if not np.array_equal(np.asarray(restored["key"]), np.asarray(template["key"])):
            raise ValueError(f"the checkpoint in {self.tc.output_dir!r} was written with another seed; "
                             "use the same seed to resume, or another output_dir")
        self.state = self.state.replace(params=restored["params"], opt_state=restored["opt_state"],
                                        step=restored["step"], skipped_nonfinite=restored["skipped_nonfinite"])
        self.kl_state = ppo_math.KLControllerState(*(jnp.asarray(x, jnp.float32) for x in restored["kl"]))
        self.score_moments = ppo_math.RunningMoments(*(jnp.asarray(x, jnp.float32) for x in restored["score_moments"]))
        self.iteration = int(restored["iteration"])
        return True

    # ------------------------------------------------------------------ the loop

    def train(self):
        """Run until `iterations` iterations are done; return the list of per-iteration
        metrics. Writes output_dir/metrics.jsonl (and TensorBoard events), prints progress
        and samples, checkpoints, and at the end exports the policy and plots."""
        from jaxppo.logger import Logger

        tc = self.tc
        os.makedirs(tc.output_dir, exist_ok=True)
        if tc.resume and self.restore_checkpoint():
            print(f"resumed from iteration {self.iteration} ({os.path.join(tc.output_dir, 'checkpoints')})")
        # In multi-host runs process 0 logs to output_dir, the others to their own subfolder.
        log_dir = tc.output_dir if jax.process_index() == 0 else os.path.join(tc.output_dir, f"process_{jax.process_index()}")
        logger = Logger(log_dir, start_iteration=self.iteration, tensorboard=tc.tensorboard)
        self.history = logger.history
        print(f"jaxppo: {self.iterations} iterations x {self.config.batch_size} episodes; updates per iteration = "
              f"ppo_epochs * batch_size / mini_batch_size = {self.config.ppo_epochs} * {self.config.batch_size} / "
              f"{self.config.mini_batch_size} = {self.config.updates_per_step}")
        bar = None
        if tc.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.iterations, initial=self.iteration, desc="ppo", dynamic_ncols=True)
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            raise KeyboardInterrupt("SIGTERM")

        try:
            signal.signal(signal.SIGTERM, on_term)
        except ValueError:  # not in the main thread
            previous = None
        try:
            while self.iteration < self.iterations:
                metrics = self.step()
                logger.log(metrics, echo=bar is None and (metrics["iteration"] % tc.log_every == 0))
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.3f}")
                if tc.sample_every and self.iteration % tc.sample_every == 0 and tc.num_samples:
                    for prompt, response in self.samples(tc.num_samples):
                        text = f"  [{self.iteration}] {prompt!r} -> {response!r}"
                        (bar.write if bar is not None else print)(text)
                for cb in self.callbacks:
                    cb(metrics["iteration"], metrics)
                if tc.checkpoint_every and self.iteration % tc.checkpoint_every == 0:
                    self.save_checkpoint()
        except KeyboardInterrupt:
            logger.close()
            if bar is not None:
                bar.close()
            self.save_checkpoint()
            print(f"\ninterrupted: checkpoint saved at iteration {self.iteration}; run again to resume")
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        if bar is not None:
            bar.close()
        logger.close()
        if tc.checkpoint_every:
            self.save_checkpoint()
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
        hf_io.save_pretrained(model, params, path)
        if hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(path)

    def summary(self) -> str:
        h = self.history
        if not h:
            return "no iterations were run"
        n = min(10, max(1, len(h) // 2))
        first = float(np.mean([m["objective/scores"] for m in h[:n]]))
        last = float(np.mean([m["objective/scores"] for m in h[-n:]]))
        kl_last = float(np.mean([m["objective/kl"] for m in h[-n:]]))
        lines = [
            "",
            "== summary ==",
            f"iterations: {len(h)} (of {self.iterations}), episodes: {h[-1]['episode']}",
            f"updates per iteration: {self.config.updates_per_step} = ppo_epochs {self.config.ppo_epochs} * "
            f"batch_size {self.config.batch_size} / mini_batch_size {self.config.mini_batch_size}; "
            f"applied in total: {int(self.state.step)}",
            f"mean score: first {n} iterations {first:.4f}, last {n} iterations {last:.4f} ({last - first:+.4f})",
            f"mean KL (last {n}): {kl_last:.4f}; kl_coef now {float(self.kl_state.beta):.4f}",
            f"metrics: {os.path.join(self.tc.output_dir, 'metrics.jsonl')}",
        ]
        return "\n".join(lines)


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
        parts = [optax.clip_by_global_norm(tc.max_grad_norm)] if tc.max_grad_norm else []
        return optax.chain(*parts, optax.adam(lr, eps=tc.adam_eps))

    if shared:
        # One model: the value head gets the critic's learning rate.
        def labels(params):
            return {"params": {k: jax.tree.map(lambda _: "critic" if k == "value_head" else "policy", v)
                               for k, v in params["params"].items()}}
        return optax.multi_transform({"policy": adam(policy_lr), "critic": adam(critic_lr)}, labels)
    return optax.multi_transform({"policy": adam(policy_lr), "critic": adam(critic_lr)},
                                 {"policy": "policy", "critic": "critic"})
