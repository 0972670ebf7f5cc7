"""The `RolloutBatch` pytree that the rollout layer produces and `train_step` consumes, and the
one forward that scores a rollout's responses (shared by rollout collection and the loss,
so that both compute the same log-probs). Depends on the math layer only."""

from __future__ import annotations

from typing import Any, Optional


import flax.struct
import jax
import jax.numpy as jnp

from jaxppo.models.model import join_sequences
from jaxppo.update.losses import entropy_from_logits, logprobs_from_logits

__all__ = ["RolloutBatch", "response_outputs", "routed_outputs", "teacher_outputs", "scorer", "model_method",
           "joined", "response_attention", "queries"]


class RolloutBatch(flax.struct.PyTreeNode):
    """One batch of B rollouts (prompt, sampled response, what scoring them computed), fixed
    shapes: what `train_step` consumes. Q = prompt length, R = response length. Named
    `Rollout` before 0.5 (that name still works, with a DeprecationWarning, until 0.6).

    Attributes:
      query_tokens: int (B, Q), prompts, left-padded.
      query_mask: (B, Q), 1 at real prompt tokens, 0 at left padding.
      response_tokens: int (B, R), sampled responses, padded after the stop token.
      response_mask: (B, R), 1 at the response tokens the policy produced (up to and
        including the stop token), 0 after: a prefix of ones per row. In a multi-turn
        episode it is 0 at the environment's tokens too (see `response_attention_mask`):
        only the policy's tokens get loss, KL, entropy and value targets.
      logprobs: float (B, R), log-probs of the response tokens under the sampling policy,
        from temperature-scaled logits (`config.temperature`).
      values: float (B, R), the critic's values at sampling time, V(s_t) before token t;
        None (or any array, unread) for the critic-free algorithms.
      rewards: float (B, R), per-token rewards: typically -beta * KL(policy || reference)
        per token, with the sequence score added at the last real response token (the
        rollout layer builds these). GAE and REINFORCE++ read these.
      ref_logprobs: float (B, R) or None: the reference policy's log-probs of the response
        tokens, needed only for a KL term in the loss (`KLConfig.kl_loss_coef` > 0).
      scores: float (B,) or None: each completion's sequence score, the sum of its
        `rewards` (the score plus any per-token KL penalty), which the group estimators
        (GRPO, RLOO, the REINFORCE++ baseline) read. None: they sum `rewards` themselves.
      sampler_logprobs: float (B, R) or None: the log-probs of the response tokens as the
        sampler computed them while generating (the behaviour policy), temperature-scaled,
        0 at padding. The loss's old log-probs are `logprobs` (the forward pass); these
        are kept to measure or correct a mismatch between sampler and trainer.
      entropy_coef: float (B,) or None: the entropy bonus's coefficient for each
        completion, used instead of `config.ent_coef` when given (the trainer fills it
        with the adaptive coefficient when `LossConfig.entropy_target` is set).
      response_attention_mask: (B, R) or None: 1 at every real token of the response
        region, the policy's and the environment's (a multi-turn episode's observations),
        a prefix of ones; the sequence the policy conditions on. None: `response_mask`
        (one turn: every real response token is the policy's).
      teacher_top_logprobs: float (B, R, k) or None: on-policy distillation with
        `AdvantageConfig.distill_top_k` = k: the teacher's k largest log-probs at each
        response position (temperature-scaled like `logprobs`), largest first; the loss's
        divergence to the teacher reads them (`jaxppo.update.losses.top_k_divergence`).
      teacher_top_ids: int (B, R, k) or None: the token ids of `teacher_top_logprobs`.
      routing: int (B, Q + R, layers, k) or None: a mixture-of-experts policy's routing in
        the forward pass (the experts its router chose for every token of the row), which
        the update replays (`LossConfig.routing_replay`) or compares its own with (the
        metric `moe/routing_mismatch`); recorded in the plain layout.
      images: a vision-language policy's images of the prompts or None: an
        `jaxppo.models.vision.ImagePrompt` without its ids (`query_tokens` are they), every
        leaf leading with B: the pixel values processed once, which the forward pass and
        every update read (`queries`).
    """

    query_tokens: jax.Array
    query_mask: jax.Array
    response_tokens: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    values: Optional[jax.Array]
    rewards: jax.Array
    ref_logprobs: Optional[jax.Array] = None
    scores: Optional[jax.Array] = None
    sampler_logprobs: Optional[jax.Array] = None
    entropy_coef: Optional[jax.Array] = None
    response_attention_mask: Optional[jax.Array] = None
    teacher_top_logprobs: Optional[jax.Array] = None
    teacher_top_ids: Optional[jax.Array] = None
    routing: Optional[jax.Array] = None
    images: Optional[Any] = None


def queries(batch):
    """The batch's queries as a model takes them: `query_tokens`, or with images (a
    vision-language policy's) the `ImagePrompt` of the tokens and their images."""
    images = batch.get("images")
    return batch["query_tokens"] if images is None else images._replace(ids=batch["query_tokens"])


def _text_only(batch, what: str):
    if batch.get("images") is not None:
        raise ValueError(f"the rows have images, which {what} does not read: a vision-language policy scores through "
                         "a built-in Model (its response_outputs)")


