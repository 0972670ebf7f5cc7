"""Reward-model training: Bradley-Terry on preference pairs (TRL 1.12's `RewardTrainer`)
with jaxppo's compiled mini-batch loop, exported as a Hugging Face
`...ForSequenceClassification` directory that transformers and jaxppo's trainers load.

    trainer = jaxppo.RewardTrainer("path/to/sft", "pairs.jsonl",
                                   config=jaxppo.RewardModelConfig.from_settings(eval_fraction=0.1))
    trainer.train()            # checkpoints, metrics.jsonl, and <output_dir>/reward_model

How a run walks the pairs. The training pairs are read in an order reshuffled every epoch
(epoch e: a permutation from the seed); step s takes positions [s * batch_size,
(s + 1) * batch_size) of that stream, `ceil(epochs * pairs / batch_size)` steps in all, and
one compiled call of `update_epochs` (ppo_epochs 1) applies `batch_size / mini_batch_size`
optimizer updates to them, each on `mini_batch_size` pairs (split into
`gradient_accumulation_steps` equal micro-batches). No pair is dropped: where the last step
reaches past an epoch's end it takes the first pairs of the next epoch's order. A step is
a pure function of the state and the step number, so a run killed at any point and
started again resumes from its newest checkpoint exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config.optimizer import build_optimizer
from jaxppo.config.reward_model import EXPORT_DIR, REWARD_OPTIMIZER, RewardModelConfig
from jaxppo.models.family import family_of
from jaxppo.run import loop
from jaxppo.run.callbacks import Hooks
from jaxppo.run.directory import RunDirectory
from jaxppo.run.logger import Logger
from jaxppo.run.preferences import PreferencePairs, check_pairs, read_pairs, tokenize_pairs
from jaxppo.update.minibatches import Freeze, TrainState, update_epochs_fn
from jaxppo.update.preference import bradley_terry_loss, pair_scores, preference_loss_fn

__all__ = ["RewardModelConfig", "RewardTrainer", "RewardState", "REWARD_OPTIMIZER", "EXPORT_DIR", "load_reward_model"]

SCORE_INIT_STD = 0.02  # the new score head's init, transformers' usual initializer_range


class RewardState(flax.struct.PyTreeNode):
    """What a reward-model run carries from one step to the next (what a checkpoint holds):
    the `TrainState`, the steps done (`iteration`, a Python int) and the run's key (the
    pair order and each step's mini-batch order derive from it)."""

    train: TrainState
    iteration: Any
    key: jax.Array

    def checkpoint_tree(self) -> dict:
        s = self.train
        return {"params": s.trained_params(), "opt_state": s.opt_state, "step": s.step,
                "skipped_nonfinite": s.skipped_nonfinite, "iteration": np.asarray(self.iteration, np.int32),
                "key": np.asarray(jax.random.key_data(self.key))}

    def restored(self, tree: dict) -> "RewardState":
        train = self.train.with_trained(tree["params"]).replace(
            opt_state=tree["opt_state"], step=tree["step"], skipped_nonfinite=tree["skipped_nonfinite"])
        return self.replace(train=train, iteration=int(tree["iteration"]))


def load_reward_model(spec, dtype: str = "float32", param_dtype: str = "float32", seed: int = 0):
    """(Model, params) of kind "reward" (one label): a local `...ForSequenceClassification`
    directory as it is, a causal-LM directory (an SFT checkpoint) with a new score head
    drawn from normal(0, 0.02) with `seed`, or a `(Model, params)` pair of kind "reward" or
    "value" (the same head)."""
    from jaxppo.models import hf as hf_io
    from jaxppo.models.model import Model

    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        config = hf_io.read_json_object(os.path.join(path, "config.json")) if os.path.isdir(path) else {}
        archs = config.get("architectures") or []
        if any(str(a).endswith("ForSequenceClassification") for a in archs):
            if int(config.get("num_labels") or len(config.get("id2label") or {0: 0})) != 1:
                raise ValueError(f"{path} is a sequence-classification checkpoint with "
                                 f"{config.get('num_labels') or len(config['id2label'])} labels; a reward model has "
                                 "one (num_labels=1)")
            return hf_io.from_pretrained(path, dtype=dtype, param_dtype=param_dtype, kind="reward")
        # A causal LM: its trunk, and a new score head (the value kind reads the trunk and
        # leaves the head at zero), drawn as transformers draws it.
        model, params = hf_io.from_pretrained(path, dtype=dtype, param_dtype=param_dtype, kind="value")
        model = dataclasses.replace(model, kind="reward", config=dataclasses.replace(model.config, num_labels=1))
        kernel = params["params"]["score"]["kernel"]
        drawn = SCORE_INIT_STD * jax.random.normal(jax.random.fold_in(jax.random.key(seed), 11), kernel.shape)
        params = {**params, "params": {**params["params"], "score": {"kernel": drawn.astype(kernel.dtype)}}}
        return model, params
    model, params = spec
    if not isinstance(model, Model) or model.kind not in ("reward", "value"):
        raise TypeError("the reward model must be a local checkpoint directory (a causal LM or a "
                        "...ForSequenceClassification) or a (jaxppo.models.Model, params) pair of kind 'reward'; got "
                        f"{type(model).__name__}" + (f" of kind {model.kind!r}" if isinstance(model, Model) else ""))
    if model.kind == "value" or model.config.num_labels != 1:
        model = dataclasses.replace(model, kind="reward", config=dataclasses.replace(model.config, num_labels=1))
    return model, params


