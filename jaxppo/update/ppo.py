"""`train_step`: one update of a language-model policy (and critic) from a rollout, for
PPO and the critic-free algorithms alike: an advantage estimator plus a loss on the mini-batch loop (`update.minibatches`).

    train_step(state, rollout, key, config) -> (state, metrics)     # pure, jitted once
      rewards -> advantages (GAE with returns; or GRPO / RLOO / REINFORCE++), once, over
        the whole rollout (`config.advantage_estimator`)
      update_epochs(...) with the loss (`jaxppo.update.objective.total_loss`) through
        state.apply_fn

`config` is a `jaxppo.Config`, or an `UpdateConfig`: the three things `train_step` reads (the
batch's sizes, the loss's view of the settings and an advantage function), for callers who
bring their own advantages. Nothing here imports the configs above this layer: a `Config`
hands over its `.update`.

The model is anything with `state.apply_fn(params, tokens, mask) -> (logits, values)`:
`tokens`/`mask` are (B, L) with L = query length + response length, `logits` (B, L, V) and
`values` (B, L). Position p's logits predict token p + 1 and position p's value estimates
the state after tokens[: p + 1], so response token t is scored by position Q - 1 + t.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jaxppo.update import packing
from jaxppo.update.batch import RolloutBatch, response_outputs
from jaxppo.update.correction import correction_weights, mismatch_metrics
from jaxppo.update.checks import layer_config
from jaxppo.update.minibatches import BatchConfig, GroupOrder, TrainState, update_epochs_fn
from jaxppo.update.objective import Objective, loss_for, micro_batch_weight, prompt_rows
from jaxppo.update.stats import masked_mean, masked_var

__all__ = ["RolloutBatch", "UpdateConfig", "update_config", "train_step", "train_step_fn", "jit_train_step",
           "compute_advantages", "response_outputs", "check_rollout", "minibatch_group", "prompt_group"]


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """What `train_step` reads, and nothing else.

    Attributes:
      batch: the `BatchConfig` (sizes, epochs, accumulation, `target_kl`).
      objective: the loss's view of the settings (`jaxppo.update.objective.Objective`).
      advantages: `advantages(rollout) -> (advantages (B, R), returns (B, R) or None, stats
        dict)`, pure and jittable, over the whole rollout (returns are the critic's
        regression target: None unless `objective.uses_critic`). A `Config`'s is its
        registered estimator (`jaxppo.algorithms.ESTIMATORS`) applied with its
        `AdvantageConfig`.

    Hashed by its fields (the function by identity): pass the same object on every call of
    a jitted `train_step`, or bind it with `jit_train_step(config)`.
    """

    batch: BatchConfig
    objective: Objective
    advantages: Callable

    def __post_init__(self):
        if not isinstance(self.batch, BatchConfig) or not isinstance(self.objective, Objective):
            raise TypeError(f"UpdateConfig takes a BatchConfig and an Objective (jaxppo.Config's .batch and "
                            f".objective), got {type(self.batch).__name__} and {type(self.objective).__name__}")
        if not callable(self.advantages):
            raise TypeError(f"UpdateConfig.advantages must be callable (rollout -> (advantages, returns, stats)), "
                            f"got {self.advantages!r}")


def update_config(config) -> UpdateConfig:
    """The `UpdateConfig` of `config`: itself, or its `.update` (a `jaxppo.Config`'s)."""
    return layer_config(config, UpdateConfig, "update", "jaxppo.UpdateConfig")


def compute_advantages(rollout: RolloutBatch, config):
    """Advantages (B, R) for the whole rollout, zero at padding, and the critic's returns
    (B, R) (None for the critic-free estimators).

    Computed by the config's advantage function: for a `jaxppo.Config`, its registered
    estimator (`config.estimator`, see `jaxppo.algorithms.ESTIMATORS`): "gae" (PPO: GAE over
    the critic's values, with the whitening settings), "grpo", "rloo" (group-relative: from
    each completion's sequence score, `rollout.scores` or the sum of its rewards,
    completions grouped by prompt in G consecutive rows, broadcast over its tokens),
    "reinforce_pp" and "reinforce_pp_baseline" (whitened per-token returns).
    """
    return tuple(update_config(config).advantages(rollout)[:2])


def minibatch_group(config) -> int:
    """The rows the update keeps together: `num_generations` G when G > 1 divides the
    mini-batch (then every mini-batch holds whole groups, each a prompt's completions,
    shuffled group by group: `jaxppo.update.minibatches.GroupOrder`), else 1 (rows shuffled one
    by one). It does not depend on gradient accumulation, so accumulating changes no
    mini-batch. `config`: a `jaxppo.Config` or an `UpdateConfig`."""
    u = update_config(config)
    g = u.objective.num_generations
    return g if g > 1 and u.batch.mini_batch_size % g == 0 else 1


def minibatch_order(config):
    """The update's mini-batch order: `GroupOrder(G)` when groups are kept whole
    (`minibatch_group`), else None (rows shuffled one by one)."""
    group = minibatch_group(config)
    return GroupOrder(group) if group > 1 else None


def prompt_group(config) -> int:
    """G when each group's prompt runs once in the update's loss: `share_prompts=True`, G > 1
    dividing the micro-batch (whole groups in every micro-batch) and no packing; else 1.
    (The trainer turns the default `share_prompts=None` into True: its rollouts' groups
    share prompts.)"""
    u = update_config(config)
    return prompt_rows(u.objective, u.batch.micro_batch_size)


# TRL's metric names for the aux entries: (average over updates, per-mini-batch array).
_TRL_NAMES = {
    "approxkl": ("policy/approxkl_avg", "per_minibatch/policy/approxkl"),
    "clipfrac": ("policy/clipfrac_avg", "per_minibatch/policy/clipfrac"),
    "entropy": ("policy/entropy_avg", "per_minibatch/policy/entropy"),
    "policy_loss": ("loss/policy_avg", "per_minibatch/loss/policy"),
    "value_loss": ("loss/value_avg", "per_minibatch/loss/value"),
    "vf_clipfrac": ("val/clipfrac_avg", "per_minibatch/val/clipfrac"),
    "ratio": ("val/ratio", "per_minibatch/val/ratio"),
    "ratio_var": ("val/ratio_var", "per_minibatch/val/ratio_var"),
    "clip_ratio/low_mean": ("clip_ratio/low_mean", "per_minibatch/clip_ratio/low_mean"),
    "clip_ratio/high_mean": ("clip_ratio/high_mean", "per_minibatch/clip_ratio/high_mean"),
    "clip_ratio/region_mean": ("clip_ratio/region_mean", "per_minibatch/clip_ratio/region_mean"),
    "clip_ratio/dual_mean": ("clip_ratio/dual_mean", "per_minibatch/clip_ratio/dual_mean"),
    "sapo_gate": ("policy/sapo_gate_avg", "per_minibatch/policy/sapo_gate"),
    "vespo_phi": ("policy/vespo_phi_avg", "per_minibatch/policy/vespo_phi"),
    "kl": ("kl", "per_minibatch/kl"),
    "distill_divergence": ("loss/distill_avg", "per_minibatch/loss/distill"),
    "entropy_mask_fraction": ("policy/entropy_mask_fraction", "per_minibatch/policy/entropy_mask_fraction"),
    "packing_overflow": ("packing/overflow", "per_minibatch/packing/overflow"),
    "routing_mismatch": ("moe/routing_mismatch", "per_minibatch/moe/routing_mismatch"),
    "router_aux": ("loss/router_aux_avg", "per_minibatch/loss/router_aux"),
}


def train_step_fn(state: TrainState, rollout: RolloutBatch, key, config, minibatch_sharding=None):
    """One update from a rollout, compiled as one program (once per config and shapes).

    Computes advantages (and, with a critic, returns) once for the whole rollout
    (`compute_advantages`), then runs `config.ppo_epochs` epochs of
    `config.num_minibatches` shuffled mini-batch updates of the loss
    (`jaxppo.update.objective.total_loss`) through
    `state.apply_fn(params, tokens, mask) -> (logits, values)` (values are not read without
    a critic). Under gradient accumulation, micro-batches are weighted (by real response
    tokens for a token mean, equally for the per-completion means), so the update equals
    the one on the whole mini-batch. A rollout that carries the sampler's log-probs
    (`sampler_logprobs`) adds the mismatch metrics `sampling/...`
    (`jaxppo.update.correction.mismatch_metrics`) and, unless `config.rollout_correction` is
    "none", weights the policy loss per token for that mismatch
    (`jaxppo.update.correction.correction_weights`). Critic-free metrics add `frac_reward_zero_std`
    (group estimators), `clip_ratio/*` and, with a KL term, `kl`; value metrics exist only
    with a critic.

    Args:
      state: `TrainState` whose `apply_fn` is the policy (+ critic) forward.
      rollout: a `RolloutBatch` with exactly `config.batch_size` rows.
      key: PRNG key for the mini-batch permutations.
      config: a `jaxppo.Config`, or an `UpdateConfig` (static).
      minibatch_sharding: optional row sharding of each mini-batch under a mesh (static;
        `jaxppo.sharding.sharded_train_step` sets it).

    Returns:
      (state, metrics): `state.step` advanced by the updates applied (`config.updates_per_step`
      unless withheld by `target_kl` or non-finite losses). Metrics: TRL-named averages over
      the applied updates (`policy/approxkl_avg`, `policy/clipfrac_avg`, `policy/entropy_avg`,
      `loss/policy_avg`, `loss/value_avg`, `loss/total_avg`, `val/clipfrac_avg`,
      `val/ratio`, `val/ratio_var`), the same per mini-batch with leading shape
      `(ppo_epochs, num_minibatches)` under `per_minibatch/...`, and `ppo/updates_applied`,
      `ppo/updates_planned`, `ppo/updates_nonfinite`, `ppo/early_stopped` (with target_kl),
      plus return/advantage/value statistics of the rollout.

    `train_step` is this function under `jax.jit`; `train_step_fn` is the plain function,
    to jit with your own options (buffer donation, shardings) or to call inside your own jit.
    Shapes and dtypes are checked while tracing (before anything compiles); mask values,
    which jit cannot see, are checked by `check_rollout` on rollouts you build yourself.
    """
    u = update_config(config)
    batching, loss = u.batch, u.objective
    _check_rollout_structure(rollout, u)
    _check_packing(state.apply_fn, rollout, loss)
    advantages, returns, adv_stats = u.advantages(rollout)
    batch, mismatch = _loss_batch(rollout, u, advantages, returns)
    step_before = state.step
    state, loop_metrics = update_epochs_fn(
        state, batch, key, loss_for(state.apply_fn, loss), batching, weight_fn=micro_batch_weight(loss),
        minibatch_sharding=minibatch_sharding, order=minibatch_order(u),
    )
    metrics = _summarise(loop_metrics, state.step - step_before, rollout, advantages, returns, u)
    metrics.update(adv_stats)
    metrics.update(mismatch)
    return state, metrics


def _loss_batch(rollout: RolloutBatch, config: UpdateConfig, advantages, returns):
    """The columns the loss reads (a dict leading with the rows), and the sampler-mismatch
    metrics when the rollout carries the sampler's log-probs."""
    batching, loss = config.batch, config.objective
    batch = {
        "query_tokens": rollout.query_tokens,
        "query_mask": rollout.query_mask,
        "response_tokens": rollout.response_tokens,
        "response_mask": rollout.response_mask,
        "logprobs": rollout.logprobs,
        "advantages": advantages,
    }
    if loss.uses_critic:
        batch.update(values=rollout.values, returns=returns)
    if loss.kl_loss_coef:
        batch["ref_logprobs"] = rollout.ref_logprobs
    if loss.distill_top_k:
        batch.update(teacher_top_logprobs=rollout.teacher_top_logprobs, teacher_top_ids=rollout.teacher_top_ids)
    if rollout.routing is not None:  # a mixture of experts' routing in the forward pass
        batch["routing"] = rollout.routing
    if rollout.images is not None:  # a vision-language policy's images, read by every forward
        batch["images"] = rollout.images
    if rollout.entropy_coef is not None:
        batch["entropy_coef"] = rollout.entropy_coef
    if rollout.response_attention_mask is not None:  # a multi-turn episode's environment tokens
        batch["response_attention_mask"] = rollout.response_attention_mask
    if loss.loss_aggregation == "token_sum_batch_norm":  # TRL's dapo: the batch's tokens per mini-batch
        tokens = jnp.maximum(jnp.sum(rollout.response_mask.astype(jnp.float32)), 1.0)
        # Micro-batches are averaged (no weight_fn): each one's sum counts k times over.
        norm = tokens / (batching.num_minibatches * batching.gradient_accumulation_steps)
        batch["loss_token_norm"] = jnp.full((batching.batch_size,), norm, jnp.float32)
    mismatch = {}
    if rollout.sampler_logprobs is not None:
        mismatch = mismatch_metrics(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask)
        if loss.rollout_correction != "none":
            batch["correction_weights"] = correction_weights(
                rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask, loss.rollout_correction,
                loss.rollout_correction_cap)
    return batch, mismatch


def _check_rollout_structure(rollout, config: UpdateConfig):
    """Shapes and dtypes of a rollout against the config (at trace time: before compiling)."""
    batching, loss = config.batch, config.objective
    if not isinstance(rollout, RolloutBatch):
        raise TypeError(f"rollout must be a jaxppo.RolloutBatch, got {type(rollout).__name__}")
    if len(rollout.response_tokens.shape) != 2:
        raise ValueError(f"rollout.response_tokens has shape {rollout.response_tokens.shape}; expected "
                         "(batch, response_len)")
    b, r = rollout.response_tokens.shape
    if b != batching.batch_size:
        raise ValueError(
            f"rollout has {b} rows but BatchConfig.batch_size={batching.batch_size}; a rollout "
            f"must hold exactly batch_size rows (nothing is dropped or padded)."
        )
    if loss.kl_loss_coef and rollout.ref_logprobs is None:
        raise ValueError(f"KLConfig.kl_loss_coef={loss.kl_loss_coef} needs the reference policy's log-probs in "
                         "rollout.ref_logprobs (batch, response_len); the rollout has none")
    if loss.uses_critic and rollout.values is None:
        raise ValueError("the loss has a value term (a critic: AdvantageConfig.advantage_estimator='gae', or "
                         "Objective.uses_critic=True): rollout.values must hold "
                         "its values (batch, response_len); the rollout has none")
    for name in _token_fields(rollout, loss):
        shape = getattr(rollout, name).shape
        if shape != (b, r):
            raise ValueError(f"rollout.{name} has shape {shape}; expected (batch, response_len) = {(b, r)}")
    _check_teacher_top(rollout, loss, b, r)
    for name in ("scores", "entropy_coef"):
        field = getattr(rollout, name)
        if field is not None and tuple(field.shape) != (b,):
            raise ValueError(f"rollout.{name} has shape {tuple(field.shape)}; expected (batch,) = ({b},)")
    if (len(rollout.query_tokens.shape) != 2 or rollout.query_mask.shape != rollout.query_tokens.shape
            or rollout.query_tokens.shape[0] != b):
        raise ValueError(
            f"rollout.query_tokens {rollout.query_tokens.shape} and rollout.query_mask "
            f"{rollout.query_mask.shape} must both be (batch, query_len) with batch={b}"
        )
    for name in ("query_tokens", "response_tokens"):
        dtype = jnp.dtype(getattr(rollout, name).dtype)
        if not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(f"rollout.{name} has dtype {dtype}; token ids must be integers (int32)")
    for name in ("query_mask", "response_mask", "response_attention_mask"):
        if getattr(rollout, name) is None:
            continue
        dtype = jnp.dtype(getattr(rollout, name).dtype)
        if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating) or dtype == jnp.bool_):
            raise TypeError(f"rollout.{name} has dtype {dtype}; a mask must be int, bool or float holding 0/1")
    for name in _float_fields(rollout):
        dtype = jnp.dtype(getattr(rollout, name).dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"rollout.{name} has dtype {dtype}; it must be a float array (float32)")


