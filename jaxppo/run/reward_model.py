"""Reward-model training: Bradley-Terry on preference pairs (TRL 1.12's `RewardTrainer`)
with jaxppo's compiled mini-batch loop, exported as a Hugging Face
`...ForSequenceClassification` directory that transformers and jaxppo's trainers load.

    trainer = jaxppo.RewardTrainer("path/to/sft", "pairs.jsonl",
                                   config=jaxppo.RewardModelConfig(eval_fraction=0.1))
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
import json
import math
import os
import time
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.config.optimizer import OptimizerConfig, build_optimizer
from jaxppo.errors import RunError, name_the_flag
from jaxppo.models.lora import LoraConfig
from jaxppo.run import checkpoints
from jaxppo.run.preferences import PreferencePairs, check_pairs, read_pairs, tokenize_pairs
from jaxppo.update.checks import invalid, is_int
from jaxppo.update.minibatches import BatchConfig, Freeze, TrainState, check_sizes, update_epochs_fn
from jaxppo.update.preference import bradley_terry_loss, pair_scores, preference_loss_fn

__all__ = ["RewardModelConfig", "RewardTrainer", "REWARD_OPTIMIZER", "load_reward_model"]

# TRL 1.12's RewardConfig optimizer defaults (TrainingArguments': AdamW, linear decay,
# epsilon 1e-8, gradient clipping at 1.0; RewardConfig's learning rate 1e-4).
REWARD_OPTIMIZER = OptimizerConfig(learning_rate=1e-4, lr_schedule="linear", adam_eps=1e-8, max_grad_norm=1.0)
DTYPES = ("float32", "bfloat16", "float16")
SCORE_INIT_STD = 0.02  # the new score head's init, transformers' usual initializer_range
EXPORT_DIR = "reward_model"


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """The settings of a reward-model run (`RewardTrainer`).

    Attributes:
      batch_size: pairs per step (one compiled call of the mini-batch loop).
      mini_batch_size: pairs per optimizer update (TRL's per-device batch size times its
        accumulation steps); divides `batch_size`.
      gradient_accumulation_steps: equal micro-batches one update's pairs are split into
        (less memory; the same update).
      epochs: passes over the training pairs (> 0; a fraction allowed); the run has
        `ceil(epochs * pairs / batch_size)` steps.
      center_rewards_coefficient: None, or >= 0: add this times mean((r_c + r_r)^2) to the
        loss (TRL's; 0.01 is its recommendation).
      max_length: the longest sequence (tokens) a pair may have; None: no limit.
      overlong_pairs: "error" (a pair past `max_length` stops the run before it starts,
        naming it) or "drop" (such pairs are left out and counted, TRL's filter).
      eval_fraction: the share of the pairs held out for evaluation, in [0, 1) (chosen by
        the seed); 0 with no `eval_pairs`: no evaluation.
      eval_every: evaluate every this many steps (and after the last); 0: after the last.
      save_every: checkpoint every this many steps (and after the last); 0: after the last.
      keep_checkpoints: how many checkpoints to keep (>= 1).
      seed: the pair order, the held-out split, a new score head and LoRA's A matrices.
      dtype: compute dtype ("float32", "bfloat16", "float16"); parameters are stored in
        float32 (in `dtype` for a LoRA base).
      lora: a `jaxppo.models.LoraConfig`: train adapters and the score head only.
      output_dir: the run directory (checkpoints, metrics.jsonl, the exported model).
      report_to: trackers (`jaxppo.tracking`; "jsonl" always).
      optimizer: an `OptimizerConfig` (default `REWARD_OPTIMIZER`, TRL's).
    """

    batch_size: int = 32
    mini_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    epochs: float = 1.0
    center_rewards_coefficient: Optional[float] = None
    max_length: Optional[int] = 1024
    overlong_pairs: str = "error"
    eval_fraction: float = 0.0
    eval_every: int = 0
    save_every: int = 10
    keep_checkpoints: int = 2
    seed: int = 0
    dtype: str = "float32"
    lora: Optional[LoraConfig] = None
    output_dir: str = "runs/reward_model"
    report_to: Tuple[str, ...] = ("jsonl",)
    optimizer: OptimizerConfig = REWARD_OPTIMIZER

    def __post_init__(self):
        from jaxppo.tracking import check_installed, parse_report_to

        check_sizes("RewardModelConfig", self.batch_size, self.mini_batch_size, 1, self.gradient_accumulation_steps,
                    rows="pair of a step")
        e = self.epochs
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e < math.inf:
            raise invalid("RewardModelConfig", "epochs", e, "a finite number > 0 (passes over the training pairs)")
        c = self.center_rewards_coefficient
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 <= c < math.inf):
            raise invalid("RewardModelConfig", "center_rewards_coefficient", c, "None or a finite number >= 0 (0.01 is "
                          "TRL's recommendation)")
        if self.max_length is not None and not (is_int(self.max_length) and self.max_length > 0):
            raise invalid("RewardModelConfig", "max_length", self.max_length, "None or a positive int (tokens)")
        if self.overlong_pairs not in ("error", "drop"):
            raise invalid("RewardModelConfig", "overlong_pairs", self.overlong_pairs, "'error' or 'drop'")
        f = self.eval_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise invalid("RewardModelConfig", "eval_fraction", f, "a number in [0, 1)")
        for name in ("eval_every", "save_every", "seed"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 0):
                raise invalid("RewardModelConfig", name, getattr(self, name), "an int >= 0")
        if not (is_int(self.keep_checkpoints) and self.keep_checkpoints >= 1):
            raise invalid("RewardModelConfig", "keep_checkpoints", self.keep_checkpoints, "an int >= 1")
        if self.dtype not in DTYPES:
            raise invalid("RewardModelConfig", "dtype", self.dtype, " or ".join(map(repr, DTYPES)))
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise TypeError(f"RewardModelConfig.lora must be a jaxppo.models.LoraConfig or None, got "
                            f"{type(self.lora).__name__}")
        if not isinstance(self.output_dir, (str, os.PathLike)) or not os.fspath(self.output_dir):
            raise invalid("RewardModelConfig", "output_dir", self.output_dir, "a directory path")
        names = parse_report_to(self.report_to, "RewardModelConfig.report_to")
        check_installed(names, "RewardModelConfig.report_to")
        object.__setattr__(self, "report_to", names)
        if not isinstance(self.optimizer, OptimizerConfig):
            raise TypeError(f"RewardModelConfig.optimizer must be a jaxppo.OptimizerConfig, got "
                            f"{type(self.optimizer).__name__}")

    @classmethod
    def from_settings(cls, **settings) -> "RewardModelConfig":
        """A config from flat settings: the optimizer's by name (learning_rate, lr_schedule,
        ...) over `REWARD_OPTIMIZER`, the rest as fields; an unknown name is refused with
        the closest valid one."""
        import difflib

        own = {f.name for f in dataclasses.fields(cls)} - {"optimizer"}
        optimizer = {f.name for f in dataclasses.fields(OptimizerConfig)}
        unknown = [k for k in settings if k not in own | optimizer]
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(own | optimizer), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"RewardModelConfig has no setting {unknown[0]!r}{hint}; its settings: "
                             f"{', '.join(sorted(own | optimizer))}")
        opt = dataclasses.replace(REWARD_OPTIMIZER, **{k: v for k, v in settings.items() if k in optimizer})
        return cls(**{k: v for k, v in settings.items() if k in own}, optimizer=opt)

    @property
    def batch(self) -> BatchConfig:
        """The mini-batch loop's sizes: `batch_size` pairs, one pass (ppo_epochs 1)."""
        return BatchConfig(self.batch_size, self.mini_batch_size, 1, self.gradient_accumulation_steps)

    def settings(self) -> dict:
        """The settings as JSON values (the optimizer's flattened; a LoRA config as a dict)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "optimizer"}
        out["lora"] = None if self.lora is None else dataclasses.asdict(self.lora)
        out["output_dir"] = os.fspath(self.output_dir)
        out.update({f"optimizer.{f.name}": getattr(self.optimizer, f.name) for f in dataclasses.fields(OptimizerConfig)
                    if f.name != "transformation"})
        return json.loads(json.dumps(out, default=str))


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


class RewardTrainer:
    """Train a reward model on preference pairs (module doc).

    Args:
      model: a local directory (a causal LM such as an SFT checkpoint, which gets a new
        score head, or a `...ForSequenceClassification` with one label), or a
        `(jaxppo.models.Model, params)` pair of kind "reward".
      pairs: the training pairs: a .jsonl/.json file, a list of dicts or a
        `datasets.Dataset`, in TRL's preference formats (`jaxppo.run.preferences`).
      config: a `RewardModelConfig` (defaults: TRL's).
      eval_pairs: held-out pairs (the same formats), instead of `config.eval_fraction`.
      tokenizer: the tokenizer; default: the one in `model`'s directory (a `(Model, params)`
        pair needs one unless the pairs are token ids).

    Every input is checked and tokenized before the weights load; a problem is a
    ValueError or TypeError naming the row or setting and what would be valid.
    """

    def __init__(self, model, pairs, *, config: Optional[RewardModelConfig] = None, eval_pairs=None, tokenizer=None):
        config = RewardModelConfig() if config is None else config
        if not isinstance(config, RewardModelConfig):
            raise TypeError(f"config must be a jaxppo.RewardModelConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer, self.pairs, self.eval_pairs, self.dropped = _prepared_pairs(model, pairs, eval_pairs, tokenizer,
                                                                                    config)
        self.steps = math.ceil(config.epochs * len(self.pairs) / config.batch_size)
        self.total_updates = self.steps * config.batch.num_minibatches
        # The weights, after every input is known to be good.
        self.model, params, freeze = _trained_model(model, config, getattr(self.tokenizer, "pad_token_id", None))
        is_path = isinstance(model, (str, os.PathLike))
        self.source = os.path.abspath(os.fspath(model)) if is_path else "(Model, params)"
        self.learning_rate, tx = build_optimizer(config.optimizer, self.total_updates, critic=False)
        self.state = TrainState.create(apply_fn=self.model.apply, params=params, tx=tx, freeze=freeze)
        self.step = 0
        self._loss_fn = preference_loss_fn(self.model.apply, config.center_rewards_coefficient)
        self._update = jax.jit(functools.partial(update_epochs_fn, loss_fn=self._loss_fn, config=config.batch),
                               donate_argnums=0)
        self._scores = jax.jit(lambda params, tokens, mask: pair_scores(self.model.apply, params, tokens, mask))
        self._key = jax.random.key(config.seed)

    # -- the data stream ------------------------------------------------------------

    def rows_of_step(self, step: int) -> np.ndarray:
        """The training pairs (rows of `self.pairs`) step `step` trains on (module doc)."""
        from jaxppo.rollout.prompts import prompt_stream

        return prompt_stream(self._key, len(self.pairs), step * self.config.batch_size, self.config.batch_size)

    # -- training ------------------------------------------------------------------

    def _settings(self) -> dict:
        return {"reward_model": {"model": self.source, "pairs": len(self.pairs),
                                 "pairs_digest": _digest(self.pairs),
                                 "eval_pairs": 0 if self.eval_pairs is None else len(self.eval_pairs),
                                 "steps": self.steps, **self.config.settings()}}

    def _checkpoint_tree(self) -> dict:
        s = self.state
        return {"params": s.trained_params(), "opt_state": s.opt_state, "step": s.step,
                "skipped_nonfinite": s.skipped_nonfinite, "block": np.asarray(self.step, np.int32)}

    def _restore(self, directory: str) -> bool:
        found = checkpoints.restore_latest(directory, self._checkpoint_tree())
        if found is None:
            return False
        _, tree = found
        self.state = self.state.with_trained(tree["params"]).replace(
            opt_state=tree["opt_state"], step=tree["step"], skipped_nonfinite=tree["skipped_nonfinite"])
        self.step = int(tree["block"])
        return True

    def train_step(self) -> dict:
        """One step (module doc): `batch_size / mini_batch_size` optimizer updates on the
        step's pairs. Returns the step's metrics (means over its updates)."""
        rows = self.rows_of_step(self.step)
        batch = jax.tree.map(jnp.asarray, self.pairs.arrays(rows))
        updates_before = int(self.state.step)
        self.state, metrics = self._update(self.state, batch, jax.random.fold_in(self._key, self.step))
        applied = np.asarray(metrics["applied"])
        aux = jax.tree.map(np.asarray, metrics["aux"])
        out = {"iteration": self.step, "episode": (self.step + 1) * self.config.batch_size,  # pairs seen
               "loss": float(np.mean(metrics["loss"])),
               "grad_norm": float(np.mean(metrics["grad_norm"])),
               "rewards/accuracy": float(np.mean(aux["accuracy"])), "rewards/margin": float(np.mean(aux["margin"])),
               "rewards/chosen": float(np.mean(aux["chosen"])), "rewards/rejected": float(np.mean(aux["rejected"])),
               "learning_rate": float(self.learning_rate(updates_before)), "updates": int(self.state.step),
               "skipped_updates": int(applied.size - applied.sum()),
               "epoch": (self.step + 1) * self.config.batch_size / len(self.pairs)}
        self.step += 1
        return out

    def train(self) -> dict:
        """Run (or resume) the whole run in `config.output_dir`: steps, evaluations,
        checkpoints, metrics through the trackers, and the exported model in
        `<output_dir>/reward_model`. Returns the last step's metrics (with the last
        evaluation's)."""
        from jaxppo.run.directory import RunLock, check_settings, make_output_dir
        from jaxppo.run.logger import Logger

        c = self.config
        out_dir = os.fspath(c.output_dir)
        make_output_dir(out_dir)
        lock = RunLock(out_dir).acquire()
        logger = None
        try:
            ckpt_dir = os.path.abspath(os.path.join(out_dir, "checkpoints"))
            check_settings(out_dir, self._settings(), replace=not checkpoints.steps(ckpt_dir))
            if self._restore(ckpt_dir):
                print(f"reward model: resumed from step {self.step} ({ckpt_dir})", flush=True)
            logger = Logger(out_dir, self.step, c.report_to, self._settings()["reward_model"])
            last = {}
            while self.step < self.steps:
                start = time.perf_counter()
                last = self.train_step()
                last["time/step"] = time.perf_counter() - start
                done = self.step == self.steps
                if self.eval_pairs is not None and (done or (c.eval_every and self.step % c.eval_every == 0)):
                    last.update({f"eval/{k}": v for k, v in self.evaluate().items()})
                logger.log(last, echo=False)
                _echo(last)
                if done or (c.save_every and self.step % c.save_every == 0):
                    checkpoints.save(ckpt_dir, self.step, self._checkpoint_tree(), keep=c.keep_checkpoints)
            self.save_pretrained(os.path.join(out_dir, EXPORT_DIR))
            return last
        finally:
            if logger is not None:
                logger.close()
            lock.release()

    # -- evaluation and use ----------------------------------------------------------

    def pair_scores(self, pairs: Optional[PreferencePairs] = None) -> tuple:
        """(chosen, rejected) scores, float32 (N,), of `pairs` (default: the held-out pairs),
        in blocks of `mini_batch_size` pairs (the last block padded with copies of its
        first pair, whose scores are dropped)."""
        pairs = self.eval_pairs if pairs is None else pairs
        if pairs is None:
            raise ValueError("no held-out pairs: give eval_pairs or RewardModelConfig.eval_fraction > 0")
        size, n = self.config.mini_batch_size, len(pairs)
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
                                         self.config.center_rewards_coefficient)
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
        if config.eval_fraction:
            raise ValueError(f"give eval_pairs or RewardModelConfig.eval_fraction={config.eval_fraction}, not both")
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
    encode = functools.partial(tokenize_pairs, tokenizer, max_length=config.max_length, overlong=config.overlong_pairs,
                               vocab_size=_vocabulary(model), pad_id=getattr(tokenizer, "pad_token_id", None))
    train, dropped = encode(rows, labels, what="pairs")
    dropped = {"pairs": dropped}
    held_out = None
    if held is not None:
        held_out, dropped["eval_pairs"] = encode(*held, what="eval_pairs")
    elif config.eval_fraction:
        order = np.random.default_rng(config.seed).permutation(len(train))
        n_eval = max(1, int(round(config.eval_fraction * len(train))))
        if n_eval >= len(train):
            raise ValueError(f"RewardModelConfig.eval_fraction={config.eval_fraction} holds out all {len(train)} pairs; "
                             "lower it")
        held_out, train = train.take(np.sort(order[:n_eval])), train.take(np.sort(order[n_eval:]))
    for name, count in dropped.items():
        if count:
            print(f"reward model: {count} {name} longer than max_length={config.max_length} tokens left out "
                  "(overlong_pairs='drop')", flush=True)
    if len(train) < config.batch_size:
        raise ValueError(f"RewardModelConfig.batch_size={config.batch_size} is more than the {len(train)} training "
                         f"pairs; give batch_size <= {len(train)} (a multiple of mini_batch_size="
                         f"{config.mini_batch_size})")
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
    param_dtype = config.dtype if config.lora is not None else "float32"
    model, params = load_reward_model(model, config.dtype, param_dtype, config.seed)
    if pad_id is not None:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, pad_token_id=int(pad_id)))
    if config.lora is None:
        return model, params, None
    from jaxppo.models.adapters import add_lora

    if model.lora is not None:
        raise ValueError("the reward model already has LoRA adapters; drop RewardModelConfig.lora, or give the base "
                         "model")
    model, params = add_lora(model, params, config.lora, jax.random.fold_in(jax.random.key(config.seed), 7))
    return model, params, Freeze(prefixes=(("params",),), unless=(("params", "score"),))  # adapters and head train