class Step(NamedTuple):
    """A step's outcome (what the loop logs): the state after it and its metrics line."""

    run: RewardState
    metrics: dict


class RewardTrainer:
    """Train a reward model on preference pairs (module doc).

    Args:
      model: a local directory (a causal LM such as an SFT checkpoint, which gets a new
        score head, or a `...ForSequenceClassification` with one label), or a
        `(jaxppo.models.Model, params)` pair of kind "reward".
      pairs: the training pairs: a .jsonl/.json file, a list of dicts or a
        `datasets.Dataset`, in TRL's preference formats (`jaxppo.run.preferences`).
      config: a `RewardModelConfig` (defaults: TRL's).
      eval_pairs: held-out pairs (the same formats), instead of `eval_fraction`.
      tokenizer: the tokenizer; default: the one in `model`'s directory (a `(Model, params)`
        pair needs one unless the pairs are token ids).
      callbacks: as `jaxppo.Trainer`'s (a function `cb(step, metrics)` or a
        `jaxppo.Callback`, whose hooks receive this trainer).

    Every input is checked and tokenized before the weights load; a problem is a
    ValueError or TypeError naming the row or setting and what would be valid.

    A run is the policy trainer's loop (`jaxppo.run.loop`) on its own steps: the same run
    directory (lock, settings, checkpoints, resume), trackers, callbacks, Ctrl-C and
    SIGTERM handling; what differs is here: the pairs, the Bradley-Terry step and its
    evaluation on held-out pairs.
    """

    def __init__(self, model, pairs, *, config: Optional[RewardModelConfig] = None, eval_pairs=None, tokenizer=None,
                 callbacks: Sequence = ()):
        config = RewardModelConfig() if config is None else config
        if not isinstance(config, RewardModelConfig):
            raise TypeError(f"config must be a jaxppo.RewardModelConfig, got {type(config).__name__}")
        self.config, self.callbacks = config, list(callbacks)
        self.tokenizer, self.pairs, self.eval_pairs, self.dropped = _prepared_pairs(model, pairs, eval_pairs, tokenizer,
                                                                                    config)
        self.steps = math.ceil(config.pairs.epochs * len(self.pairs) / config.batch.batch_size)
        self.total_updates = self.steps * config.batch.num_minibatches
        # The weights, after every input is known to be good.
        self.model, params, freeze = _trained_model(model, config, getattr(self.tokenizer, "pad_token_id", None))
        family_of(self.model.config).architecture(self.model.config.model_type, "reward")  # exportable, before training
        is_path = isinstance(model, (str, os.PathLike))
        self.source = os.path.abspath(os.fspath(model)) if is_path else "(Model, params)"
        self.learning_rate, tx = build_optimizer(config.optimizer, self.total_updates, critic=False)
        train = TrainState.create(apply_fn=self.model.apply, params=params, tx=tx, freeze=freeze)
        self.run = RewardState(train, 0, jax.random.key(config.run.seed))
        self.directory, self.history, self.last = RunDirectory(config.run), [], None
        loss_fn = preference_loss_fn(self.model.apply, config.pairs.center_rewards_coefficient)
        self._update = jax.jit(functools.partial(update_epochs_fn, loss_fn=loss_fn, config=config.batch),
                               donate_argnums=0)
        self._scores = jax.jit(lambda params, tokens, mask: pair_scores(self.model.apply, params, tokens, mask))

    @property
    def state(self) -> TrainState:
        """The `TrainState`: parameters, optimizer state, update counters."""
        return self.run.train

    @property
    def step(self) -> int:
        """Steps completed (the next step's index)."""
        return self.run.iteration

    @property
    def iteration(self) -> int:
        return self.run.iteration

    # -- the data stream ------------------------------------------------------------

    def rows_of_step(self, step: int) -> np.ndarray:
        """The training pairs (rows of `self.pairs`) step `step` trains on (module doc)."""
        from jaxppo.rollout.prompts import prompt_stream

        size = self.config.batch.batch_size
        return prompt_stream(self.run.key, len(self.pairs), step * size, size)

    # -- what the loop asks of a run (`jaxppo.run.session`) ---------------------------

    @property
    def total(self) -> int:
        return self.steps

    @property
    def title(self) -> str:
        b = self.config.batch
        return (f"jaxppo reward-model: {self.steps} steps x {b.batch_size} pairs ({len(self.pairs)} pairs, "
                f"{self.config.pairs.epochs:g} epochs); optimizer updates per step = batch_size / mini_batch_size = "
                f"{b.batch_size} / {b.mini_batch_size} = {b.num_minibatches}")

    description = "reward model"

    def prepare(self) -> np.ndarray:
        """The next step's pairs (rows of `self.pairs`)."""
        return self.rows_of_step(self.run.iteration)

    def complete(self, rows: np.ndarray) -> Step:
        """The step on `rows`: `batch_size / mini_batch_size` optimizer updates (the old train
        state's buffers are donated), the evaluation due after it, its metrics line."""
        start, c, run = time.perf_counter(), self.config, self.run
        batch = jax.tree.map(jnp.asarray, self.pairs.arrays(rows))
        updates_before = int(run.train.step)
        train, metrics = self._update(run.train, batch, jax.random.fold_in(run.key, run.iteration))
        self.run = run.replace(train=train, iteration=run.iteration + 1)
        applied = np.asarray(metrics["applied"])
        aux = jax.tree.map(np.asarray, metrics["aux"])
        out = {"iteration": run.iteration, "episode": self.run.iteration * c.batch.batch_size,  # pairs seen
               "loss": float(np.mean(metrics["loss"])), "grad_norm": float(np.mean(metrics["grad_norm"])),
               "rewards/accuracy": float(np.mean(aux["accuracy"])), "rewards/margin": float(np.mean(aux["margin"])),
               "rewards/chosen": float(np.mean(aux["chosen"])), "rewards/rejected": float(np.mean(aux["rejected"])),
               "learning_rate": float(self.learning_rate(updates_before)), "updates": int(train.step),
               "skipped_updates": int(applied.size - applied.sum()),
               "epoch": self.run.iteration * c.batch.batch_size / len(self.pairs)}
        out["time/step"] = time.perf_counter() - start
        done, every = self.run.iteration == self.steps, c.pairs.eval_every
        if self.eval_pairs is not None and (done or (every and self.run.iteration % every == 0)):
            out.update({f"eval/{k}": v for k, v in self.evaluate().items()})
        self.last = Step(self.run, out)
        return self.last

    def tables(self, outcome: Step) -> list:
        return []

    def periodic(self, run: RewardState) -> None:
        return None

    def finish(self, run_config) -> None:
        """The trained model, exported to `<output_dir>/reward_model`."""
        self.save_pretrained(os.path.join(run_config.output_dir, EXPORT_DIR))

    def summary(self, history: list) -> str:
        last = history[-1] if history else {}
        shown = "  ".join(f"{k} {last[k]:.4g}" for k in ("loss", "rewards/accuracy", "eval/loss", "eval/accuracy")
                          if k in last)
        return (f"reward model: {self.run.iteration} steps ({int(self.state.step)} updates); last step: {shown}; "
                f"exported to {os.path.join(self.config.run.output_dir, EXPORT_DIR)}")

    panels = (("loss", "loss"), ("rewards/accuracy", "accuracy"), ("eval/accuracy", "eval accuracy (held-out pairs)"))

    # -- training ------------------------------------------------------------------

    def settings(self) -> dict:
        """What a resumed run must match: the settings (not those free on resume: the
        directory, cadences, trackers, progress bar), the model and the pairs."""
        return {"reward_model": {"model": self.source, "pairs": len(self.pairs), "pairs_digest": _digest(self.pairs),
                                 "eval_pairs": 0 if self.eval_pairs is None else len(self.eval_pairs),
                                 "steps": self.steps, **self.config.settings(recorded=True)}}

    def train_step(self) -> dict:
        """One step (module doc): `batch_size / mini_batch_size` optimizer updates on the
        step's pairs. Returns the step's metrics (means over its updates)."""
        return self.complete(self.prepare()).metrics

    def train(self) -> dict:
        """Run (or resume) the whole run in `config.run.output_dir`: steps, evaluations,
        checkpoints, metrics through the trackers, and the exported model in
        `<output_dir>/reward_model`. Returns the last step's metrics (with the last
        evaluation's). Ctrl-C or SIGTERM saves a checkpoint; the same call resumes."""
        run_config = self.config.run
        self.run = self.directory.open(self.run, self.settings())
        logger = Logger(self.directory.log_dir, start_iteration=self.run.iteration,
                        report_to=run_config.trackers if jax.process_index() == 0 else ("jsonl",),
                        config={**self.settings()["reward_model"], **self.config.settings()})
        self.history = logger.history
        hooks = Hooks(self.callbacks, self)
        try:
            hooks.begin()
            loop.run_loop(self, directory=self.directory, logger=logger, hooks=hooks, run_config=run_config)
        finally:
            self.directory.close()
        loop.finish_run(self, directory=self.directory, logger=logger, run_config=run_config)
        hooks.end(self.history)
        return dict(self.history[-1]) if self.history else {}

    # -- evaluation and use ----------------------------------------------------------

    def pair_scores(self, pairs: Optional[PreferencePairs] = None) -> tuple:
        """(chosen, rejected) scores, float32 (N,), of `pairs` (default: the held-out pairs),
        in blocks of `mini_batch_size` pairs (the last block padded with copies of its
        first pair, whose scores are dropped)."""
        pairs = self.eval_pairs if pairs is None else pairs
        if pairs is None:
            raise ValueError("no held-out pairs: give eval_pairs or eval_fraction > 0 (PairConfig)")
        size, n = self.config.batch.mini_batch_size, len(pairs)
        chosen, rejected = [], []
        for start in range(0, n, size):
            rows = np.arange(start, min(start + size, n))
            rows = np.concatenate([rows, np.full(size - len(rows), rows[0])])
            block = pairs.arrays(rows)
            c, r = self._scores(self.state.params, block["tokens"], block["mask"])
            keep = min(size, n - start)
            chosen.append(np.asarray(c)[:keep])
            rejected.append(np.asarray(r)[:keep])
        return np.concatenate(chosen), np.concatenate(rejected)

    def evaluate(self, pairs: Optional[PreferencePairs] = None) -> dict:
        """Loss, accuracy (chosen scored strictly higher), mean margin and mean scores over
        `pairs` (default: the held-out pairs)."""
        pairs = self.eval_pairs if pairs is None else pairs
        chosen, rejected = self.pair_scores(pairs)
        loss, stats = bradley_terry_loss(jnp.asarray(chosen), jnp.asarray(rejected), jnp.asarray(pairs.margin),
                                         self.config.pairs.center_rewards_coefficient)
        return {"loss": float(loss), "accuracy": float(stats["accuracy"]), "margin": float(stats["margin"]),
                "chosen": float(stats["chosen"]), "rejected": float(stats["rejected"])}

    def save_pretrained(self, path: str):
        """Write the reward model as a Hugging Face `...ForSequenceClassification` directory
        (one label; LoRA adapters merged) with the tokenizer, checksummed, replacing `path`
        atomically: `transformers.AutoModelForSequenceClassification` and jaxppo's trainers
        (`reward_model=path`) load it."""
        from jaxppo.run.outputs import export_reward_model

        export_reward_model(self.model, self.state.params, self.tokenizer, path)