def _check_teacher_top(rollout, config: Objective, b: int, r: int):
    """With `distill_top_k` = k: the teacher's top k in the rollout, (batch, response_len, k)
    float log-probs and int ids."""
    if not config.distill_top_k:
        return
    k = config.distill_top_k
    for name, kind in (("teacher_top_logprobs", jnp.floating), ("teacher_top_ids", jnp.integer)):
        field = getattr(rollout, name)
        if field is None:
            raise ValueError(f"AdvantageConfig.distill_top_k={k} needs the teacher's top {k} log-probs and ids in "
                             "rollout.teacher_top_logprobs and rollout.teacher_top_ids (batch, response_len, k); the "
                             f"rollout has no {name} (the trainer's rollouts have them when its teacher scores them)")
        if tuple(field.shape) != (b, r, k):
            raise ValueError(f"rollout.{name} has shape {tuple(field.shape)}; expected (batch, response_len, "
                             f"distill_top_k) = {(b, r, k)}")
        if not jnp.issubdtype(jnp.dtype(field.dtype), kind):
            raise TypeError(f"rollout.{name} has dtype {jnp.dtype(field.dtype)}; it must be "
                            f"{'a float array (float32)' if kind is jnp.floating else 'token ids (int32)'}")


def _check_packing(apply_fn, rollout, config: Objective):
    """With `pack_sequences`: a stream count, a stream length that holds the widest row, a
    model that can run packed (at trace time: before compiling)."""
    if not config.pack_sequences:
        return
    width = packing.stream_length(rollout, None)
    if config.pack_streams is None:
        raise ValueError("LayoutConfig.pack_sequences=True needs LayoutConfig.pack_streams (streams per "
                         "micro-batch) in train_step; jaxppo.update.packing.minibatch_streams computes the fewest that "
                         "every micro-batch of an update fits in (the Trainer does this every iteration)")
    if config.pack_length is not None and config.pack_length < width:
        raise ValueError(f"LayoutConfig.pack_length={config.pack_length} is shorter than the rollout's padded width "
                         f"Q + R = {width}: a row of that many tokens could not be packed; use pack_length >= "
                         f"{width} or None")
    if packing.packer(apply_fn) is None:
        raise ValueError("LayoutConfig.pack_sequences=True needs a built-in model (jaxppo.models.Model or "
                         f"PolicyAndCritic) as the train state's apply_fn; got {apply_fn!r}")


