"""Random rollouts for the benchmarks that time the update (the numbers are noise of the
right shapes: what is timed does not depend on them)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import jaxppo


def random_rollout(rng, query_tokens, pads, lengths, response_length: int, vocab: int, ref_logprobs: bool = False):
    """A `jaxppo.RolloutBatch` of the given prompts (query_tokens (B, Q), left padding `pads`
    (B, 1)) with random responses of `lengths` (B, 1) tokens, log-probs near uniform,
    0/1 scores and, when asked, reference log-probs; drawn from `rng` after the prompts."""
    b, q = query_tokens.shape
    mask = np.arange(response_length)[None] < lengths
    noisy = lambda: jnp.asarray(-np.log(vocab) + 0.1 * rng.normal(size=(b, response_length)) * mask, jnp.float32)
    response_tokens = jnp.asarray(rng.integers(0, vocab, (b, response_length)) * mask, jnp.int32)
    logprobs = noisy()
    ref = noisy() if ref_logprobs else None
    return jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(query_tokens, jnp.int32),
        query_mask=jnp.asarray(np.arange(q)[None] >= pads, jnp.int32),
        response_tokens=response_tokens,
        response_mask=jnp.asarray(mask, jnp.int32),
        logprobs=logprobs,
        values=None,
        rewards=jnp.zeros((b, response_length), jnp.float32),
        ref_logprobs=ref,
        scores=jnp.asarray(rng.integers(0, 2, b), jnp.float32),
    )