def _prepared_pairs(model, pairs, eval_pairs, tokenizer, config: RewardModelConfig):
    """(tokenizer, training pairs, held-out pairs or None, {source: pairs dropped}): every
    row read, checked and tokenized (`jaxppo.run.preferences`), the held-out share split off
    with the seed; errors name the row or setting."""
    from jaxppo.models.tokenizer import load_tokenizer

    rows, labels = read_pairs(pairs, "pairs")
    fmt = check_pairs(rows, labels, "pairs")
    held = None
    if eval_pairs is not None:
        if config.pairs.eval_fraction:
            raise ValueError(f"give eval_pairs or PairConfig.eval_fraction={config.pairs.eval_fraction}, not both")
        held = read_pairs(eval_pairs, "eval_pairs")
        held_fmt = check_pairs(*held, "eval_pairs")
        if held_fmt != fmt:
            raise ValueError(f"eval_pairs are {held_fmt} pairs but the training pairs are {fmt} pairs; give both in "
                             "one format")
    is_path = isinstance(model, (str, os.PathLike))
    if tokenizer is None:
        if is_path:
            tokenizer = load_tokenizer(os.fspath(model))
        elif fmt != "tokens":
            raise ValueError("give tokenizer= with a (Model, params) reward model, or give the pairs as token ids "
                             "(chosen_ids, rejected_ids)")
    encode = functools.partial(tokenize_pairs, tokenizer, max_length=config.pairs.max_length, overlong=config.pairs.overlong_pairs,
                               vocab_size=_vocabulary(model), pad_id=getattr(tokenizer, "pad_token_id", None))
    train, dropped = encode(rows, labels, what="pairs")
    dropped = {"pairs": dropped}
    held_out = None
    if held is not None:
        held_out, dropped["eval_pairs"] = encode(*held, what="eval_pairs")
    elif config.pairs.eval_fraction:
        order = np.random.default_rng(config.run.seed).permutation(len(train))
        n_eval = max(1, int(round(config.pairs.eval_fraction * len(train))))
        if n_eval >= len(train):
            raise ValueError(f"PairConfig.eval_fraction={config.pairs.eval_fraction} holds out all {len(train)} pairs; "
                             "lower it")
        held_out, train = train.take(np.sort(order[:n_eval])), train.take(np.sort(order[n_eval:]))
    for name, count in dropped.items():
        if count:
            print(f"reward model: {count} {name} longer than max_length={config.pairs.max_length} tokens left out "
                  "(overlong_pairs='drop')", flush=True)
    if len(train) < config.batch.batch_size:
        raise ValueError(f"BatchConfig.batch_size={config.batch.batch_size} is more than the {len(train)} training "
                         f"pairs; give batch_size <= {len(train)} (a multiple of mini_batch_size="
                         f"{config.batch.mini_batch_size})")
    return tokenizer, train, held_out, dropped