def _token_fields(rollout, config):
    """The (B, R) fields the update reads, plus the optional ones the rollout has."""
    names = ["response_mask", "logprobs", "rewards"]
    if config.kl_loss_coef:
        names.append("ref_logprobs")
    names += [n for n in ("values", "sampler_logprobs", "response_attention_mask") if getattr(rollout, n) is not None]
    return names


def _float_fields(rollout):
    return [n for n in ("logprobs", "values", "rewards", "scores", "sampler_logprobs", "entropy_coef",
                        "teacher_top_logprobs") if getattr(rollout, n) is not None]


def _check_shared_queries(rollout, group: int, common_prefix: bool):
    """ValueError unless each group of `group` consecutive rows shares its query (every row
    the same one with `common_prefix`)."""
    import numpy as np

    qm = np.asarray(rollout.query_mask) > 0
    qt = np.where(qm, np.asarray(rollout.query_tokens), 0)
    rows = np.arange(rollout.query_tokens.shape[0])
    first = np.zeros_like(rows) if common_prefix else rows // group * group
    differs = np.any((qm != qm[first]) | (qt != qt[first]), axis=1)
    for leaf in jax.tree.leaves(rollout.images):  # a vision-language policy's: the group's images too
        leaf = np.asarray(leaf).reshape(len(rows), -1)
        differs |= np.any(leaf != leaf[first], axis=1)
    if not differs.any():
        return
    row = int(np.flatnonzero(differs)[0])
    if common_prefix:
        raise ValueError(f"rollout row {row} has another query than row 0: with LayoutConfig.common_prefix=True "
                         "train_step runs one query for every row of a micro-batch, so every row must have the "
                         "same query_tokens and query_mask (the prompts' common prefix; the rest of each prompt "
                         "opens its response region: jaxppo.update.prefix); set common_prefix=False otherwise")
    raise ValueError(
        f"rollout row {row} has another prompt than row {int(first[row])}, the first of its group "
        f"(rows {int(first[row])}-{int(first[row]) + group - 1}): with LayoutConfig.share_prompts=True "
        f"train_step runs each group's prompt once, so each group of num_generations={group} "
        "consecutive rows must share query_tokens and query_mask (a prompt's completions; and its images); "
        "set share_prompts=False for rows that do not")


