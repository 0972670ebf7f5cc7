"""GPT-2: learned positions, LayerNorm, a fused q/k/v projection with biases, a GELU MLP;
Hugging Face's Conv1D layers store their weights (in, out), as Flax does."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.family import ModelFamily
from jaxppo.models.lora import LoraConfig
from jaxppo.models.transformer import activation, attend, attend_with_cache, dense

__all__ = ["GPT2Block", "FAMILY"]


class GPT2Block(nn.Module):
    config: ModelConfig
    dtype: Any
    param_dtype: Any
    lora: Optional[LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"
    context_attention: str = "auto"  # attention across a "context" mesh axis (jaxppo.models.context)

    @nn.compact
    def __call__(self, x, masks, positions, layer_cache, cache_index, sliding=False):
        c = self.config
        mask = masks[0]
        linear = lambda n, name: dense(self, n, True, name)
        ln = lambda name: nn.LayerNorm(epsilon=c.norm_eps, dtype=self.dtype, param_dtype=self.param_dtype, name=name)
        b, l, _ = x.shape
        h = ln("ln_1")(x)
        qkv = linear(3 * c.hidden_size, "c_attn")(h)
        q, k, v = jnp.split(qkv.reshape(b, l, 3, c.num_heads, c.head_dim), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        if layer_cache is None:  # a whole forward pass (across a context axis where the mesh has one)
            attn = attend(q, k, v, mask, self.dtype, impl=self.attention, context=self.context_attention)
        else:
            attn, layer_cache = attend_with_cache(q, k, v, layer_cache, cache_index, mask, self.dtype,
                                                  impl=self.attention)
        x = x + linear(c.hidden_size, "c_proj")(attn)
        h = ln("ln_2")(x)
        h = linear(c.intermediate_size, "c_fc")(h)
        h = linear(c.hidden_size, "mlp_c_proj")(activation(c.activation)(h))
        return x + h, layer_cache


def _embed(trunk, c: ModelConfig, input_ids, positions):
    """Token embeddings plus learned position embeddings."""
    wte = nn.Embed(c.vocab_size, c.hidden_size, dtype=trunk.dtype, param_dtype=trunk.param_dtype, name="wte")
    wpe = nn.Embed(c.max_position_embeddings, c.hidden_size, dtype=trunk.dtype, param_dtype=trunk.param_dtype,
                   name="wpe")
    return wte(input_ids) + wpe(positions), wte.embedding


def _final_norm(trunk, c: ModelConfig):
    return nn.LayerNorm(epsilon=c.norm_eps, dtype=trunk.dtype, param_dtype=trunk.param_dtype, name="ln_f")


def _check(c: ModelConfig):
    if c.sliding_window or c.qk_norm or c.local_rope_theta:
        raise ValueError("gpt2 models take no sliding_window, qk_norm or local_rope_theta")


def _from_hf(d: dict, common: dict) -> ModelConfig:
    if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
        raise ValueError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not d.get("scale_attn_weights", True):
        raise ValueError("GPT-2 with scale_attn_weights=False is not supported")
    n_embd = d["n_embd"]
    return ModelConfig(model_type="gpt2", hidden_size=n_embd, num_layers=d["n_layer"], num_heads=d["n_head"],
                       num_kv_heads=d["n_head"], intermediate_size=d.get("n_inner") or 4 * n_embd,
                       max_position_embeddings=d["n_positions"], norm_eps=d.get("layer_norm_epsilon", 1e-5),
                       activation=d.get("activation_function", "gelu_new"), qkv_bias=True, mlp_bias=True, **common)


def _to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    return transformers.GPT2Config(n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                                   n_inner=c.intermediate_size, n_positions=c.max_position_embeddings,
                                   layer_norm_epsilon=c.norm_eps, activation_function=c.activation, **common)


FAMILY = ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    architectures={"gpt2": ("GPT2LMHeadModel", "GPT2ForSequenceClassification")},
    config_from_hf=_from_hf,
    config_to_hf=_to_hf,
    check=_check,
    tied_by_default=True,
    block=GPT2Block,
    trunk_name="transformer",
    layers_prefix="h",
    embed_name="wte",
    embed=_embed,
    final_norm=_final_norm,
    hf_block_names={"c_attn": "attn.c_attn", "c_proj": "attn.c_proj", "c_fc": "mlp.c_fc", "mlp_c_proj": "mlp.c_proj"},
    hf_untransposed=frozenset({"c_attn", "c_proj", "c_fc", "mlp_c_proj"}),
    lora_targets={"c_attn": ("c_attn",), "c_proj": ("c_proj", "mlp_c_proj"), "c_fc": ("c_fc",)},
    learned_positions=True,
)