def model_method(fn, name: str):
    """The method `name` that the model behind `fn` offers (`fn` itself, or the `Model`
    whose `apply` it is bound to), or None: how built-in models opt in to the protocols
    other models do not have (`scorer`, `jaxppo.update.packing.packer`)."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and getattr(fn, "__name__", "") == "apply":
        fn = owner  # a bound `Model.apply`
    method = getattr(fn, name, None)
    return method if callable(method) else None


def scorer(fn):
    """The `response_outputs(params, query_tokens, query_mask, response_tokens,
    response_mask, temperature) -> (logprobs, values, entropy)` method that `fn` offers, or
    None. Built-in models opt in this way (`jaxppo.models.Model`, `PolicyAndCritic`, also
    as a bound `model.apply`); they score without materialising (B, L, V) logits."""
    return model_method(fn, "response_outputs")


def response_attention(batch):
    """The response region's attention mask: `response_attention_mask` where the batch has
    one (a multi-turn episode), else `response_mask`."""
    mask = batch.get("response_attention_mask")
    return batch["response_mask"] if mask is None else mask


def joined(batch):
    """The batch's query + response tokens and attention mask, (B, Q + R) each."""
    return join_sequences(batch["query_tokens"], batch["query_mask"], batch["response_tokens"],
                          response_attention(batch))


def response_outputs(apply_fn, params, batch, temperature: float, group: int = 1, also=None):
    """Run the model on query + response; return the response tokens' log-probs,
    values and per-token entropies, each (B, R). The model attends to every real token of
    the response region (`response_attention`); the caller masks the outputs with
    `response_mask`.

    Models that offer `response_outputs` (the built-in ones, see `scorer`) apply the LM
    head at response positions only, in chunks when configured. Any other `apply_fn(params,
    tokens, mask) -> (logits (B, L, V), values (B, L))` works unchanged: its full logits are
    sliced at the response positions.

    `group` G > 1 says the rows come in groups of G consecutive rows with one prompt: a
    model that offers `grouped_outputs` (the built-in ones) then runs each group's prompt
    once (`jaxppo.models.Model.grouped_outputs`; equal outputs up to float rounding); any
    other runs every row.

    `also`: (B, R, m) more token ids per position whose log-probs come too: the log-probs
    are then (B, R, 1 + m), the response token's first (on-policy distillation's student at
    the teacher's top-k tokens, `AdvantageConfig.distill_top_k`)."""
    extra = {} if also is None else {"also": also}
    if group > 1:
        grouped = model_method(apply_fn, "grouped_outputs")
        if grouped is not None:
            return grouped(params, jax.tree.map(lambda x: x[::group], queries(batch)), batch["query_mask"][::group],
                           batch["response_tokens"], response_attention(batch), temperature, **extra)
    method = scorer(apply_fn)
    if method is not None:
        return method(params, queries(batch), batch["query_mask"], batch["response_tokens"],
                      response_attention(batch), temperature, **extra)
    _text_only(batch, f"{type(apply_fn).__name__} (an apply function without response_outputs)")
    logits, values = _response_logits(apply_fn(params, *joined(batch)), batch)
    if also is None:
        logprobs = logprobs_from_logits(logits, batch["response_tokens"], temperature)
    else:  # one log-softmax for the response token and the extra ids
        ids = jnp.concatenate([batch["response_tokens"][..., None], also], axis=-1).astype(jnp.int32)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        logprobs = jnp.take_along_axis(logp, ids, axis=-1)
    entropy = entropy_from_logits(logits, temperature)
    return logprobs, values.astype(jnp.float32), entropy


def routed_outputs(apply_fn, params, batch, temperature: float, replay=None, aux_loss: bool = False):
    """((log-probs, values, entropies), routing) of a mixture-of-experts model that offers
    `routed_outputs` (`jaxppo.models.Model.routed_outputs`, `PolicyAndCritic`'s): the
    response outputs and the routing of every token of the rows, from one forward; with
    `replay` (B, Q + R, layers, k) the forward computes with those experts."""
    _text_only(batch, "a mixture of experts' routed forward")
    method = model_method(apply_fn, "routed_outputs")
    if method is None:
        raise ValueError("the routing of a mixture of experts is read from a model that offers routed_outputs (the "
                         f"built-in Model and PolicyAndCritic); {type(apply_fn).__name__} does not")
    return method(params, batch["query_tokens"], batch["query_mask"], batch["response_tokens"],
                  response_attention(batch), temperature, replay=replay, aux_loss=aux_loss)


def _response_logits(outputs, batch):
    """An `apply_fn`'s full outputs (logits (B, L, V), and values (B, L) when a pair)
    sliced at the positions that predict the response tokens: position Q - 1 + t predicts
    response token t."""
    q, r = batch["query_tokens"].shape[1], batch["response_tokens"].shape[1]
    return jax.tree.map(lambda x: x[:, q - 1 : q - 1 + r], outputs)


def teacher_outputs(apply_fn, params, batch, k: int, temperature: float):
    """A frozen model's (log-probs (B, R) of the response tokens, the k largest log-probs
    (B, R, k) at each response position, their token ids (B, R, k)): on-policy
    distillation's teacher with `distill_top_k`. A built-in model runs its LM head at the
    response positions only (`Model.response_top_logprobs`); any `apply_fn(params, tokens,
    mask) -> logits (B, L, V)` is sliced there. Each row runs its own prompt."""
    _text_only(batch, "on-policy distillation's teacher (distill_top_k)")
    method = model_method(apply_fn, "response_top_logprobs")
    if method is not None:
        return method(params, batch["query_tokens"], batch["query_mask"], batch["response_tokens"],
                      response_attention(batch), k, temperature)
    logits = _response_logits(apply_fn(params, *joined(batch)), batch)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    taken = jnp.take_along_axis(logp, batch["response_tokens"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    return (taken,) + tuple(jax.lax.top_k(logp, k))



def __getattr__(name: str):  # the names renamed in 0.5, with a DeprecationWarning
    from jaxppo.deprecations import moved

    return moved(__name__, name)
