"""`train_step`: one update of a language-model policy (and critic) from a rollout, for
PPO and the critic-free algorithms alike: an advantage estimator plus a loss on the engine.

    train_step(state, rollout, key, config) -> (state, metrics)     # pure, jitted once
      rewards -> advantages (GAE with returns; or GRPO / RLOO / REINFORCE++), once, over
        the whole rollout (`config.advantage_estimator`)
      update_epochs(...) with the loss (`ppo_loss`) through state.apply_fn

The model is anything with `state.apply_fn(params, tokens, mask) -> (logits, values)`:
`tokens`/`mask` are (B, L) with L = query length + response length, `logits` (B, L, V) and
`values` (B, L). Position p's logits predict token p + 1 and position p's value estimates
the state after tokens[: p + 1], so response token t is scored by position Q - 1 + t.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxppo.config import PPOConfig
from jaxppo.update import packing
from jaxppo.update.batch import Rollout, response_outputs
from jaxppo.update.correction import correction_weights, mismatch_metrics
from jaxppo.update.engine import GroupOrder, TrainState, update_epochs_fn
from jaxppo.update.kl import kl_loss_per_token
from jaxppo.update.losses import aggregate_loss, approx_kl, clipped_policy_loss, log_importance_ratio, value_loss
from jaxppo.update.shaping import high_entropy_mask
from jaxppo.update.stats import masked_mean, masked_var

__all__ = ["Rollout", "train_step", "train_step_fn", "jit_train_step", "ppo_loss", "compute_advantages", "response_outputs",
           "check_rollout"]


def compute_advantages(rollout: Rollout, config: PPOConfig):
    """Advantages (B, R) for the whole rollout, zero at padding, and the critic's returns
    (B, R) (None for the critic-free estimators).

    Computed by the config's registered estimator (`config.estimator`, see
    `jaxppo.algorithms.ESTIMATORS`): "gae" (PPO: GAE over the critic's values, with the
    whitening settings), "grpo", "rloo" (group-relative: from each completion's sequence
    score, `rollout.scores` or the sum of its rewards, completions grouped by prompt in G
    consecutive rows, broadcast over its tokens), "reinforce_pp" and
    "reinforce_pp_baseline" (whitened per-token returns).
    """
    return config.estimator.compute(rollout, config)[:2]


def ppo_loss(params, batch, *, apply_fn, config: PPOConfig):
    """The loss of one (mini- or micro-) batch for every algorithm: a dict of rollout fields
    plus `advantages` (and `returns` with a critic), each leading with the rows.

        loss = policy_loss (+ vf_coef * value_loss) (- ent_coef * entropy)
               (+ kl_loss_coef * KL(policy || reference))

    (each bracketed term only when it applies: `jaxppo.algorithms.loss_terms(config)`; with
    an `entropy_coef` column in the batch, the rollout's per-completion coefficients weigh
    the entropy instead of `ent_coef`)
    policy_loss: the clipped surrogate with the ratio per token (or per completion, GSPO:
    `config.importance_ratio`) clipped to [1 - clip_low, 1 + clip_high], optionally dual
    clipped (`jaxppo.update.losses.clipped_policy_loss`). Every term is reduced by
    `config.loss_aggregation` over the real response tokens (PPO's "token_mean" is a masked
    mean over all of them). The value loss exists only with a critic ("gae").

    Returns (loss, aux) with scalar aux entries: policy_loss, entropy, approxkl, clipfrac,
    ratio, ratio_var, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean;
    value_loss and vf_clipfrac with a critic; kl with a KL term; clip_ratio/dual_mean (tokens
    whose loss the dual clip capped) with `dual_clip`; entropy_mask_fraction (the share of
    real tokens the policy term trains on) with `top_entropy_quantile` < 1.
    """
    mask = batch["response_mask"].astype(jnp.float32)
    r = loss_normaliser(batch, config)
    agg_mode = config.loss_aggregation

    def aggregate(per_token):
        return aggregate_loss(per_token, mask, agg_mode, r)

    (logprobs, values, entropy), aux = _outputs(apply_fn, params, batch, config)
    old_logprobs = batch["logprobs"].astype(jnp.float32)
    log_ratio = log_importance_ratio(logprobs, old_logprobs, mask, config.importance_ratio)
    weights = batch.get("correction_weights")
    if config.top_entropy_quantile < 1.0:  # the policy term on the highest-entropy tokens only
        selected = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
        weights = selected if weights is None else weights * selected
        aux["entropy_mask_fraction"] = masked_mean(selected, mask)
    pg_loss, clip_metrics = clipped_policy_loss(
        log_ratio, batch["advantages"], mask, config.clip_low, config.clip_high, config.dual_clip, agg_mode, r,
        weights=weights)
    ratio = jnp.exp(log_ratio)
    loss = pg_loss
    aux["policy_loss"] = pg_loss
    if config.uses_critic:
        vf_loss, vf_clipfrac = value_loss(values, batch["values"].astype(jnp.float32), batch["returns"],
                                                   mask, config.cliprange_value, agg_mode, r)
        loss = loss + config.vf_coef * vf_loss
        aux.update(value_loss=vf_loss, vf_clipfrac=vf_clipfrac)
    ent = masked_mean(entropy, mask)
    if "entropy_coef" in batch:  # a coefficient per completion (the adaptive one)
        loss = loss - aggregate(entropy * batch["entropy_coef"].astype(jnp.float32)[:, None])
    elif config.ent_coef:
        loss = loss - config.ent_coef * (ent if agg_mode == "token_mean" else aggregate(entropy))
    else:
        ent = jax.lax.stop_gradient(ent)  # a metric only: no backward pass through the (B, R, V) entropy
    if config.kl_loss_coef:
        per_token_kl = kl_loss_per_token(logprobs, batch["ref_logprobs"].astype(jnp.float32),
                                                  config.kl_loss_estimator)
        if config.kl_loss_bias_correction:  # TRL's use_bias_correction_kl: weighted by pi / pi_old
            per_token_kl = per_token_kl * ratio
        kl = aggregate(per_token_kl)
        loss = loss + config.kl_loss_coef * kl
        aux["kl"] = jax.lax.stop_gradient(kl)
    sg = jax.lax.stop_gradient
    aux.update({
        "entropy": ent,
        "approxkl": sg(approx_kl(logprobs, old_logprobs, mask)),
        "clipfrac": clip_metrics["clipfrac"],
        "ratio": sg(masked_mean(ratio, mask)),
        "ratio_var": sg(masked_var(ratio, mask, unbiased=False)),
        **{k: v for k, v in clip_metrics.items() if k.startswith("clip_ratio/")},
    })
    if config.dual_clip is not None:
        aux["clip_ratio/dual_mean"] = clip_metrics["dual_clip_fraction"]
    return loss, aux


def minibatch_group(config: PPOConfig) -> int:
    """The rows the update keeps together: `num_generations` G when G > 1 divides the
    mini-batch (then every mini-batch holds whole groups, each a prompt's completions,
    shuffled group by group: `jaxppo.update.engine.GroupOrder`), else 1 (rows shuffled one
    by one). It does not depend on gradient accumulation, so accumulating changes no
    mini-batch."""
    g = config.num_generations
    return g if g > 1 and config.mini_batch_size % g == 0 else 1


def minibatch_order(config: PPOConfig):
    """The update's mini-batch order: `GroupOrder(G)` when groups are kept whole
    (`minibatch_group`), else None (rows shuffled one by one)."""
    group = minibatch_group(config)
    return GroupOrder(group) if group > 1 else None


def prompt_group(config: PPOConfig) -> int:
    """G when each group's prompt runs once: `share_prompts=True`, G > 1 dividing the
    micro-batch (whole groups in every micro-batch) and no packing; else 1. (The trainer
    turns the default `share_prompts=None` into True: its rollouts' groups share prompts.)"""
    g = minibatch_group(config)
    whole = g > 1 and config.micro_batch_size % g == 0
    return g if whole and config.share_prompts is True and not config.pack_sequences else 1


def _loss_group(config: PPOConfig) -> int:
    """`prompt_group`, except under a mesh of more than one device, where the loss runs
    every row: JAX's SPMD partitioner gives the grouped forward's gradient wrong on some
    meshes (1x8 fsdp, 2x2x2; seen in tests/test_sharding.py on jax 0.10.2, 0.11.2 and
    0.12.0.1 alike), while its forward (the scoring pass) is right."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if not mesh.empty and mesh.size > 1 else prompt_group(config)


def _outputs(apply_fn, params, batch, config: PPOConfig):
    """The response tokens' (log-probs, values, entropies), and the aux entries this adds:
    with `pack_sequences`, computed on the rows packed into streams, and whether they
    did not fit (then the padded forward ran); with `share_prompts`, each group's prompt
    run once (`prompt_group`)."""
    if not config.pack_sequences:
        return response_outputs(apply_fn, params, batch, config.temperature, _loss_group(config)), {}
    outputs, fits = packing.response_outputs_and_fit(apply_fn, params, batch, config.temperature,
                                                     config.pack_streams, config.pack_length)
    return outputs, {"packing_overflow": 1.0 - fits.astype(jnp.float32)}


def loss_normaliser(batch, config: PPOConfig):
    """What the aggregation divides by, besides its own counts: the response length for
    "seq_mean_token_sum_norm" (`loss_norm_length`, else the batch's width); the rollout's
    real tokens per mini-batch for "token_sum_batch_norm" (`train_step` puts it in the
    batch as `loss_token_norm`)."""
    if config.loss_aggregation == "token_sum_batch_norm":
        return batch["loss_token_norm"][0]
    return config.loss_norm_length or batch["response_tokens"].shape[1]


def token_count(batch):
    """Real response tokens of a (micro-)batch: the token-mean loss's weight."""
    return jnp.sum(batch["response_mask"].astype(jnp.float32))


def micro_batch_weight(config: PPOConfig):
    """How micro-batches are weighted under gradient accumulation, so that they add up to
    exactly the whole mini-batch's loss: by real tokens for a token mean; equally (they
    hold equal numbers of completions) for the per-completion means."""
    return token_count if config.loss_aggregation == "token_mean" else None


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
    "kl": ("kl", "per_minibatch/kl"),
    "entropy_mask_fraction": ("policy/entropy_mask_fraction", "per_minibatch/policy/entropy_mask_fraction"),
    "packing_overflow": ("packing/overflow", "per_minibatch/packing/overflow"),
}


@functools.lru_cache(maxsize=None)
def loss_for(apply_fn, config: PPOConfig):
    """`ppo_loss` with `apply_fn` and `config` bound: one function object per pair, so the
    engine's static argument is the same object on every call and nothing is traced twice."""
    return functools.partial(ppo_loss, apply_fn=apply_fn, config=config)


def train_step_fn(state: TrainState, rollout: Rollout, key, config: PPOConfig, minibatch_sharding=None):
    """One update from a rollout, compiled as one program (once per config and shapes).

    Computes advantages (and, with a critic, returns) once for the whole rollout
    (`compute_advantages`), then runs `config.ppo_epochs` epochs of
    `config.num_minibatches` shuffled mini-batch updates of the loss (`ppo_loss`) through
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
      rollout: a `Rollout` with exactly `config.batch_size` rows.
      key: PRNG key for the mini-batch permutations.
      config: `PPOConfig` (static).
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
    _check_rollout_structure(rollout, config)
    _check_packing(state.apply_fn, rollout, config)
    advantages, returns, adv_stats = config.estimator.compute(rollout, config)
    batch = {
        "query_tokens": rollout.query_tokens,
        "query_mask": rollout.query_mask,
        "response_tokens": rollout.response_tokens,
        "response_mask": rollout.response_mask,
        "logprobs": rollout.logprobs,
        "advantages": advantages,
    }
    if config.uses_critic:
        batch.update(values=rollout.values, returns=returns)
    if config.kl_loss_coef:
        batch["ref_logprobs"] = rollout.ref_logprobs
    if rollout.entropy_coef is not None:
        batch["entropy_coef"] = rollout.entropy_coef
    if rollout.response_attention_mask is not None:  # a multi-turn episode's environment tokens
        batch["response_attention_mask"] = rollout.response_attention_mask
    if config.loss_aggregation == "token_sum_batch_norm":  # TRL's dapo: the batch's tokens per mini-batch
        tokens = jnp.maximum(jnp.sum(rollout.response_mask.astype(jnp.float32)), 1.0)
        # Micro-batches are averaged (no weight_fn): each one's sum counts k times over.
        norm = tokens / (config.num_minibatches * config.gradient_accumulation_steps)
        batch["loss_token_norm"] = jnp.full((config.batch_size,), norm, jnp.float32)
    mismatch = {}
    if rollout.sampler_logprobs is not None:
        mismatch = mismatch_metrics(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask)
        if config.rollout_correction != "none":
            batch["correction_weights"] = correction_weights(
                rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask, config.rollout_correction,
                config.rollout_correction_cap)
    step_before = state.step
    state, engine_metrics = update_epochs_fn(
        state, batch, key, loss_for(state.apply_fn, config), config, weight_fn=micro_batch_weight(config),
        minibatch_sharding=minibatch_sharding, order=minibatch_order(config),
    )
    metrics = _summarise(engine_metrics, state.step - step_before, rollout, advantages, returns, config)
    metrics.update(adv_stats)
    metrics.update(mismatch)
    return state, metrics


def _check_rollout_structure(rollout, config: PPOConfig):
    """Shapes and dtypes of a rollout against the config (at trace time: before compiling)."""
    if not isinstance(rollout, Rollout):
        raise TypeError(f"rollout must be a jaxppo.Rollout, got {type(rollout).__name__}")
    if len(rollout.response_tokens.shape) != 2:
        raise ValueError(f"rollout.response_tokens has shape {rollout.response_tokens.shape}; expected "
                         "(batch, response_len)")
    b, r = rollout.response_tokens.shape
    if b != config.batch_size:
        raise ValueError(
            f"rollout has {b} rows but PPOConfig.batch_size={config.batch_size}; a rollout "
            f"must hold exactly batch_size rows (nothing is dropped or padded)."
        )
    if config.kl_loss_coef and rollout.ref_logprobs is None:
        raise ValueError(f"PPOConfig.kl_loss_coef={config.kl_loss_coef} needs the reference policy's log-probs in "
                         "rollout.ref_logprobs (batch, response_len); the rollout has none")
    if config.uses_critic and rollout.values is None:
        raise ValueError(f"advantage_estimator={config.advantage_estimator!r} uses a critic: rollout.values must hold "
                         "its values (batch, response_len); the rollout has none")
    for name in _token_fields(rollout, config):
        shape = getattr(rollout, name).shape
        if shape != (b, r):
            raise ValueError(f"rollout.{name} has shape {shape}; expected (batch, response_len) = {(b, r)}")
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


def _check_packing(apply_fn, rollout, config: PPOConfig):
    """With `pack_sequences`: a stream count, a stream length that holds the widest row, a
    model that can run packed (at trace time: before compiling)."""
    if not config.pack_sequences:
        return
    width = packing.stream_length(rollout, None)
    if config.pack_streams is None:
        raise ValueError("PPOConfig.pack_sequences=True needs PPOConfig.pack_streams (streams per micro-batch) in "
                         "train_step; jaxppo.update.packing.minibatch_streams computes the fewest that every micro-batch "
                         "of an update fits in (the Trainer does this every iteration)")
    if config.pack_length is not None and config.pack_length < width:
        raise ValueError(f"PPOConfig.pack_length={config.pack_length} is shorter than the rollout's padded width "
                         f"Q + R = {width}: a row of that many tokens could not be packed; use pack_length >= "
                         f"{width} or None")
    if packing.packer(apply_fn) is None:
        raise ValueError("PPOConfig.pack_sequences=True needs a built-in model (jaxppo.models.Model or "
                         f"PolicyAndCritic) as the train state's apply_fn; got {apply_fn!r}")


def _token_fields(rollout, config):
    """The (B, R) fields the update reads, plus the optional ones the rollout has."""
    names = ["response_mask", "logprobs", "rewards"]
    if config.kl_loss_coef:
        names.append("ref_logprobs")
    names += [n for n in ("values", "sampler_logprobs", "response_attention_mask") if getattr(rollout, n) is not None]
    return names


def _float_fields(rollout):
    return [n for n in ("logprobs", "values", "rewards", "scores", "sampler_logprobs", "entropy_coef")
            if getattr(rollout, n) is not None]


def check_rollout(rollout: Rollout, config: PPOConfig):
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

    _check_rollout_structure(rollout, config)
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
    for name in ("query_tokens", "response_tokens"):
        t = np.asarray(getattr(rollout, name))
        if (t < 0).any():
            row = int(np.flatnonzero(np.any(t < 0, axis=1))[0])
            raise ValueError(f"rollout.{name} row {row} holds negative token ids; ids must be >= 0")
    group = prompt_group(config)
    if group > 1:  # the loss runs each group's prompt once: the group's rows must share it
        qm = np.asarray(rollout.query_mask) > 0
        qt = np.where(qm, np.asarray(rollout.query_tokens), 0)
        first = np.arange(config.batch_size) // group * group
        differs = np.any((qm != qm[first]) | (qt != qt[first]), axis=1)
        if differs.any():
            row = int(np.flatnonzero(differs)[0])
            raise ValueError(
                f"rollout row {row} has another prompt than row {int(first[row])}, the first of its group "
                f"(rows {int(first[row])}-{int(first[row]) + group - 1}): with PPOConfig.share_prompts=True "
                f"train_step runs each group's prompt once, so each group of num_generations={group} "
                "consecutive rows must share query_tokens and query_mask (a prompt's completions); "
                "set share_prompts=False for rows that do not")
    mask = np.asarray(rollout.response_mask) > 0
    for name in _float_fields(rollout):
        x = np.asarray(getattr(rollout, name), np.float64)
        bad = ~np.isfinite(x) & (mask if x.ndim == 2 else True)
        if bad.any():
            row = int(np.flatnonzero(bad.any(axis=1) if bad.ndim == 2 else bad)[0])
            raise ValueError(f"rollout.{name} row {row} has non-finite values at real response tokens; they must be "
                             "finite")


def _summarise(engine_metrics, applied, rollout, advantages, returns, config):
    """TRL-named metrics: `<name>_avg` over applied updates, plus per-mini-batch arrays."""
    applied_mask = engine_metrics["applied"]
    n_applied = jnp.sum(applied_mask.astype(jnp.float32))

    def avg(x):
        x = jnp.where(applied_mask, x, 0.0)
        return jnp.where(n_applied > 0, jnp.sum(x) / jnp.maximum(n_applied, 1.0), jnp.nan)

    mask = rollout.response_mask.astype(jnp.float32)
    metrics = {}
    for key, (avg_name, per_mb_name) in _TRL_NAMES.items():
        if key not in engine_metrics["aux"]:
            continue  # value metrics without a critic, kl without a KL term
        metrics[avg_name] = avg(engine_metrics["aux"][key])
        metrics[per_mb_name] = engine_metrics["aux"][key]
    metrics["loss/total_avg"] = avg(engine_metrics["loss"])
    metrics["per_minibatch/loss/total"] = engine_metrics["loss"]
    metrics["per_minibatch/grad_norm"] = engine_metrics["grad_norm"]
    metrics["per_minibatch/applied"] = applied_mask
    metrics["per_minibatch/nonfinite"] = engine_metrics["nonfinite"]
    metrics["ppo/grad_norm_avg"] = avg(engine_metrics["grad_norm"])
    metrics["ppo/updates_applied"] = applied
    metrics["ppo/updates_planned"] = jnp.asarray(config.updates_per_step, jnp.int32)
    metrics["ppo/updates_nonfinite"] = jnp.sum(engine_metrics["nonfinite"].astype(jnp.int32))
    if "early_stopped" in engine_metrics:
        metrics["per_minibatch/early_stopped"] = engine_metrics["early_stopped"]
        metrics["ppo/early_stopped"] = jnp.any(engine_metrics["early_stopped"])
    metrics["ppo/advantages/mean"] = masked_mean(advantages, mask)
    if config.uses_critic:
        metrics["ppo/returns/mean"] = masked_mean(returns, mask)
        metrics["ppo/returns/var"] = masked_var(returns, mask)
        metrics["ppo/val/mean"] = masked_mean(rollout.values.astype(jnp.float32), mask)
        metrics["ppo/val/var"] = masked_var(rollout.values.astype(jnp.float32), mask)
    return metrics


def jit_train_step(config: PPOConfig = None, *, donate: bool = False, **jit_options):
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
train_step_jit = train_step  # the jitted object; `_cache_size()` counts its compiles
# With the old train state donated (one train state in memory during the update instead of
# two). Module-level, so every trainer in a process shares its compiled programs.
train_step_donating = jit_train_step(donate=True)

