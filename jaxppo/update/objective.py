"""The loss every algorithm trains with, and what it reads (`Objective`).

    total_loss(params, batch, apply_fn=..., config=jaxppo.Config(...)) -> (loss, aux)

`Objective` is the loss's view of a `jaxppo.Config` (`Config.objective`): the settings the
loss reads and nothing else, hashable (a static argument), so a setting the loss never
reads does not retrace it. `total_loss` takes either.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxppo.update import packing
from jaxppo.update.batch import joined, model_method, response_outputs, routed_outputs
from jaxppo.update.checks import invalid, layer_config
from jaxppo.update.kl import kl_loss_per_token
from jaxppo.update.losses import (aggregate_loss, approx_kl, cispo_policy_loss, clipped_policy_loss,
                                  log_importance_ratio, sapo_policy_loss, top_k_divergence, value_loss,
                                  vespo_policy_loss)
from jaxppo.update.shaping import high_entropy_mask
from jaxppo.update.stats import masked_mean, masked_var

__all__ = ["Objective", "objective", "total_loss", "loss_for", "prompt_rows", "loss_normaliser", "token_count",
           "micro_batch_weight"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """What the loss of one (mini- or micro-) batch reads, and nothing else: a view made by
    `jaxppo.Config.objective` from the settings of several concerns (the loss's own, the KL
    term, the temperature, the groups, the layout the loss runs in), each checked there;
    hashable (a static argument of the compiled loss). To change one, change the `Config`.

    Attributes (each documented where it is set): from `jaxppo.LossConfig` surrogate,
    cliprange, cliprange_low, cliprange_high, dual_clip, sapo_temperatures, vespo_shape,
    cliprange_value, vf_coef, ent_coef,
    importance_ratio, loss_aggregation, loss_norm_length, top_entropy_quantile,
    rollout_correction, rollout_correction_cap, routing_replay, router_aux_loss_coef; from `jaxppo.KLConfig` kl_loss_coef,
    kl_loss_estimator, kl_loss_bias_correction; `jaxppo.SamplingConfig.temperature`;
    from `jaxppo.AdvantageConfig` num_generations, distill_top_k and distill_divergence (the
    divergence to a teacher's top k); from `jaxppo.LayoutConfig` share_prompts,
    common_prefix, pack_sequences, pack_streams, pack_length; and `uses_critic`, whether
    the estimator has a critic (the loss then has a value term).
    """

    surrogate: str = "clip"
    cliprange: float = 0.2
    cliprange_low: Optional[float] = None
    cliprange_high: Optional[float] = None
    dual_clip: Optional[float] = None
    sapo_temperatures: Tuple[float, float] = (1.0, 1.05)
    vespo_shape: Tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
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
    routing_replay: bool = False
    router_aux_loss_coef: float = 0.0
    top_entropy_quantile: float = 1.0
    temperature: float = 1.0
    num_generations: int = 1
    distill_top_k: int = 0
    distill_divergence: str = "reverse"
    share_prompts: Optional[bool] = None
    common_prefix: Optional[bool] = None
    pack_sequences: bool = False
    pack_streams: Optional[int] = None
    pack_length: Optional[int] = None

    @property
    def clip_low(self) -> float:
        return self.cliprange if self.cliprange_low is None else self.cliprange_low

    @property
    def clip_high(self) -> float:
        return self.cliprange if self.cliprange_high is None else self.cliprange_high

    def replace(self, **changes) -> "Objective":
        """A copy with `changes` applied."""
        return dataclasses.replace(self, **changes)


def objective(config) -> Objective:
    """The `Objective` of `config`: itself, or its `.objective` (a `jaxppo.Config`'s)."""
    return layer_config(config, Objective, "objective", "jaxppo.update.objective.Objective")


def _entropy_bonus(entropy, mask, batch, config: Objective, aggregate):
    """(the entropy bonus the loss subtracts, the mean entropy for the metrics): weighted by
    the rollout's per-completion coefficients where the batch has them (the adaptive one),
    else by `ent_coef`; 0 without either (the entropy then a metric only, kept out of the
    backward pass through the (B, R, V) logits)."""
    ent = masked_mean(entropy, mask)
    if "entropy_coef" in batch:
        return aggregate(entropy * batch["entropy_coef"].astype(jnp.float32)[:, None]), ent
    if config.ent_coef:
        return config.ent_coef * (ent if config.loss_aggregation == "token_mean" else aggregate(entropy)), ent
    return 0.0, jax.lax.stop_gradient(ent)


def _kl_term(logprobs, ratio, batch, config: Objective, aggregate):
    """The KL term's value (before `kl_loss_coef`): the estimator's per-token KL to the
    reference, weighted by pi / pi_old with TRL's `use_bias_correction_kl`, aggregated."""
    per_token_kl = kl_loss_per_token(logprobs, batch["ref_logprobs"].astype(jnp.float32), config.kl_loss_estimator)
    if config.kl_loss_bias_correction:
        per_token_kl = per_token_kl * ratio
    return aggregate(per_token_kl)


def _reference_terms(logprobs, student_top, ratio, batch, config: Objective, aggregate, aux):
    """The terms that read a frozen model, each in `aux` too: kl_loss_coef times the KL to
    the reference ("kl"), and the divergence to a teacher's top k ("distill_divergence")
    with `distill_top_k` (`student_top`: the student's log-probs of those tokens)."""
    total = 0.0
    if config.kl_loss_coef:
        kl = _kl_term(logprobs, ratio, batch, config, aggregate)
        total = total + config.kl_loss_coef * kl
        aux["kl"] = jax.lax.stop_gradient(kl)
    if student_top is not None:
        divergence = aggregate(top_k_divergence(student_top, batch["teacher_top_logprobs"].astype(jnp.float32),
                                                config.distill_divergence))
        total = total + divergence
        aux["distill_divergence"] = jax.lax.stop_gradient(divergence)
    return total


def total_loss(params, batch, *, apply_fn, config):
    """The loss of one (mini- or micro-) batch for every algorithm: a dict of rollout fields
    plus `advantages` (and `returns` with a critic), each leading with the rows. `config`:
    a `jaxppo.Config`, or its `Objective`.

        loss = policy_loss (+ vf_coef * value_loss) (- ent_coef * entropy)
               (+ kl_loss_coef * KL(policy || reference)) (+ D(policy, teacher's top k)) (+ MoE's)

    (each bracketed term only when it applies: `jaxppo.algorithms.loss_terms(config)`; with
    an `entropy_coef` column in the batch, the rollout's per-completion coefficients weigh
    the entropy instead of `ent_coef`)
    policy_loss: by `config.surrogate`, with the ratio per token (or per completion, GSPO:
    `config.importance_ratio`): "clip", the clipped surrogate, the ratio clipped to
    [1 - clip_low, 1 + clip_high], optionally dual clipped
    (`jaxppo.update.losses.clipped_policy_loss`); "cispo", the ratio capped at
    1 + clip_high and detached, times A log pi (`cispo_policy_loss`); "sapo", the soft gate
    (`sapo_policy_loss`); "vespo", the gamma weight of the completion's ratio, detached,
    times A log pi (`vespo_policy_loss`). Every term is reduced by
    `config.loss_aggregation` over the real response tokens (PPO's "token_mean" is a masked
    mean over all of them). The value loss exists only with a critic.

    Returns (loss, aux) with scalar aux entries: policy_loss, entropy, approxkl, ratio,
    ratio_var; with "clip", clipfrac, clip_ratio/low_mean, clip_ratio/high_mean,
    clip_ratio/region_mean; with "cispo", clipfrac and clip_ratio/high_mean (weights the
    cap lowered); sapo_gate with "sapo"; vespo_phi with "vespo";
    value_loss and vf_clipfrac with a critic; kl with a KL term; clip_ratio/dual_mean (tokens
    whose loss the dual clip capped) with `dual_clip`; entropy_mask_fraction (the share of
    real tokens the policy term trains on) with `top_entropy_quantile` < 1; distill_divergence
    (the divergence to the teacher's top k, `jaxppo.update.losses.top_k_divergence`,
    aggregated like every term) with `distill_top_k`; a mixture of experts' (`_routed_outputs`).
    """
    config = objective(config)
    mask = batch["response_mask"].astype(jnp.float32)
    r = loss_normaliser(batch, config)
    agg_mode = config.loss_aggregation

    def aggregate(per_token):
        return aggregate_loss(per_token, mask, agg_mode, r)

    (logprobs, values, entropy), student_top, aux = _outputs(apply_fn, params, batch, config)
    old_logprobs = batch["logprobs"].astype(jnp.float32)
    log_ratio = log_importance_ratio(logprobs, old_logprobs, mask, config.importance_ratio)
    selected = None
    if config.top_entropy_quantile < 1.0:  # the policy term on the highest-entropy tokens only
        selected = high_entropy_mask(entropy, mask, config.top_entropy_quantile)
        aux["entropy_mask_fraction"] = masked_mean(selected, mask)
    pg_loss, clip_metrics = _policy_term(logprobs, log_ratio, batch, mask, selected, config, r)
    ratio = jnp.exp(log_ratio)
    loss = pg_loss
    aux["policy_loss"] = pg_loss
    if config.uses_critic:
        vf_loss, vf_clipfrac = value_loss(values, batch["values"].astype(jnp.float32), batch["returns"],
                                          mask, config.cliprange_value, agg_mode, r)
        loss = loss + config.vf_coef * vf_loss
        aux.update(value_loss=vf_loss, vf_clipfrac=vf_clipfrac)
    bonus, ent = _entropy_bonus(entropy, mask, batch, config, aggregate)
    loss = loss - bonus
    loss = loss + _reference_terms(logprobs, student_top, ratio, batch, config, aggregate, aux)
    loss = loss + _router_term(aux, config)
    sg = jax.lax.stop_gradient
    aux.update(entropy=ent, approxkl=sg(approx_kl(logprobs, old_logprobs, mask)),
               ratio=sg(masked_mean(ratio, mask)), ratio_var=sg(masked_var(ratio, mask, unbiased=False)),
               **{k: v for k, v in clip_metrics.items() if k != "dual_clip_fraction"})
    if config.dual_clip is not None and config.surrogate == "clip":
        aux["clip_ratio/dual_mean"] = clip_metrics["dual_clip_fraction"]
    return loss, aux


def _policy_term(logprobs, log_ratio, batch, mask, selected, config: Objective, norm):
    """The policy term of the loss by `config.surrogate`, and its metrics. The weights on
    each token: the sampler-mismatch correction (`correction_weights`; VESPO folds it into
    the completion's importance weight instead) times the high-entropy selection."""
    correction = batch.get("correction_weights")
    advantages, agg = batch["advantages"], config.loss_aggregation
    if config.surrogate == "vespo":
        log_correction = None if correction is None else jnp.log(correction)
        return vespo_policy_loss(logprobs, log_ratio, advantages, mask, config.vespo_shape, agg, norm, log_correction,
                                 weights=selected)
    weights = correction
    if selected is not None:
        weights = selected if weights is None else weights * selected
    if config.surrogate == "cispo":
        return cispo_policy_loss(logprobs, log_ratio, advantages, mask, 1.0 + config.clip_high, agg, norm, weights)
    if config.surrogate == "sapo":
        return sapo_policy_loss(log_ratio, advantages, mask, config.sapo_temperatures, agg, norm, weights)
    return clipped_policy_loss(log_ratio, advantages, mask, config.clip_low, config.clip_high, config.dual_clip, agg,
                               norm, weights=weights)


def prompt_rows(config: Objective, rows: int) -> int:
    """G when a batch of `rows` rows runs each group's prompt once: `share_prompts=True`,
    G > 1 dividing `rows` (whole groups in the batch: the engine keeps them whole when G
    divides the mini-batch) and no packing; `rows` with `common_prefix` (one query for
    every row); else 1."""
    if config.common_prefix is True and not config.pack_sequences:
        return rows
    g = config.num_generations
    return g if g > 1 and rows % g == 0 and config.share_prompts is True and not config.pack_sequences else 1


def _loss_group(config: Objective, rows: int) -> int:
    """`prompt_rows`, except under a mesh of more than one device, where the loss runs
    every row: JAX's SPMD partitioner gives the grouped forward's gradient wrong on some
    meshes (1x8 fsdp, 2x2x2; seen in tests/test_sharding.py on jax 0.10.2, 0.11.2 and
    0.12.0.1 alike), while its forward (the forward pass) is right."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if not mesh.empty and mesh.size > 1 else prompt_rows(config, rows)


def _outputs(apply_fn, params, batch, config: Objective):
    """The response tokens' (log-probs, values, entropies), the student's log-probs (B, R, k)
    of the teacher's top-k tokens with `distill_top_k` (else None), and the aux entries this adds:
    with `pack_sequences`, computed on the rows packed into streams, and whether they
    did not fit (then the padded forward ran); with `share_prompts`, each group's prompt
    run once (`prompt_rows`)."""
    if not config.pack_sequences:
        group = _loss_group(config, batch["response_mask"].shape[0])
        if _routed(apply_fn, batch, config, group):
            return _routed_outputs(apply_fn, params, batch, config)
        if not config.distill_top_k:
            return response_outputs(apply_fn, params, batch, config.temperature, group), None, {}
        # the student's log-probs of the teacher's top k ride beside the sampled token's
        logprobs, values, entropy = response_outputs(apply_fn, params, batch, config.temperature, group,
                                                     batch["teacher_top_ids"])
        return (logprobs[..., 0], values, entropy), logprobs[..., 1:], {}
    outputs, fits = packing.response_outputs_and_fit(apply_fn, params, batch, config.temperature,
                                                     config.pack_streams, config.pack_length)
    return outputs, None, {"packing_overflow": 1.0 - fits.astype(jnp.float32)}


def _routed(apply_fn, batch, config: Objective, group: int) -> bool:
    """Whether the loss reads a mixture of experts' routing: the rollout carries it, or the
    load-balancing loss is on. Refuses (while tracing, before anything compiles) routing
    replay or the load-balancing loss where it cannot be read."""
    asked = config.routing_replay or bool(config.router_aux_loss_coef)
    if not asked and "routing" not in batch:
        return False
    method = model_method(apply_fn, "routed_outputs")
    problem = None
    if method is None:
        problem = "a model that offers routed_outputs (a built-in mixture of experts: qwen3_moe, mixtral)"
    elif group > 1 or config.distill_top_k:
        problem = "the plain layout (share_prompts and common_prefix off) and no distill_top_k"
    elif config.routing_replay and "routing" not in batch:
        problem = "a rollout that carries the forward pass's routing (RolloutBatch.routing)"
    if problem is None:
        return True
    if asked:
        raise ValueError(f"LossConfig.routing_replay={config.routing_replay} / router_aux_loss_coef="
                         f"{config.router_aux_loss_coef} need {problem}")
    return False  # the routing rides along unread (the mismatch metric is left out)


def _routed_outputs(apply_fn, params, batch, config: Objective):
    """`_outputs` through a mixture of experts' routed forward: the rollout's routing
    (`RolloutBatch.routing`) replayed with `routing_replay`; in the aux entries
    `routing_mismatch`, the share of the real tokens' (token, layer) pairs whose experts the
    router picks differently from the rollout's (its own choice, also under replay), and
    `router_aux`, the load-balancing loss, with `router_aux_loss_coef` (the loss adds it
    times the coefficient: `_router_term`)."""
    recorded = batch.get("routing")
    outputs, routing = routed_outputs(apply_fn, params, batch, config.temperature,
                                      replay=recorded if config.routing_replay else None,
                                      aux_loss=bool(config.router_aux_loss_coef))
    aux = {}
    if recorded is not None:
        differs = jnp.any(jnp.sort(routing["chosen"], axis=-1) != jnp.sort(recorded, axis=-1), axis=-1)
        real = joined(batch)[1].astype(jnp.float32)[:, :, None]
        aux["routing_mismatch"] = jnp.sum(differs * real) / jnp.maximum(jnp.sum(real) * differs.shape[-1], 1.0)
    if config.router_aux_loss_coef:
        aux["router_aux"] = routing["aux_loss"]
    return outputs, None, aux


def _router_term(aux, config: Objective):
    """router_aux_loss_coef times a mixture of experts' load-balancing loss where `aux` has
    it (`_routed_outputs`), its entry then detached for the metrics; else 0."""
    if "router_aux" not in aux:
        return 0.0
    term = config.router_aux_loss_coef * aux["router_aux"]
    aux["router_aux"] = jax.lax.stop_gradient(aux["router_aux"])
    return term


def loss_normaliser(batch, config: Objective):
    """What the aggregation divides by, besides its own counts: the response length for
    "seq_mean_token_sum_norm" (`loss_norm_length`, else the batch's width); the rollout's
    real tokens per mini-batch for "token_sum_batch_norm" (`train_step` puts it in the
    batch as `loss_token_norm`)."""
    if config.loss_aggregation == "token_sum_batch_norm":
        return batch["loss_token_norm"][0]
    if (config.loss_aggregation == "seq_mean_token_sum_norm" and config.loss_norm_length is None
            and config.common_prefix is True):  # refused while tracing, before anything compiles
        raise invalid("LossConfig", "loss_norm_length", None,
                      "the response length (an int > 0) with loss_aggregation='seq_mean_token_sum_norm' and "
                      "common_prefix=True: the layout's response region also holds the rest of each prompt, so its "
                      "width is not the response length the aggregation divides by (the trainer sets it itself)")
    return config.loss_norm_length or batch["response_tokens"].shape[1]


def token_count(batch):
    """Real response tokens of a (micro-)batch: the token-mean loss's weight."""
    return jnp.sum(batch["response_mask"].astype(jnp.float32))


def micro_batch_weight(config: Objective):
    """How micro-batches are weighted under gradient accumulation, so that they add up to
    exactly the whole mini-batch's loss: by real tokens for a token mean; equally (they
    hold equal numbers of completions) for the per-completion means."""
    return token_count if objective(config).loss_aggregation == "token_mean" else None


def loss_for(apply_fn, config):
    """`total_loss` with `apply_fn` and the `Objective` of `config` bound: one function object
    per pair, so the loop's static argument is the same object on every call and nothing
    is traced twice."""
    return _bound_loss(apply_fn, objective(config))


@functools.lru_cache(maxsize=None)
def _bound_loss(apply_fn, config: Objective):
    return functools.partial(total_loss, apply_fn=apply_fn, config=config)