def _digest(pairs: PreferencePairs) -> str:
    import hashlib

    h = hashlib.sha256()
    for array in (pairs.tokens, pairs.mask, pairs.margin):
        h.update(np.ascontiguousarray(array).tobytes())
    return h.hexdigest()[:16]


def _echo(metrics: dict):
    parts = [f"step {metrics['iteration']:4d}", f"loss {metrics['loss']:.4f}",
             f"accuracy {metrics['rewards/accuracy']:.3f}", f"margin {metrics['rewards/margin']:.3f}"]
    if "eval/accuracy" in metrics:
        parts += [f"eval accuracy {metrics['eval/accuracy']:.3f}", f"eval margin {metrics['eval/margin']:.3f}"]
    print("  ".join(parts), flush=True)


def main(argv=None) -> int:
    """`jaxppo reward-model --pairs FILE --model PATH [settings]`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="jaxppo reward-model",
                                     description="Train a reward model on preference pairs (Bradley-Terry, TRL's "
                                                 "RewardTrainer) and export it as a ...ForSequenceClassification "
                                                 "directory (<output-dir>/reward_model).")
    parser.add_argument("--pairs", required=True, help=".jsonl or .json preference pairs (chosen/rejected, optional "
                                                         "prompt and margin; or chosen_ids/rejected_ids)")
    parser.add_argument("--model", required=True, help="local checkpoint directory: a causal LM (an SFT model) or "
                                                         "a ...ForSequenceClassification")
    parser.add_argument("--eval-pairs", default=None, help="held-out pairs (instead of --eval-fraction)")
    parser.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank (and the head)")
    parser.add_argument("--lora-alpha", type=float, default=None)
    parser.add_argument("--lora-targets", default="all-linear",
                        help="comma-separated modules, or all-linear (the default, as jaxppo's)")
    types = {"batch_size": int, "mini_batch_size": int, "gradient_accumulation_steps": int, "epochs": float,
             "center_rewards_coefficient": float, "max_length": int, "overlong_pairs": str, "eval_fraction": float,
             "eval_every": int, "save_every": int, "keep_checkpoints": int, "seed": int, "dtype": str,
             "output_dir": str, "report_to": str, "learning_rate": float, "lr_schedule": str,
             "warmup_updates": float, "max_grad_norm": float, "weight_decay": float, "adam_eps": float}
    for name, kind in types.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    args = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    settings = {k: v for k, v in args.items() if k in types and v is not None}
    if "report_to" in settings:
        settings["report_to"] = tuple(s for s in settings["report_to"].split(",") if s)
    if "warmup_updates" in settings and float(settings["warmup_updates"]).is_integer() \
            and settings["warmup_updates"] >= 1:
        settings["warmup_updates"] = int(settings["warmup_updates"])
    try:
        if args["lora_rank"] is not None:
            targets = args["lora_targets"]
            settings["lora"] = LoraConfig(rank=args["lora_rank"], alpha=args["lora_alpha"] or 2.0 * args["lora_rank"],
                                          targets=targets if targets == "all-linear" else tuple(targets.split(",")))
        config = RewardModelConfig.from_settings(**settings)
        trainer = RewardTrainer(args["model"], args["pairs"], config=config, eval_pairs=args["eval_pairs"])
    except (ValueError, TypeError) as err:
        raise SystemExit(f"jaxppo reward-model: {name_the_flag(str(err))}") from None
    try:
        trainer.train()
    except KeyboardInterrupt:
        return 130
    except RunError as err:
        print(f"jaxppo reward-model: error: {err}", file=sys.stderr)
        return 1
    print(f"reward model: exported to {os.path.join(os.fspath(config.output_dir), EXPORT_DIR)}")
    return 0

