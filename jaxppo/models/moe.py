"""The sparse mixture-of-experts feed-forward layer of the Qwen3-MoE and Mixtral families:
a router picks each token's top k of E experts (gated MLPs of `moe_intermediate_size`),
and the token's output is the experts' outputs weighted by the router's probabilities.

Routing, as the checkpoints state it: router logits = x @ W_router (E,), probabilities =
softmax over the experts in float32, the top k kept, renormalised to sum to one where
`norm_topk_prob` (always for Mixtral; as config.json says for Qwen3-MoE).

The experts run as grouped matrix products (`jax.lax.ragged_dot`): the (token, expert)
pairs are sorted by expert, each expert multiplies its own contiguous group of rows, and
the results are put back in token order and summed. No capacity: every pair is computed,
none is dropped, whatever the balance. XLA:TPU runs `ragged_dot` as a grouped kernel (the
work of the k chosen experts per token); XLA:CPU expands it into a dense product over all
E experts per row (E/k times the work: `docs/models.md`), which is correct but slow.

Parameters (names mirror Hugging Face's modules, so conversion is a renaming):
`gate/kernel` (D, E) the router, and `experts/gate_proj`, `experts/up_proj` (E, D, I),
`experts/down_proj` (E, I, D): the experts' kernels stacked on a leading expert axis,
each (in, out) as a Flax kernel (Hugging Face stores one (out, in) tensor per expert).

The layer records its routing where asked: `sow`s the chosen experts (..., k) int32 and
the router's probabilities into the "router" collection (`Model.router_stats` reads
them), from which the load-balancing loss and the routing statistics are computed.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo.models.transformer import activation

__all__ = ["SparseMoe", "route", "experts_forward", "load_balancing_loss", "EXPERT_PROJECTIONS"]

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def route(logits, k: int, normalise: bool):
    """Top-k routing of router logits (..., E): (weights (..., k) float32, experts
    (..., k) int32, probabilities (..., E) float32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32), probs


def experts_forward(x, experts, weights, wg, wu, wd, act: str):
    """The experts' outputs for tokens x (N, D), each routed to `experts` (N, k) with
    `weights` (N, k): sum_j weights[n, j] * down(act(gate(x_n)) * up(x_n)) of expert
    experts[n, j]. Kernels wg/wu (E, D, I), wd (E, I, D)."""
    n, k = experts.shape
    num_experts = wg.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the (token, slot) pairs grouped by expert
    rows = x[order // k]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    g = jax.lax.ragged_dot(rows, wg, sizes)
    u = jax.lax.ragged_dot(rows, wu, sizes)
    y = jax.lax.ragged_dot(activation(act)(g) * u, wd, sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    back = jnp.argsort(order)  # each pair's place in the sorted order
    return jnp.sum(y[back].reshape(n, k, -1), axis=1, dtype=jnp.float32).astype(x.dtype)


def load_balancing_loss(probs, experts, mask=None):
    """The Switch-Transformer load-balancing loss of one layer, as Hugging Face computes
    it for Mixtral and Qwen3-MoE: E * sum_e f_e * p_e, where f_e is the share of the
    (token, slot) pairs routed to expert e and p_e the mean router probability of e, both
    over the tokens where `mask` (the same leading shape as `experts` without k) is 1.
    probs (..., E) float32, experts (..., k) int32."""
    num_experts = probs.shape[-1]
    chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # (..., k, E)
    if mask is None:
        mask = jnp.ones(experts.shape[:-1], jnp.float32)
    mask = mask.astype(jnp.float32)
    tokens = jnp.maximum(jnp.sum(mask), 1.0)
    share = jnp.sum(chosen * mask[..., None, None], axis=tuple(range(chosen.ndim - 2))) / tokens  # (k, E)
    mean_prob = jnp.sum(probs * mask[..., None], axis=tuple(range(probs.ndim - 1))) / tokens  # (E,)
    return num_experts * jnp.sum(share * mean_prob[None, :])


class _Experts(nn.Module):
    """The experts' stacked kernels, initialised as `nn.Dense` initialises each of them."""

    num_experts: int
    hidden: int
    intermediate: int
    param_dtype: Any

    @nn.compact
    def __call__(self):
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        e, d, i = self.num_experts, self.hidden, self.intermediate
        return (self.param("gate_proj", init, (e, d, i), self.param_dtype),
                self.param("up_proj", init, (e, d, i), self.param_dtype),
                self.param("down_proj", init, (e, i, d), self.param_dtype))


class SparseMoe(nn.Module):
    """The mixture-of-experts feed-forward layer of a block (see the module docstring)."""

    config: Any
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        c = self.config
        lead, d = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, d)
        logits = nn.Dense(c.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype,
                          name="gate")(tokens)
        weights, experts, probs = route(logits, c.num_experts_per_tok, c.norm_topk_prob)
        if not self.is_initializing():  # recorded only where asked (a mutable "router" collection)
            self.sow("router", "chosen", experts.reshape(*lead, -1))
            self.sow("router", "probs", probs.reshape(*lead, -1))
        wg, wu, wd = _Experts(c.num_experts, d, c.moe_intermediate_size, self.param_dtype, name="experts")()
        out = experts_forward(tokens.astype(self.dtype), experts, weights, wg.astype(self.dtype),
                              wu.astype(self.dtype), wd.astype(self.dtype), c.activation)
        return out.reshape(*lead, d)
