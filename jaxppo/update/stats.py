"""Masked statistics: sums, means, variances and whitening over the entries a mask selects.

A leaf of the package (it imports nothing from jaxppo): the math, the estimators and the
losses all count real tokens through these. `mask` is 1 (or True) at the entries that
count and 0 elsewhere; entries outside the mask are never read into a result, so a NaN or
inf there does not leak.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten", "masked_quantile", "RunningMoments",
           "running_moments_update"]


def masked_sum(x, mask, axis=None):
    """Sum of x where mask is set, over `axis` (all axes when None). Entries outside the
    mask are never read into the sum (a NaN or inf there does not leak)."""
    return jnp.sum(jnp.where(mask.astype(bool), x, jnp.zeros_like(x)), axis=axis)


def masked_mean(x, mask, axis=None):
    """masked_sum(x) / sum(mask) over `axis`; 0 where the mask is empty (no NaN)."""
    count = jnp.sum(mask.astype(x.dtype), axis=axis)
    return masked_sum(x, mask, axis=axis) / jnp.maximum(count, 1.0)


def masked_var(x, mask, unbiased: bool = True):
    """Variance of the masked entries of `x` (all axes).

    var = mean_m((x - mean_m(x))^2), times n / (n - 1) (Bessel) when `unbiased`, where
    n = sum(mask). With n <= 1 the Bessel factor is skipped (the variance is then 0).
    """
    mask = mask.astype(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_mean(jnp.square(x - mean), mask)
    if unbiased:
        n = jnp.sum(mask)
        var = jnp.where(n > 1, var * n / jnp.maximum(n - 1.0, 1.0), var)
    return var


def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / sqrt(var + eps) with mean and (unbiased) variance over masked entries.

    With `shift_mean=False` the mean is added back: only the scale changes (used for
    rewards, whose sign carries meaning). Masked-out entries are returned as 0.
    """
    mask = mask.astype(x.dtype)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    white = (x - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return white * mask


def masked_quantile(x, mask, q: float):
    """The q-quantile (0 <= q <= 1) of the masked entries of `x` (all axes), interpolated
    linearly between the two nearest order statistics (numpy's and torch's default
    "linear" rule). 0 when the mask is empty."""
    flat = x.reshape(-1).astype(jnp.float32)
    keep = mask.reshape(-1).astype(bool)
    n = jnp.sum(keep.astype(jnp.int32))
    ordered = jnp.sort(jnp.where(keep, flat, jnp.inf))  # the n real entries first, ascending
    last = jnp.maximum(n - 1, 0)
    position = q * last.astype(jnp.float32)
    below = jnp.floor(position).astype(jnp.int32)
    above = jnp.minimum(below + 1, last)
    frac = position - below.astype(jnp.float32)
    value = ordered[below] + frac * (ordered[above] - ordered[below])
    return jnp.where(n > 0, value, 0.0)


class RunningMoments(NamedTuple):
    """Running mean, variance (population) and count of a scalar stream."""

    mean: jax.Array
    var: jax.Array
    count: jax.Array

    @classmethod
    def zeros(cls) -> "RunningMoments":
        return cls(jnp.float32(0.0), jnp.float32(1.0), jnp.float32(0.0))


def running_moments_update(state: RunningMoments, x) -> RunningMoments:
    """Merge a batch `x` (any shape) into the running moments (Chan et al. parallel update)."""
    x = x.astype(jnp.float32).ravel()
    n = jnp.float32(x.size)
    batch_mean = jnp.mean(x)
    batch_var = jnp.var(x)
    total = state.count + n
    delta = batch_mean - state.mean
    mean = state.mean + delta * n / total
    m2 = state.var * state.count + batch_var * n + jnp.square(delta) * state.count * n / total
    return RunningMoments(mean, m2 / total, total)