def check_rollout(rollout: RolloutBatch, config):
    """Check a rollout on the host before `train_step`: shapes and dtypes (as `train_step`
    does while tracing), and the values jit cannot check: masks hold only 0 and 1,
    `query_mask` is left padding (zeros, then ones) and `response_mask` a prefix of ones
    per row (with `response_attention_mask`, that one is the prefix and `response_mask`
    lies inside it), token ids are >= 0, log-probs/values/rewards are finite where the mask is 1,
    and, when the loss runs each group's prompt once (`share_prompts`, see `prompt_group`),
    each group's rows share their prompt.
    Raises ValueError/TypeError naming the field, the first bad row and what is valid.
    The trainer's rollouts are correct by construction; call this on rollouts you build."""
    import numpy as np

    _check_rollout_structure(rollout, update_config(config))
    multi_turn = rollout.response_attention_mask is not None
    # The response region's prefix is the attention mask of a multi-turn episode; the
    # policy's own mask then has gaps (the environment's tokens) and must lie inside it.
    prefix = "response_attention_mask" if multi_turn else "response_mask"
    masks = {"query_mask": "non-decreasing (left padding: zeros, then ones)", "response_mask": None}
    masks[prefix] = "non-increasing (a prefix of ones, then zeros)"
    for name, want in masks.items():
        m = np.asarray(getattr(rollout, name)).astype(np.float64)
        bad = np.flatnonzero(np.any((m != 0) & (m != 1), axis=1))
        if bad.size:
            raise ValueError(f"rollout.{name} row {bad[0]} holds values other than 0 and 1: "
                             f"{sorted(set(np.unique(m[bad[0]]).tolist()))}; a mask holds only 0 and 1")
        if want is None:  # only 0/1 asked of it
            continue
        steps = np.diff(m, axis=1)
        wrong = np.any(steps < 0, axis=1) if name == "query_mask" else np.any(steps > 0, axis=1)
        if wrong.any():
            row = int(np.flatnonzero(wrong)[0])
            raise ValueError(f"rollout.{name} row {row} is {m[row].astype(int).tolist()}; each row must be {want}")
    if multi_turn:
        outside = np.any((np.asarray(rollout.response_mask) > 0) & (np.asarray(rollout.response_attention_mask) == 0),
                         axis=1)
        if outside.any():
            raise ValueError(f"rollout.response_mask row {int(np.flatnonzero(outside)[0])} marks tokens that "
                             "rollout.response_attention_mask leaves out; the policy's tokens must be inside the "
                             "sequence it attends to")
    for name in ("query_tokens", "response_tokens", "teacher_top_ids"):
        if getattr(rollout, name) is None:
            continue
        t = np.asarray(getattr(rollout, name))
        if (t < 0).any():
            row = int(np.flatnonzero(np.any(t.reshape(t.shape[0], -1) < 0, axis=1))[0])
            raise ValueError(f"rollout.{name} row {row} holds negative token ids; ids must be >= 0")
    group = prompt_group(config)
    if group > 1:  # the loss runs each group's prompt once: the group's rows must share it
        _check_shared_queries(rollout, group, update_config(config).objective.common_prefix is True)
    mask = np.asarray(rollout.response_mask) > 0
    for name in _float_fields(rollout):
        x = np.asarray(getattr(rollout, name), np.float64)
        bad = ~np.isfinite(x)
        if x.ndim > 1:  # per token (the teacher's top k: per token and candidate)
            bad = bad & mask.reshape(mask.shape + (1,) * (x.ndim - 2))
        if bad.any():
            row = int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])
            raise ValueError(f"rollout.{name} row {row} has non-finite values at real response tokens; they must be "
                             "finite")


