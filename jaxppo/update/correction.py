"""The behaviour policy: the sampler's own log-probs against the trainer's, and the
correction of the policy loss for the mismatch between them.

The sampler (the built-in KV-cache sampler, bf16 or f32; later another engine) draws the
response tokens from its distribution pi_sampler; the loss's old log-probs come from the
trainer's forward pass, pi_old. They are the same policy, but not the same numbers: with
another engine or lower precision they differ, and treating the samples as drawn from
pi_old biases the gradient. The importance ratio pi_old / pi_sampler corrects it:

  token_truncate     w_t = min(r_t, C)                 r_t = exp(old_t - sampler_t)
  token_mask         w_t = 1[1/C <= r_t <= C]
  sequence_truncate  w   = min(R, C)                   R = exp(sum_t (old_t - sampler_t)), per completion
  sequence_mask      w   = 1[1/C <= R <= C]
  none               w   = 1

The weights multiply the policy loss per token (constants: no gradient flows through them).
Pure functions on arrays; imports only the masked statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxppo.update.stats import masked_mean

__all__ = ["ROLLOUT_CORRECTIONS", "correction_weights", "mismatch_metrics"]

ROLLOUT_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def correction_weights(logprobs, sampler_logprobs, mask, mode: str = "token_truncate", cap: float = 2.0):
    """(B, R) float32 weights of the policy loss for the sampler/trainer mismatch (see the
    module's table), 0 at padding. `logprobs`: the trainer's (the loss's old log-probs),
    `sampler_logprobs`: the sampler's, both of the sampled tokens, (B, R); `cap` C > 1."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction {mode!r} is invalid; valid: {', '.join(ROLLOUT_CORRECTIONS)}")
    mask = mask.astype(jnp.float32)
    log_ratio = jnp.where(mask > 0, logprobs.astype(jnp.float32) - sampler_logprobs.astype(jnp.float32), 0.0)
    if mode == "none":
        return mask
    if mode.startswith("sequence"):
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=1, keepdims=True), log_ratio.shape)
    ratio = jnp.exp(log_ratio)
    if mode.endswith("truncate"):
        weights = jnp.minimum(ratio, cap)
    else:
        weights = ((ratio >= 1.0 / cap) & (ratio <= cap)).astype(jnp.float32)
    return jax.lax.stop_gradient(weights * mask)


def mismatch_metrics(logprobs, sampler_logprobs, mask) -> dict:
    """How far the sampler's log-probs are from the trainer's, over real response tokens
    (TRL's names): sampling/sampling_logp_difference/mean and /max (|sampler - trainer|),
    sampling/importance_sampling_ratio/min, /mean and /max (exp(trainer - sampler) per
    token)."""
    mask = mask.astype(jnp.float32)
    real = mask > 0
    diff = logprobs.astype(jnp.float32) - sampler_logprobs.astype(jnp.float32)
    ratio = jnp.exp(jnp.where(real, diff, 0.0))
    some = jnp.any(real)  # a batch without real tokens reports ratio 1 and difference 0
    return {
        "sampling/sampling_logp_difference/mean": masked_mean(jnp.abs(diff), mask),
        "sampling/sampling_logp_difference/max": jnp.max(jnp.where(real, jnp.abs(diff), 0.0)),
        "sampling/importance_sampling_ratio/min": jnp.where(some, jnp.min(jnp.where(real, ratio, jnp.inf)), 1.0),
        "sampling/importance_sampling_ratio/mean": masked_mean(ratio, mask),
        "sampling/importance_sampling_ratio/max": jnp.where(some, jnp.max(jnp.where(real, ratio, -jnp.inf)), 1.0),
    }
