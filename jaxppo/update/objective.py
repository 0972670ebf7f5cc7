"""The loss every algorithm trains with, and the settings it reads (`LossConfig`).

    ppo_loss(params, batch, apply_fn=..., config=LossConfig(...)) -> (loss, aux)

`LossConfig` is to the loss what `jaxppo.update.engine.EngineConfig` is to the engine: the
fields the loss reads and nothing else, validated on construction, hashable (a static
argument). `jaxppo.PPOConfig.loss` is the loss config of a PPO config; `ppo_loss` takes
either.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxppo.update import packing
from jaxppo.update.batch import response_outputs
from jaxppo.update.checks import invalid, is_int, is_real, layer_config
from jaxppo.update.correction import ROLLOUT_CORRECTIONS
from jaxppo.update.kl import KL_LOSS_ESTIMATORS, kl_loss_per_token
from jaxppo.update.losses import (IMPORTANCE_RATIOS, LOSS_AGGREGATIONS, aggregate_loss, approx_kl, clipped_policy_loss,
                                  log_importance_ratio, value_loss)
from jaxppo.update.shaping import high_entropy_mask
from jaxppo.update.stats import masked_mean, masked_var

__all__ = ["LossConfig", "loss_config", "ppo_loss", "loss_for", "prompt_rows", "loss_normaliser", "token_count",
           "micro_batch_weight"]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """What the loss of one (mini- or micro-) batch reads, and nothing else
    (`jaxppo.PPOConfig.loss` makes one from a PPO config, whose fields of the same names
    these are; the defaults are PPO's). Validated on construction; hashable.

    Coefficients:
      cliprange: PPO ratio clip epsilon (ratio is clipped to [1 - c, 1 + c]); >= 0.
      cliprange_value: value clip range around the old values; >= 0.
      vf_coef: weight of the value loss in the total loss; >= 0.
      ent_coef: weight of the entropy bonus (subtracted from the loss); >= 0.
      uses_critic: the loss has a value term (the estimator has a critic: PPO's GAE; a
        `PPOConfig` sets it from its estimator).
      temperature: logits are divided by this before log-softmax, as at sampling time; > 0.

    Policy term and aggregation:
      loss_aggregation: "token_mean" (every real token of the mini-batch counts equally:
        PPO, DAPO), "seq_mean_token_mean" (mean over completions of their token means:
        GRPO), "seq_mean_token_sum_norm" (mean over completions of their token sums divided
        by `loss_norm_length`, default the response length: Dr. GRPO), or
        "token_sum_batch_norm" (the mini-batch's token sum divided by the rollout batch's
        real tokens / `num_minibatches`: TRL's `loss_type="dapo"` with `steps_per_generation`
        = num_minibatches; equal to "token_mean" with one mini-batch). Applies to every term
        of the loss.
      loss_norm_length: the constant "seq_mean_token_sum_norm" divides by (TRL's
        `max_completion_length`); None: the rollout's response width. A positive int.
      cliprange_low, cliprange_high: the ratio is clipped to [1 - low, 1 + high] (DAPO's
        clip-higher); None means `cliprange`.
      dual_clip: None, or a constant c > 1: for negative advantages the loss is capped at
        -A * c (dual-clip PPO).
      importance_ratio: "token" (per-token ratios), "sequence" (GSPO: exp of the mean
        per-token log-ratio of the completion, shared by its tokens) or "sequence_sum"
        (TRL RLOOTrainer's: exp of the summed log-ratio, the whole completion as one
        action). The sequence-level ratios need one advantage per completion: they are
        refused with the per-token estimators ("gae", "reinforce_pp", "reinforce_pp_baseline").
      top_entropy_quantile: train the policy term only on this fraction of the response
        tokens, those of highest entropy under the current policy (Wang et al. 2025,
        "Beyond the 80/20 rule": 0.2; TRL's `top_entropy_quantile`): a token counts when
        its entropy is >= the (1 - q)-quantile of the entropies of the real response
        tokens of the (micro-)batch the loss sees. In (0, 1]; 1.0 (default) keeps all.
        The other terms (value, entropy bonus, KL) keep every token.
      kl_loss_coef: beta of a KL(policy || reference) term in the loss (GRPO's), >= 0;
        kl_loss_estimator: "k1", "k2" or "k3". When kl_coef, kl_loss_coef are 0 and the
        trainer has no kl_target, no reference model is built or run at all.
        kl_loss_bias_correction: multiply each token's KL term by its importance ratio
        pi / pi_old (gradient through the ratio too): TRL's `use_bias_correction_kl`, on by
        default there, off here (as in verl and the GRPO paper).

    Sampler mismatch (applies to rollouts that carry the sampler's log-probs,
    `RolloutBatch.sampler_logprobs`, as the trainer's do):
      rollout_correction: how the policy loss corrects for the sampler's distribution
        differing from the trainer's (`jaxppo.update.correction`): "token_truncate" (default:
        each token's loss weighted by min(pi_old / pi_sampler, C), truncated importance
        sampling), "token_mask" (tokens whose ratio lies outside [1/C, C] get weight 0),
        "sequence_truncate" / "sequence_mask" (the same with the completion's ratio, the
        product of its tokens'), or "none". With the built-in sampler in float32 the
        ratios are 1 within rounding and the default changes nothing measurable; in bf16,
        or with another engine, it is the correction the samples need.
      rollout_correction_cap: C, > 1.

    Groups of completions (`num_generations` G > 1): when G divides `mini_batch_size`,
    every mini-batch holds whole groups (the rollout is shuffled group by group;
    `jaxppo.update.ppo.minibatch_group`), else rows are shuffled one by one.
      share_prompts: run each group's prompt once, for its G completions, in the scoring
        pass and in the update's loss (`jaxppo.models.Model.grouped_outputs`: the prompt's
        keys and values are shared, its activations receive the sum of the G completions'
        gradients): the same log-probs, losses and gradients up to float rounding, for a
        group's Q + G * R tokens instead of G * (Q + R) (built-in models; any other runs
        every row). Only where G also divides the micro-batch and without `pack_sequences`, which packs
        rows instead. Under a mesh of several devices the loss runs every row (a JAX
        partitioner bug in the grouped gradient, seen in 0.10.2 to 0.12.0.1); the scoring pass still groups.
        None (the default): the trainer turns it on (its groups share their prompt by
        construction); `train_step` on a rollout you build runs every row. True: your
        rollout's groups share their prompt (`jaxppo.check_rollout` checks it; a group
        that does not gives wrong results). False: every row, as 0.3 did.
      num_generations: G, completions per prompt in consecutive rows.

    common_prefix: every row of the rollout has the same query, the prompt set's common
      prefix (a chat template's system prompt, say), and the rest of each prompt opens its
      response region (attended, `response_attention_mask`; not trained, `response_mask`):
      the loss runs that query once per micro-batch, whatever rows the shuffle puts there
      (`jaxppo.models.Model.grouped_outputs`), for p + B * (Q - p + R) tokens instead of
      B * (Q + R); equal log-probs, losses and gradients up to float rounding. The trainer
      builds its rollouts in that layout (`jaxppo.update.prefix`, also for its scoring
      pass); `train_step` on a rollout you build: give it in that layout
      (`jaxppo.check_rollout` checks that every row shares the query). Built-in models
      (any other runs every row); not with `pack_sequences`. Under a mesh of several
      devices the loss runs every row (see `share_prompts`). None (the default): the
      trainer decides (on when its prompts share enough leading tokens to pay:
      `jaxppo.run.parts.AUTO_COMMON_PREFIX_MIN_TOKENS`, docs/ppo.md); `train_step` reads
      None as False. True: your rollout is in that layout. False: the usual layout.

    Packed sequences (`jaxppo.update.packing`; the same losses and gradients, up to float rounding):
      pack_sequences: run the loss's forward on each micro-batch's rows of real tokens
        packed into `pack_streams` streams of `pack_length` tokens (segment ids: attention
        and positions restart per row) instead of the padded (rows, Q + R) batch. Needs a
        built-in model (`jaxppo.models.Model` or `PolicyAndCritic`). The mini-batches and
        the update count are those of the padded path. A micro-batch whose rows need more
        streams runs padded (counted: `packing/overflow`).
      pack_streams: streams per micro-batch, a positive int no larger than the micro-batch.
        None: `train_step` refuses it; the `Trainer` chooses it per iteration with
        `jaxppo.update.packing.minibatch_streams` (the fewest that every micro-batch fits in,
        rounded up to 1, 2, 3, 4, 6, 8, 12, ...), so nothing falls back.
      pack_length: tokens per stream, >= the padded width Q + R (checked while tracing);
        None: Q + R.

      owner: the name error messages give the fields (`PPOConfig` makes its loss config
        with its own name); not part of equality or the hash.
    """

    cliprange: float = 0.2
    cliprange_low: Optional[float] = None
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    uses_critic: bool = True
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    importance_ratio: str = "token"
    loss_aggregation: str = "token_mean"
    loss_norm_length: Optional[int] = None
    kl_loss_coef: float = 0.0
    kl_loss_estimator: str = "k3"
    kl_loss_bias_correction: bool = False
    rollout_correction: str = "token_truncate"
    rollout_correction_cap: float = 2.0
    top_entropy_quantile: float = 1.0
    temperature: float = 1.0
    num_generations: int = 1
    share_prompts: Optional[bool] = None
    common_prefix: Optional[bool] = None
    pack_sequences: bool = False
    pack_streams: Optional[int] = None
    pack_length: Optional[int] = None
    owner: str = dataclasses.field(default="LossConfig", compare=False, repr=False)

    def __post_init__(self):
        _check_choices(self)
        _check_numbers(self)

    @property
    def clip_low(self) -> float:
        return self.cliprange if self.cliprange_low is None else self.cliprange_low

    @property
    def clip_high(self) -> float:
        return self.cliprange if self.cliprange_high is None else self.cliprange_high

    def replace(self, **changes) -> "LossConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _check_choices(c: LossConfig):
    choices = {"loss_aggregation": LOSS_AGGREGATIONS, "importance_ratio": IMPORTANCE_RATIOS,
               "kl_loss_estimator": KL_LOSS_ESTIMATORS, "rollout_correction": ROLLOUT_CORRECTIONS}
    for name, valid in choices.items():
        if getattr(c, name) not in valid:
            raise invalid(c.owner, name, getattr(c, name), "one of " + ", ".join(repr(v) for v in valid))
    for name in ("uses_critic", "kl_loss_bias_correction", "pack_sequences"):
        if not isinstance(getattr(c, name), bool):
            raise invalid(c.owner, name, getattr(c, name), "a bool (True or False)")
    optional = {"share_prompts": "None (the trainer: on; train_step: off), True or False",
                "common_prefix": "None (the trainer: on when the prompts share enough leading tokens; train_step: "
                                 "off), True or False"}
    for name, valid in optional.items():  # a bool itself: 1 == True, but the loss reads `is True`
        if getattr(c, name) is not None and not isinstance(getattr(c, name), bool):
            raise invalid(c.owner, name, getattr(c, name), valid)
    if c.common_prefix is True and c.pack_sequences:
        raise invalid(c.owner, "common_prefix", c.common_prefix,
                      "False with pack_sequences=True (packing packs whole rows instead); or turn packing off")


def _check_numbers(c: LossConfig):
    for name in ("cliprange", "cliprange_value", "vf_coef", "ent_coef", "kl_loss_coef"):
        if not is_real(getattr(c, name)) or getattr(c, name) < 0:
            raise invalid(c.owner, name, getattr(c, name), "a finite real number >= 0")
    for name in ("cliprange_low", "cliprange_high"):
        value = getattr(c, name)
        if value is not None and (not is_real(value) or value < 0 or (name == "cliprange_low" and value > 1)):
            raise invalid(c.owner, name, value, "None (use cliprange) or a finite real number >= 0"
                          + (" and <= 1" if name == "cliprange_low" else ""))
    if c.dual_clip is not None and (not is_real(c.dual_clip) or c.dual_clip <= 1):
        raise invalid(c.owner, "dual_clip", c.dual_clip, "None (no dual clip) or a finite real number > 1")
    if not is_real(c.rollout_correction_cap) or c.rollout_correction_cap <= 1:
        raise invalid(c.owner, "rollout_correction_cap", c.rollout_correction_cap, "a finite real number > 1")
    if not is_real(c.top_entropy_quantile) or not 0 < c.top_entropy_quantile <= 1:
        raise invalid(c.owner, "top_entropy_quantile", c.top_entropy_quantile,
                      "a real number in (0, 1]: the fraction of response tokens, by highest entropy, the policy "
                      "term trains on (1.0 keeps all)")
    if c.loss_norm_length is not None and (not is_int(c.loss_norm_length) or c.loss_norm_length <= 0):
        raise invalid(c.owner, "loss_norm_length", c.loss_norm_length,
                      "None (the response width) or a positive int (TRL's max_completion_length)")
    if not is_real(c.temperature) or c.temperature <= 0:
        raise invalid(c.owner, "temperature", c.temperature, "a finite real number > 0")
    if not is_int(c.num_generations) or c.num_generations <= 0:
        kind = "" if is_int(c.num_generations) else f" (got type {type(c.num_generations).__name__})"
        raise invalid(c.owner, "num_generations", c.num_generations, "a positive int" + kind)
    if c.pack_streams is not None and (not is_int(c.pack_streams) or c.pack_streams <= 0):
        raise invalid(c.owner, "pack_streams", c.pack_streams,
                      "None (chosen per iteration by the Trainer) or a positive int (streams per micro-batch)")
    if c.pack_length is not None and (not is_int(c.pack_length) or c.pack_length <= 0):
        raise invalid(c.owner, "pack_length", c.pack_length,
                      "None (the padded width Q + R) or a positive int (tokens per stream)")
    for name in ("pack_streams", "pack_length"):
        if getattr(c, name) is not None and c.pack_sequences is not True:
            raise invalid(c.owner, name, getattr(c, name),
                          "None unless pack_sequences=True (it sizes the packed streams)")


def loss_config(config) -> LossConfig:
    """The `LossConfig` of `config`: itself, or its `.loss` (a `PPOConfig`'s)."""
    return layer_config(config, LossConfig, "loss", "jaxppo.LossConfig")


def ppo_loss(params, batch, *, apply_fn, config):
    """The loss of one (mini- or micro-) batch for every algorithm: a dict of rollout fields
    plus `advantages` (and `returns` with a critic), each leading with the rows. `config`:
    a `LossConfig`, or a config that has one as `.loss` (`jaxppo.PPOConfig`).

        loss = policy_loss (+ vf_coef * value_loss) (- ent_coef * entropy)
               (+ kl_loss_coef * KL(policy || reference))

    (each bracketed term only when it applies: `jaxppo.algorithms.loss_terms(config)`; with
    an `entropy_coef` column in the batch, the rollout's per-completion coefficients weigh
    the entropy instead of `ent_coef`)
    policy_loss: the clipped surrogate with the ratio per token (or per completion, GSPO:
    `config.importance_ratio`) clipped to [1 - clip_low, 1 + clip_high], optionally dual
    clipped (`jaxppo.update.losses.clipped_policy_loss`). Every term is reduced by
    `config.loss_aggregation` over the real response tokens (PPO's "token_mean" is a masked
    mean over all of them). The value loss exists only with a critic.

    Returns (loss, aux) with scalar aux entries: policy_loss, entropy, approxkl, clipfrac,
    ratio, ratio_var, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean;
    value_loss and vf_clipfrac with a critic; kl with a KL term; clip_ratio/dual_mean (tokens
    whose loss the dual clip capped) with `dual_clip`; entropy_mask_fraction (the share of
    real tokens the policy term trains on) with `top_entropy_quantile` < 1.
    """
    config = loss_config(config)
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


def prompt_rows(config: LossConfig, rows: int) -> int:
    """G when a batch of `rows` rows runs each group's prompt once: `share_prompts=True`,
    G > 1 dividing `rows` (whole groups in the batch: the engine keeps them whole when G
    divides the mini-batch) and no packing; `rows` with `common_prefix` (one query for
    every row); else 1."""
    if config.common_prefix is True and not config.pack_sequences:
        return rows
    g = config.num_generations
    return g if g > 1 and rows % g == 0 and config.share_prompts is True and not config.pack_sequences else 1


def _loss_group(config: LossConfig, rows: int) -> int:
    """`prompt_rows`, except under a mesh of more than one device, where the loss runs
    every row: JAX's SPMD partitioner gives the grouped forward's gradient wrong on some
    meshes (1x8 fsdp, 2x2x2; seen in tests/test_sharding.py on jax 0.10.2, 0.11.2 and
    0.12.0.1 alike), while its forward (the scoring pass) is right."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if not mesh.empty and mesh.size > 1 else prompt_rows(config, rows)


def _outputs(apply_fn, params, batch, config: LossConfig):
    """The response tokens' (log-probs, values, entropies), and the aux entries this adds:
    with `pack_sequences`, computed on the rows packed into streams, and whether they
    did not fit (then the padded forward ran); with `share_prompts`, each group's prompt
    run once (`prompt_rows`)."""
    if not config.pack_sequences:
        group = _loss_group(config, batch["response_mask"].shape[0])
        return response_outputs(apply_fn, params, batch, config.temperature, group), {}
    outputs, fits = packing.response_outputs_and_fit(apply_fn, params, batch, config.temperature,
                                                     config.pack_streams, config.pack_length)
    return outputs, {"packing_overflow": 1.0 - fits.astype(jnp.float32)}


def loss_normaliser(batch, config: LossConfig):
    """What the aggregation divides by, besides its own counts: the response length for
    "seq_mean_token_sum_norm" (`loss_norm_length`, else the batch's width); the rollout's
    real tokens per mini-batch for "token_sum_batch_norm" (`train_step` puts it in the
    batch as `loss_token_norm`)."""
    if config.loss_aggregation == "token_sum_batch_norm":
        return batch["loss_token_norm"][0]
    if (config.loss_aggregation == "seq_mean_token_sum_norm" and config.loss_norm_length is None
            and config.common_prefix is True):  # refused while tracing, before anything compiles
        raise invalid(config.owner, "loss_norm_length", None,
                      "the response length (an int > 0) with loss_aggregation='seq_mean_token_sum_norm' and "
                      "common_prefix=True: the layout's response region also holds the rest of each prompt, so its "
                      "width is not the response length the aggregation divides by (the trainer sets it itself)")
    return config.loss_norm_length or batch["response_tokens"].shape[1]


def token_count(batch):
    """Real response tokens of a (micro-)batch: the token-mean loss's weight."""
    return jnp.sum(batch["response_mask"].astype(jnp.float32))


def micro_batch_weight(config: LossConfig):
    """How micro-batches are weighted under gradient accumulation, so that they add up to
    exactly the whole mini-batch's loss: by real tokens for a token mean; equally (they
    hold equal numbers of completions) for the per-completion means."""
    return token_count if loss_config(config).loss_aggregation == "token_mean" else None


def loss_for(apply_fn, config):
    """`ppo_loss` with `apply_fn` and the loss config of `config` bound: one function object
    per pair, so the engine's static argument is the same object on every call and nothing
    is traced twice."""
    return _bound_loss(apply_fn, loss_config(config))


@functools.lru_cache(maxsize=None)
def _bound_loss(apply_fn, config: LossConfig):
    return functools.partial(ppo_loss, apply_fn=apply_fn, config=config)