def _summarise(loop_metrics, applied, rollout, advantages, returns, config):
    """TRL-named metrics: `<name>_avg` over applied updates, plus per-mini-batch arrays."""
    applied_mask = loop_metrics["applied"]
    n_applied = jnp.sum(applied_mask.astype(jnp.float32))

    def avg(x):
        x = jnp.where(applied_mask, x, 0.0)
        return jnp.where(n_applied > 0, jnp.sum(x) / jnp.maximum(n_applied, 1.0), jnp.nan)

    mask = rollout.response_mask.astype(jnp.float32)
    metrics = {}
    for key, (avg_name, per_mb_name) in _TRL_NAMES.items():
        if key not in loop_metrics["aux"]:
            continue  # value metrics without a critic, kl without a KL term
        metrics[avg_name] = avg(loop_metrics["aux"][key])
        metrics[per_mb_name] = loop_metrics["aux"][key]
    metrics["loss/total_avg"] = avg(loop_metrics["loss"])
    metrics["per_minibatch/loss/total"] = loop_metrics["loss"]
    metrics["per_minibatch/grad_norm"] = loop_metrics["grad_norm"]
    metrics["per_minibatch/applied"] = applied_mask
    metrics["per_minibatch/nonfinite"] = loop_metrics["nonfinite"]
    metrics["ppo/grad_norm_avg"] = avg(loop_metrics["grad_norm"])
    metrics["ppo/updates_applied"] = applied
    metrics["ppo/updates_planned"] = jnp.asarray(config.batch.updates_per_step, jnp.int32)
    metrics["ppo/updates_nonfinite"] = jnp.sum(loop_metrics["nonfinite"].astype(jnp.int32))
    if "early_stopped" in loop_metrics:
        metrics["per_minibatch/early_stopped"] = loop_metrics["early_stopped"]
        metrics["ppo/early_stopped"] = jnp.any(loop_metrics["early_stopped"])
    metrics["ppo/advantages/mean"] = masked_mean(advantages, mask)
    if config.objective.uses_critic:
        metrics["ppo/returns/mean"] = masked_mean(returns, mask)
        metrics["ppo/returns/var"] = masked_var(returns, mask)
        metrics["ppo/val/mean"] = masked_mean(rollout.values.astype(jnp.float32), mask)
        metrics["ppo/val/var"] = masked_var(rollout.values.astype(jnp.float32), mask)
    return metrics


def jit_train_step(config=None, *, donate: bool = False, **jit_options):
    """`train_step_fn` under `jax.jit`: with `config` bound (then `jit_options`, such as
    shardings, apply to (state, rollout, key) alone), else with `config` and
    `minibatch_sharding` static. `donate=True` donates the train state's buffers (the state
    passed in is invalid afterwards; the new one reuses its memory)."""
    donate_argnums = (0,) if donate else ()
    if config is None:
        return jax.jit(train_step_fn, static_argnames=("config", "minibatch_sharding"), donate_argnums=donate_argnums,
                       **jit_options)
    minibatch_sharding = jit_options.pop("minibatch_sharding", None)
    fn = functools.partial(train_step_fn, config=config, minibatch_sharding=minibatch_sharding)
    return jax.jit(fn, donate_argnums=donate_argnums, **jit_options)


train_step = jit_train_step()
# With the old train state donated (one train state in memory during the update instead of
# two). Module-level, so every trainer in a process shares its compiled programs.
train_step_donating = jit_train_step(donate=True)



def __getattr__(name: str):  # the names renamed in 0.5, with a DeprecationWarning
    from jaxppo.deprecations import moved

    return moved(__name__, name)
