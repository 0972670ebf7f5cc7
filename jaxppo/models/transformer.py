"""Flax (linen) causal transformers: the trunk, the LM and score modules, and the building
blocks a model family's block is made of (rotary embeddings, attention over a KV cache,
RMSNorm, LoRA-aware dense layers). The blocks themselves, and how a trunk embeds tokens
and normalises, belong to the families (`jaxppo.models.families`: GPT-2, the Llama family,
Gemma 3), found by `model_type` (`jaxppo.models.family`).

Parameter names mirror Hugging Face's module names (`model.layers_0.self_attn.q_proj`,
`transformer.h_0.attn.c_attn`, ...), so checkpoint conversion is a renaming plus, for
PyTorch `Linear` weights, a transpose.

All modules take
  input_ids (B, Lq) int, attention_mask (B, Lk) {0, 1} over the key slots,
  positions (B, Lq) int (position ids of the query tokens),
  cache: None, or a tuple per layer of (k, v), each (B, Lmax, num_kv_heads, head_dim),
  cache_index: slot of the first query token in the cache: a scalar (every row), or (B,)
    int, one slot per row (rows at different points of their sequences, as a
    continuous sampler decodes them),
  segment_ids: None, or (B, L) int without a cache: packed sequences, several rows laid
    end to end in one stream; a token attends only to earlier tokens of its own segment
    (positions then restart per segment: the caller passes them).
Without a cache Lk = Lq and the query tokens are slots 0..Lq-1. Attention is causal over
slots and ignores keys whose attention_mask is 0 (left padding, finished rows).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional
import numpy as np

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.context import (balanced_order, context_attention, context_method, context_size, in_order,
                                   shard_positions)
from jaxppo.models.family import family_of
from jaxppo.models.heads import softcap
from jaxppo.models.lora import LoraConfig, LoraDense

__all__ = ["Transformer", "CausalLMModule", "ScoreModule", "rope_inv_freq", "default_positions", "ATTENTION",
           "GroupedKV", "NewKV", "apply_rope", "activation", "attend", "attend_with_cache", "dense", "RMSNorm",
           "write_slots"]

# How attention over a whole sequence is computed (training, scoring, the prefill):
# "einsum", jaxppo's own two einsums around a float32 softmax (the default); "xla" and
# "cudnn", `jax.nn.dot_product_attention` with that implementation ("cudnn": cuDNN's fused
# flash attention on NVIDIA GPUs, for bfloat16/float16 compute). A decode step (one query
# token per row, over the KV cache) always uses "einsum".
ATTENTION = ("einsum", "xla", "cudnn")


def default_positions(attention_mask):
    """Position ids that count real tokens only: cumsum(mask) - 1, clipped at 0. With left
    padding the first real token gets position 0, as Hugging Face's `generate` does."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def rope_inv_freq(config: ModelConfig, local: bool = False):
    """Inverse frequencies (head_dim // 2,) of rotary embeddings, with rope scaling applied;
    `local`: those of the sliding-window layers (`local_rope_theta`, no scaling)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if local:
        return inv_freq
    params = config.rope_params
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = jnp.where(medium, blended, scaled)
    return inv_freq


def apply_rope(x, positions, inv_freq, axes=None):
    """Rotary embeddings on x (B, L, H, D) at `positions` (B, L) with `inv_freq` (D/2,)
    (`rope_inv_freq`): pairs (i, i + D/2) rotated, as Hugging Face's rotate_half does.

    Multimodal rotary positions (Qwen-VL's M-RoPE): `positions` (B, L, 3), a (temporal,
    height, width) position per token, and `axes` (D/2 of 0, 1, 2: the config's
    `mrope_axes`), the position each frequency turns with: in sections (Qwen2.5-VL: the
    first frequencies with the temporal position, the next with the height, the rest with
    the width) or interleaved (Qwen3-VL). Text tokens have three equal positions, where
    this is the rotation of (B, L) positions."""
    if positions.ndim == 3:
        if axes is None or len(axes) != inv_freq.shape[0]:
            raise ValueError(f"3-D rotary positions need mrope sections summing to {inv_freq.shape[0]}; got "
                             f"{None if axes is None else len(axes)} frequencies")
        freqs = positions[..., np.asarray(axes)].astype(jnp.float32) * inv_freq  # (B, L, D/2)
    else:
        freqs = positions[..., None].astype(jnp.float32) * inv_freq  # (B, L, D/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _attention(q, k, v, mask, dtype, scale_dim=None, impl="einsum"):
    """q (B, Lq, H, D), k/v (B, Lk, KV, D), mask (B, Lq, Lk) bool -> (B, Lq, H * D).
    Scores are scaled by 1 / sqrt(scale_dim or D). `impl`: see `ATTENTION` (one query token
    always takes "einsum")."""
    if impl == "einsum" or q.shape[1] == 1:
        return _attention_over(q, ((k, v, mask),), dtype, scale_dim)
    b, lq, h, d = q.shape
    q = q.astype(dtype)
    out = jax.nn.dot_product_attention(q, k.astype(dtype), v.astype(dtype), mask=mask[:, None],
                                       scale=1.0 / math.sqrt(scale_dim or d), implementation=impl)
    return out.reshape(b, lq, h * d)


def _attention_over(q, parts, dtype, scale_dim=None):
    """Attention of q (B, Lq, H, D) over the keys of several parts, each (k, v, mask) with
    k/v (B, Lk_i, KV, D) and mask (B, Lq, Lk_i): one softmax over all of them, as if the
    parts were concatenated on the key axis (without copying them together). A part may be
    (k, v, mask, G) with k/v (B/G, Lk_i, KV, D) and mask (B/G, Lq, Lk_i), shared by each
    group of G consecutive rows: its keys are read once per group, not once per row."""
    b, lq, h, d = q.shape
    kv = parts[0][0].shape[2]
    scale = math.sqrt(scale_dim or d)
    q = q.reshape(b, lq, kv, h // kv, d)
    scores = []
    for k, _, mask, *groups in parts:
        if groups:  # the rows of a group as one block of queries against the group's keys
            g = groups[0]
            qg = q.reshape(b // g, g, lq, kv, h // kv, d)
            s = jnp.einsum("bjqkhd,bskd->bjkhqs", qg, k, preferred_element_type=jnp.float32) / scale
            s = jnp.where(mask[:, None, None, None], s, jnp.finfo(jnp.float32).min)
            scores.append(s.reshape(b, kv, h // kv, lq, k.shape[1]))
        else:
            s = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / scale
            scores.append(jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min))
    if len(parts) == 1:
        probs = jax.nn.softmax(scores[0], axis=-1).astype(dtype)
        return jnp.einsum("bkgqs,bskd->bqkgd", probs, parts[0][1]).reshape(b, lq, h * d)
    # One softmax over every part's keys: a shared max, each part's exponentials, one sum.
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
    exps = [jnp.exp(s - top) for s in scores]
    total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
    out = 0
    for e, (_, v, _, *groups) in zip(exps, parts):
        probs = (e / total).astype(dtype)
        if groups:
            g = groups[0]
            probs = probs.reshape(b // g, g, kv, h // kv, lq, v.shape[1])
            out = out + jnp.einsum("bjkhqs,bskd->bjqkhd", probs, v).reshape(b, lq, kv, h // kv, d)
        else:
            out = out + jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, lq, h * d)


def activation(name):
    """The activation function of a Hugging Face `hidden_act` name (`ModelConfig.activation`)."""
    return {
        "gelu_new": lambda x: nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
        "gelu": lambda x: nn.gelu(x, approximate=False),
        "relu": nn.relu,
        "silu": nn.silu,
    }[name]


class RMSNorm(nn.Module):
    """RMSNorm over the last axis. `plus_one` (Gemma): the weight is stored as an offset
    from 1 (initialised at zero) and the product is taken in float32, as Hugging Face's
    Gemma3RMSNorm does; otherwise (Llama) the normalised input is cast first."""

    eps: float
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    plus_one: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(self.dtype)
        return weight.astype(self.dtype) * x32.astype(self.dtype)


class NewKV(NamedTuple):
    """A layer's cache under the layer scan: the old (k, v) slice, read only. The block
    attends over it and over the new tokens' k/v separately and returns only the new k/v;
    `Transformer` writes them into the stacked cache after the scan. (Returning the whole
    updated slice would make the scan write out a full copy of the cache at every decode
    step.)"""

    k: jax.Array
    v: jax.Array


class GroupedKV(NamedTuple):
    """A layer's cache when rows come in groups of G consecutive rows with one prompt
    (`generate(..., num_generations=G)`): the prompt's slots once per group, `prefix_k` /
    `prefix_v` (B/G, P, KV, D), and each row's own response slots, `k` / `v` (B, R, KV, D);
    the cache's slot s < P is a prompt slot, s >= P response slot s - P. Under the layer
    scan each leaf leads with the layer axis. A decode step reads each group's prompt keys
    and values once for its G rows (`_attention_over`'s grouped part), not once per row.
    Blocks treat it as read only and return the new tokens' k/v, which `Transformer`
    writes into the response slots."""

    prefix_k: jax.Array
    prefix_v: jax.Array
    k: jax.Array
    v: jax.Array


def attend(q, k, v, mask, dtype, scale_dim=None, impl="einsum", context="auto"):
    """Attention over whole rows (no cache): q (B, L, H, D), k/v (B, L, KV, D), mask
    (B, L, L) -> (B, L, H * D), by the kernel `impl` (see `ATTENTION`). Under a mesh with a
    "context" axis, each row's positions are split over it and attention runs across the
    split by `context` ("auto", "ring" or "ulysses": `jaxppo.models.context`)."""
    n = context_size()
    if n > 1 and q.shape[1] > 1:
        return context_attention(q, k, v, mask, dtype, scale_dim, functools.partial(_attention, impl=impl),
                                 context_method(context, impl, q.shape[2], n))
    return _attention(q, k, v, mask, dtype, scale_dim, impl)


def attend_with_cache(q, k, v, layer_cache, cache_index, mask, dtype, scale_dim=None, impl="einsum"):
    """Attention of the new tokens' q/k/v (B, Lq, ...), given a layer's cache:
    None (no cache: attend over k/v), a (k, v) pair of buffers (write the new k/v at slot
    `cache_index` and attend over the buffers; returns them), or a `NewKV` (attend over
    the old slots before `cache_index` and the new tokens; returns the new k/v only), or a
    `GroupedKV` (attend over the group's prompt slots, the row's earlier response slots and
    the new tokens; returns the new k/v only).
    mask (B, Lq, Lk) is over the cache's slots (or over k/v without a cache: `attend`,
    across a context axis by its "auto" method).
    Returns (out (B, Lq, H * D), what goes back into the cache)."""
    if layer_cache is None:
        return attend(q, k, v, mask, dtype, scale_dim, impl), None
    if isinstance(layer_cache, GroupedKV):
        p, lq = layer_cache.prefix_k.shape[1], q.shape[1]
        g = q.shape[0] // layer_cache.prefix_k.shape[0]
        response = mask[:, :, p:]  # the rows' response slots
        new = _slice_slots(response, cache_index - p, lq)
        k, v = k.astype(layer_cache.k.dtype), v.astype(layer_cache.v.dtype)
        # A group's rows see the same prompt slots: its first row's mask stands for all.
        parts = ((layer_cache.prefix_k, layer_cache.prefix_v, mask[::g, :, :p], g),)
        if layer_cache.k.shape[1]:  # earlier response slots (none in a one-pass forward: `Model.grouped_outputs`)
            old = response & (jnp.arange(response.shape[-1])[None, None, :] < _per_row(cache_index - p))
            parts += ((layer_cache.k, layer_cache.v, old),)
        return _attention_over(q, parts + ((k, v, new),), dtype, scale_dim), (k, v)
    if isinstance(layer_cache, NewKV):
        lk, lq = mask.shape[-1], q.shape[1]
        old = mask & (jnp.arange(lk)[None, None, :] < _per_row(cache_index))
        new = _slice_slots(mask, cache_index, lq)
        k, v = k.astype(layer_cache.k.dtype), v.astype(layer_cache.v.dtype)
        if isinstance(cache_index, int) and cache_index == 0:  # a prefill: no old slots to attend to
            return _attention(q, k, v, new, dtype, scale_dim, impl), (k, v)
        out = _attention_over(q, ((layer_cache.k, layer_cache.v, old), (k, v, new)), dtype, scale_dim)
        return out, (k, v)
    k, v = (write_slots(layer_cache[0], k, cache_index, axis=1), write_slots(layer_cache[1], v, cache_index, axis=1))
    return _attention(q, k, v, mask, dtype, scale_dim, impl), (k, v)


def _write_response(cache: GroupedKV, new_kv, cache_index, axis):
    """`cache` with the new tokens' (k, v) written at their response slots (cache slot
    `cache_index` is response slot cache_index - P; `axis` is the slot axis)."""
    p = cache.prefix_k.shape[axis]
    if cache.k.shape[axis] == 0:  # no response slots kept (a one-pass forward): nothing to write
        return cache
    k, v = (write_slots(buf, new, cache_index - p, axis=axis) for buf, new in zip((cache.k, cache.v), new_kv))
    return cache._replace(k=k, v=v)


def _per_row(cache_index):
    """The cache index broadcastable against (B, Lq, Lk): a scalar, or (B, 1, 1)."""
    return cache_index[:, None, None] if jnp.ndim(cache_index) == 1 else cache_index


def _slice_slots(mask, cache_index, length):
    """mask (B, Lq, Lk) at slots cache_index ... cache_index + length - 1: (B, Lq, length)."""
    if jnp.ndim(cache_index) == 1:
        return jax.vmap(lambda m, i: jax.lax.dynamic_slice_in_dim(m, i, length, axis=1))(mask, cache_index)
    return jax.lax.dynamic_slice_in_dim(mask, cache_index, length, axis=2)


def write_slots(buf, new, cache_index, axis):
    """`new` written into the cache buffer `buf` along its slot `axis`, starting at
    `cache_index` (a scalar, or (B,): each row at its own slot; the batch axis is the one
    before `axis`)."""
    new = new.astype(buf.dtype)
    if jnp.ndim(cache_index) == 1:
        write = lambda b, n, i: jax.lax.dynamic_update_slice_in_dim(b, n, i, axis=axis - 1)
        return jax.vmap(write, in_axes=(axis - 1, axis - 1, 0), out_axes=axis - 1)(buf, new, cache_index)
    return jax.lax.dynamic_update_slice_in_dim(buf, new, cache_index, axis=axis)


def dense(block, features, use_bias, name):
    """The block's linear layer `name`: `nn.Dense`, or `LoraDense` when LoRA targets it
    (`block` is the calling block module: its config, dtypes, `lora` and `adapters`)."""
    lora = block.lora
    if lora is not None and name in lora.modules(block.config):
        return LoraDense(features, use_bias, block.dtype, block.param_dtype, lora.rank, lora.scale, block.adapters,
                         name=name)
    return nn.Dense(features, use_bias=use_bias, dtype=block.dtype, param_dtype=block.param_dtype, name=name)


def _masks(c: ModelConfig, lq: int, attention_mask, cache_index, segment_ids, blocks, order=None):
    """(mask, sliding layers' mask or None), each (1 or B, Lq, Lk): what the Lq query tokens
    at cache slot `cache_index` on (a scalar, or (B,)) attend to among the Lk slots of
    `attention_mask`: the earlier real slots and their own (causal); within their own
    segment (packed rows, `segment_ids`); an image's tokens all of that image's (`blocks`);
    in the sliding layers only the last `sliding_window` slots. `order`: a whole forward
    pass whose positions (and `attention_mask`, `segment_ids`, `blocks`) come in this order
    of their slots (`jaxppo.models.context.balanced_order`), queries and keys alike."""
    lk = attention_mask.shape[1]
    # The query tokens' slots, (1, Lq) or per row (B, Lq), and the keys'.
    query_slots = (cache_index[:, None] if jnp.ndim(cache_index) == 1 else jnp.asarray(cache_index)[None, None]
                   ) + jnp.arange(lq)[None, :]
    key_slots = jnp.arange(lk)
    if order is not None:
        query_slots, key_slots = jnp.asarray(order)[None, :], jnp.asarray(order)
    causal = key_slots[None, None, :] <= query_slots[:, :, None]  # (1 or B, Lq, Lk)
    if blocks is not None:  # an image's tokens attend to each other both ways (Gemma 3)
        causal = causal | (_same_image(blocks, query_slots, lk) if order is None else  # a whole pass: queries are keys
                           (blocks[:, :, None] >= 0) & (blocks[:, :, None] == blocks[:, None, :]))
    mask = causal & attention_mask.astype(bool)[:, None, :]
    if segment_ids is not None:  # packed rows: a token attends within its own segment only
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if not any(c.sliding_layers):
        return mask, None
    in_window = key_slots[None, None, :] > query_slots[:, :, None] - c.sliding_window  # q - window < s
    return mask, mask & in_window


def _same_image(blocks, query_slots, lk: int):
    """(B, Lq, Lk): query and key are tokens of one image. `blocks` (B, Lq) is each query
    token's image (-1 for text), the queries at cache slots `query_slots` (1 or B, Lq); a
    key slot that is none of these queries' (an earlier call's) is text to them."""
    b, lq = blocks.shape
    index = jnp.arange(lk)[None, :] - query_slots[:, :1]  # the query each key slot is, if any
    key = jnp.take_along_axis(jnp.broadcast_to(blocks, (b, lq)), jnp.clip(jnp.broadcast_to(index, (b, lk)), 0, lq - 1),
                              axis=1)
    key = jnp.where((index >= 0) & (index < lq), key, -1)
    return (blocks[:, :, None] >= 0) & (blocks[:, :, None] == key[:, None, :])


@functools.lru_cache(maxsize=None)
def _deepstacked(block_cls):
    """`block_cls` taking two more arguments in a scan over the layers: DeepStack's additions
    (K, B, L, D) and the layer's index, the addition of index i < K added to its output
    (Qwen3-VL); the same parameters and names."""

    class Deepstacked(block_cls):
        def __call__(self, x, masks, positions, layer_cache, cache_index, sliding, deep, index):
            x, new_kv = super().__call__(x, masks, positions, layer_cache, cache_index, sliding)
            k = deep.shape[0]
            added = jnp.where(index < k, deep[jnp.minimum(index, k - 1)], 0).astype(x.dtype)
            return x + added, new_kv

    Deepstacked.__name__ = block_cls.__name__
    return Deepstacked


class Transformer(nn.Module):
    """The trunk: embeddings, blocks, final norm (each as the model's family makes them).

    With `scan_layers` the blocks' parameters are stacked on a leading layer axis (one
    `layers` / `h` module instead of `layers_0` ... `layers_{n-1}`) and the blocks run as
    one `nn.scan`, so the compiled program does not grow with depth; the KV cache is then a
    single (k, v) pair with the same leading layer axis.

    Returns (hidden (B, Lq, hidden_size), new_cache or None, token embedding table)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: Any = False  # False, True, or a jax.checkpoint_policies name (see Model)
    scan_layers: bool = False
    lora: Optional[LoraConfig] = None  # adapters on the blocks' linear layers (see jaxppo.models.lora)
    adapters: bool = True  # with `lora`: apply them (False: the base model)
    attention: str = "einsum"  # see ATTENTION
    context_attention: str = "auto"  # see jaxppo.models.context

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions, cache=None, cache_index=0, segment_ids=None,
                 images=None):
        c = self.config
        family = family_of(c)
        x, table = family.embed(self, c, input_ids, positions)
        deep = blocks = None  # DeepStack's additions (K, B, Lq, D); each token's image (B, Lq), -1 for text
        if family.vision is not None:  # a vision-language model: the image tokens take the images' embeddings
            x, deep, blocks = family.vision(self, c, x, input_ids, images)
        order = None  # a whole forward pass: under a context axis, each row's positions split over it, in the
        if cache is None:  # balanced order of `jaxppo.models.context` (put back after the last layer)
            order = None if c.num_experts else balanced_order(input_ids.shape[1])
            if order is not None:
                x, positions, attention_mask, segment_ids, blocks = in_order(order[0], x, positions, attention_mask,
                                                                             segment_ids, blocks)
                (deep,) = in_order(order[0], deep, axis=2)
            x = shard_positions(x)
        masks = _masks(c, input_ids.shape[1], attention_mask, cache_index, segment_ids, blocks,
                       None if order is None else order[0])
        sliding = c.sliding_layers
        block_cls = family.block
        # A family's block may predate the context axis (the six fields before it): it is
        # given the method only where it has the field (its attention then takes "auto").
        context = {"context_attention": self.context_attention} if hasattr(block_cls, "context_attention") else {}
        if deep is not None and self.scan_layers:
            block_cls = _deepstacked(block_cls)
        if self.remat:
            policy = None if self.remat is True else getattr(jax.checkpoint_policies, self.remat)
            # prevent_cse=False is safe (and cheaper) inside a scan, where XLA cannot CSE
            # the recomputation away; unrolled blocks keep the default.
            block_cls = nn.remat(block_cls, policy=policy, prevent_cse=not self.scan_layers)
        prefix = family.layers_prefix
        if self.scan_layers:
            # Block call: (x, masks, positions, layer_cache, cache_index, sliding) -> (x, new k/v);
            # x is the carry; the cache (stacked on the layer axis, or None) and the per-layer
            # sliding flags are scanned over.
            # (the "router" collections are what a mixture of experts records, "replay" what it is given)
            axes = {"params": 0, "lora": 0, "router": 0, "router_probs": 0, "replay": 0}
            in_axes = (nn.broadcast, nn.broadcast, 0, nn.broadcast, 0)
            scanned = (jnp.asarray(sliding),)
            if deep is not None:  # each layer is given its index and DeepStack's additions
                in_axes, scanned = in_axes + (nn.broadcast, 0), scanned + (deep, jnp.arange(c.num_layers))
            stack = nn.scan(block_cls, variable_axes=axes, split_rngs={"params": True}, in_axes=in_axes,
                            length=c.num_layers)
            layer_cache = None if cache is None else cache if isinstance(cache, GroupedKV) else NewKV(*cache)
            x, new_kv = stack(c, self.dtype, self.param_dtype, self.lora, self.adapters, self.attention, **context,
                              name=prefix)(
                x, masks, positions, layer_cache, cache_index, *scanned)
            new_cache = None
            if isinstance(cache, GroupedKV):  # the new tokens' k/v into every layer's response slots
                new_cache = _write_response(cache, new_kv, cache_index, axis=2)
            elif cache is not None:  # the new tokens' k/v of every layer, written in place
                new_cache = tuple(write_slots(buf, new, cache_index, axis=2) for buf, new in zip(cache, new_kv))
        else:
            new_cache = []
            for i in range(c.num_layers):
                block = block_cls(c, self.dtype, self.param_dtype, self.lora, self.adapters, self.attention, **context,
                                  name=f"{prefix}_{i}")
                layer_cache = None if cache is None else cache[i]
                x, new_kv = block(x, masks, positions, layer_cache, cache_index, sliding[i])
                if deep is not None and i < deep.shape[0]:
                    x = x + deep[i].astype(x.dtype)
                if isinstance(layer_cache, GroupedKV):
                    new_kv = _write_response(layer_cache, new_kv, cache_index, axis=1)
                new_cache.append(new_kv)
            new_cache = tuple(new_cache) if cache is not None else None
        x = family.final_norm(self, c)(x)
        return x if order is None else in_order(order[1], x)[0], new_cache, table


