"""A tiny causal transformer with a value head, for examples, tests and benchmarks.

It is deliberately small and self-contained (pre-LayerNorm blocks, learned positions,
causal attention that ignores left padding), so the engine can be exercised without any
checkpoint. For real models see `jaxppo.models`.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["ToyPolicyValue", "make_toy"]


class _Block(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, x, attn_mask):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width, use_bias=False)(h, h, mask=attn_mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.width)(h)
        h = nn.Dense(self.width)(nn.gelu(h))
        return x + h


class ToyPolicyValue(nn.Module):
    """tokens (B, L) int, mask (B, L) -> (logits (B, L, vocab), values (B, L))."""

    vocab_size: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    max_len: int = 128

    @nn.compact
    def __call__(self, tokens, mask):
        mask = mask.astype(bool)
        # Positions count real tokens only, so left padding does not shift them.
        positions = jnp.clip(jnp.cumsum(mask, axis=-1) - 1, 0, self.max_len - 1)
        x = nn.Embed(self.vocab_size, self.width)(tokens) + nn.Embed(self.max_len, self.width)(positions)
        length = tokens.shape[1]
        causal = jnp.tril(jnp.ones((length, length), bool))
        attn_mask = causal[None, None] & mask[:, None, None, :]
        # A padding query row attends to itself only, so its softmax stays finite.
        attn_mask = attn_mask | jnp.eye(length, dtype=bool)[None, None]
        for _ in range(self.depth):
            x = _Block(self.width, self.heads)(x, attn_mask)
        x = nn.LayerNorm()(x)
        logits = nn.Dense(self.vocab_size)(x)
        values = nn.Dense(1, kernel_init=nn.initializers.zeros)(x)[..., 0]
        return logits, values


def make_toy(key, *, vocab_size=64, width=64, depth=2, heads=4, max_len=128, seq_len=16):
    """(apply_fn, params) of a `ToyPolicyValue`; `apply_fn(params, tokens, mask)`."""
    model = ToyPolicyValue(vocab_size=vocab_size, width=width, depth=depth, heads=heads, max_len=max_len)
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(key, tokens, jnp.ones_like(tokens))
    return model.apply, params