def _vocabulary(model) -> Optional[int]:
    """The vocabulary size of a checkpoint directory or a (Model, params) pair, read without
    loading weights (None where unknown)."""
    from jaxppo.models import hf as hf_io

    if isinstance(model, (str, os.PathLike)):
        path = os.path.join(os.fspath(model), "config.json")
        return hf_io.read_json_object(path).get("vocab_size") if os.path.isfile(path) else None
    if isinstance(model, tuple) and len(model) == 2:
        return getattr(getattr(model[0], "config", None), "vocab_size", None)
    return None


def _trained_model(model, config: RewardModelConfig, pad_id: Optional[int]):
    """(Model, params, Freeze or None): the reward model loaded (`load_reward_model`), its
    padding token the tokenizer's (`pad_id`, as TRL sets it: the score is read at the last
    token that is not padding), with LoRA adapters added where asked (then only they and the
    score head train)."""
    lora, dtype = config.lora.lora, config.layout.dtype
    param_dtype = dtype if lora is not None else "float32"
    model, params = load_reward_model(model, dtype, param_dtype, config.run.seed)
    if pad_id is not None:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, pad_token_id=int(pad_id)))
    if lora is None:
        return model, params, None
    from jaxppo.models.adapters import add_lora

    if model.lora is not None:
        raise ValueError("the reward model already has LoRA adapters; drop lora_rank (AdapterConfig), or give the base "
                         "model")
    model, params = add_lora(model, params, lora, jax.random.fold_in(jax.random.key(config.run.seed), 7))
    return model, params, Freeze(prefixes=(("params",),), unless=(("params", "score"),))  # adapters and head train


def _digest(pairs: PreferencePairs) -> str:
    import hashlib

    h = hashlib.sha256()
    for array in (pairs.tokens, pairs.mask, pairs.margin):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]