class CausalLMModule(nn.Module):
    """Trunk + LM head (tied to the embeddings or not), optionally + a value head.

    Returns (logits (B, Lq, V) float32, values (B, Lq) or None, new_cache); with
    `return_hidden=True` the LM head is skipped and the final hidden states (B, Lq, D)
    come in place of the logits (`Model` then applies the head where it is read)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: Any = False  # False, True, or a jax.checkpoint_policies name (see Model)
    scan_layers: bool = False
    with_value_head: bool = False
    lora: Optional[LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"
    context_attention: str = "auto"

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions, cache=None, cache_index=0, return_hidden=False,
                 segment_ids=None, images=None):
        c = self.config
        trunk = Transformer(c, self.dtype, self.param_dtype, self.remat, self.scan_layers, self.lora, self.adapters,
                            self.attention, self.context_attention, name=family_of(c).trunk_name)
        hidden, cache, table = trunk(input_ids, attention_mask, positions, cache, cache_index, segment_ids, images)
        values = None
        if self.with_value_head:
            values = nn.Dense(1, dtype=jnp.float32, param_dtype=self.param_dtype, kernel_init=nn.initializers.zeros,
                              name="value_head")(hidden.astype(jnp.float32))[..., 0]
        if return_hidden and not self.is_initializing():
            return hidden, values, cache
        if c.tie_word_embeddings:
            logits = jnp.einsum("bld,vd->blv", hidden, table.astype(self.dtype))
        else:
            logits = nn.Dense(c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, name="lm_head")(hidden)
        return softcap(logits.astype(jnp.float32), c.final_logit_softcapping), values, cache


class ScoreModule(nn.Module):
    """Trunk + a linear `score` head (no bias), per token: (B, L, num_labels) float32.

    Used for reward models (`...ForSequenceClassification`, read at the last real token that is
    not padding: `jaxppo.models.model.score_positions`)
    and for critics (one label, read at every token)."""

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: Any = False  # False, True, or a jax.checkpoint_policies name (see Model)
    scan_layers: bool = False
    num_labels: int = 1
    zero_init: bool = False
    lora: Optional[LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"
    context_attention: str = "auto"

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions, segment_ids=None, cache=None, cache_index=0, images=None):
        """Scores (B, Lq, num_labels); with a `cache` (as `Transformer` takes one), (scores,
        new cache)."""
        c = self.config
        trunk = Transformer(c, self.dtype, self.param_dtype, self.remat, self.scan_layers, self.lora, self.adapters,
                            self.attention, self.context_attention, name=family_of(c).trunk_name)
        hidden, new_cache, _ = trunk(input_ids, attention_mask, positions, cache, cache_index, segment_ids, images)
        init = nn.initializers.zeros if self.zero_init else nn.initializers.normal(0.02)
        scores = nn.Dense(self.num_labels, use_bias=False, dtype=jnp.float32, param_dtype=self.param_dtype,
                          kernel_init=init, name="score")(hidden.astype(jnp.float32))
        return scores if cache is None else (scores, new_cache)
