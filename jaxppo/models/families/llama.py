"""The Llama family: Llama 2/3, Mistral, Qwen2 and Qwen3. RoPE (with llama3 or linear
scaling), RMSNorm, grouped-query attention, a gated MLP; Qwen2 adds q/k/v biases, Qwen3
RMS-normalises each query and key head; Mistral (and Qwen with `use_sliding_window`)
attends through a sliding window. Gemma 3 (`jaxppo.models.families.gemma3`) reuses the
block and the config mapping here."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.family import ModelFamily
from jaxppo.models.lora import LoraConfig
from jaxppo.models.gated_mlp import gated_mlp
from jaxppo.models.moe import SparseMoe
from jaxppo.models.transformer import RMSNorm, apply_rope, attend, attend_with_cache, dense, rope_inv_freq

__all__ = ["LlamaBlock", "FAMILY", "embed_tokens", "rope_fields", "config_kwargs", "to_hf_kwargs", "hf_layer_types",
           "make_hf_config"]

HF_BLOCK_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}
LORA_TARGETS = {n: (n,) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


class LlamaBlock(nn.Module):
    """A Llama-family block. `sliding` (a bool, or a traced bool under the layer scan)
    selects the sliding-window mask and the local rope. Subclasses with `sandwich_norms`
    (Gemma 3) normalise after attention and around the MLP too, with (1 + weight) norms."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any
    lora: Optional[LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"
    context_attention: str = "auto"  # attention across a "context" mesh axis (jaxppo.models.context)
    sandwich_norms: ClassVar[bool] = False

    @nn.compact
    def __call__(self, x, masks, positions, layer_cache, cache_index, sliding=False):
        c = self.config
        b, l, _ = x.shape
        norm = lambda name: RMSNorm(c.norm_eps, self.dtype, self.param_dtype, self.sandwich_norms, name=name)
        proj = lambda n, bias, name: dense(self, n, bias, name)
        h = norm("input_layernorm")(x)
        q = proj(c.num_heads * c.head_dim, c.qkv_bias, "q_proj")(h).reshape(b, l, c.num_heads, c.head_dim)
        k = proj(c.num_kv_heads * c.head_dim, c.qkv_bias, "k_proj")(h).reshape(b, l, c.num_kv_heads, c.head_dim)
        v = proj(c.num_kv_heads * c.head_dim, c.qkv_bias, "v_proj")(h).reshape(b, l, c.num_kv_heads, c.head_dim)
        if c.qk_norm:  # per head, over head_dim, before the rotation
            q, k = norm("q_norm")(q), norm("k_norm")(k)
        inv_freq = rope_inv_freq(c)
        if c.local_rope_theta is not None:
            inv_freq = jnp.where(sliding, rope_inv_freq(c, local=True), inv_freq)
        q = apply_rope(q, positions, inv_freq, c.mrope_axes)
        k = apply_rope(k, positions, inv_freq, c.mrope_axes)
        mask = masks[0] if masks[1] is None else jnp.where(sliding, masks[1], masks[0])
        if layer_cache is None:  # a whole forward pass (across a context axis where the mesh has one)
            attn = attend(q, k, v, mask, self.dtype, c.query_pre_attn_scalar, self.attention, self.context_attention)
        else:
            attn, layer_cache = attend_with_cache(q, k, v, layer_cache, cache_index, mask, self.dtype,
                                                  c.query_pre_attn_scalar, self.attention)
        # Hugging Face's `attention_bias` covers the output projection too, except in Qwen2
        # (and Qwen2.5-VL's language model), whose q/k/v biases are built in.
        attn = proj(c.hidden_size, c.qkv_bias and c.model_type not in ("qwen2", "qwen2_5_vl"), "o_proj")(attn)
        if c.num_experts:  # a mixture of experts (Qwen3-MoE, Mixtral)
            mlp = SparseMoe(c, self.dtype, self.param_dtype, self.lora, self.adapters, name="moe")
        else:
            mlp = lambda h: gated_mlp(self, h)  # noqa: E731
        if self.sandwich_norms:
            x = x + norm("post_attention_layernorm")(attn)
            return x + norm("post_feedforward_layernorm")(mlp(norm("pre_feedforward_layernorm")(x))), layer_cache
        x = x + attn
        return x + mlp(norm("post_attention_layernorm")(x)), layer_cache


def embed_tokens(trunk, c: ModelConfig, input_ids, positions):
    """The token embeddings (no positions: the blocks rotate q and k) and their table."""
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=trunk.dtype, param_dtype=trunk.param_dtype,
                     name="embed_tokens")
    return embed(input_ids), embed.embedding


def _final_norm(trunk, c: ModelConfig):
    return RMSNorm(c.norm_eps, trunk.dtype, trunk.param_dtype, False, name="norm")


def rope_fields(rope: dict, d: dict) -> dict:
    """`rope_theta` and `rope_scaling` (sorted (key, value) pairs) from a Hugging Face rope
    parameters dict (transformers >= 5) or, when it is empty, from the separate
    `rope_theta` / `rope_scaling` fields of earlier versions."""
    rope = dict(rope)
    if not rope:
        rope = dict(d.get("rope_scaling") or {})
        rope["rope_theta"] = d.get("rope_theta", 10000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    scaling = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope.items()))
    return dict(rope_theta=theta, rope_scaling=scaling)


def config_kwargs(d: dict, common: dict, window, layer_types) -> dict:
    """The `ModelConfig` fields every rotary family reads alike from a Hugging Face config."""
    return dict(
        model_type=d["model_type"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        intermediate_size=d["intermediate_size"],
        max_position_embeddings=d["max_position_embeddings"],
        norm_eps=d.get("rms_norm_eps", 1e-6),
        activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        qkv_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=window,
        layer_types=None if layer_types is None else tuple(layer_types),
        **common,
    )


def _from_hf(d: dict, common: dict) -> ModelConfig:
    model_type = d["model_type"]
    # Sliding-window attention: Mistral sets `sliding_window`; Qwen2/3 only with
    # use_sliding_window (then per `layer_types`); Llama never.
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
        window = None
    if model_type == "llama":
        window = None
    kwargs = config_kwargs(d, common, window, d.get("layer_types") if window is not None else None)
    if model_type == "qwen2":
        kwargs["qkv_bias"] = True
    return ModelConfig(qk_norm=model_type == "qwen3", **kwargs, **rope_fields(d.get("rope_parameters") or {}, d))


def to_hf_kwargs(c: ModelConfig, common: dict) -> dict:
    """The Hugging Face config arguments every rotary family writes alike."""
    return dict(hidden_size=c.hidden_size, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.norm_eps, hidden_act=c.activation,
                **common)


def nested_common(common: dict) -> dict:
    """The common fields a vision-language model's nested text config takes: all but the
    outer model's `architectures` and `num_labels`."""
    return {k: v for k, v in common.items() if k not in ("architectures", "num_labels")}


def hf_layer_types(c: ModelConfig):
    """Hugging Face's `layer_types` of a config with sliding layers (None without a window)."""
    if c.sliding_window is None:
        return None
    return ["sliding_attention" if s else "full_attention" for s in c.sliding_layers]


def make_hf_config(cls, rope: dict, kwargs: dict, before_5=None):
    """`cls(rope_parameters=rope, **kwargs)` (transformers >= 5), or with the separate
    `rope_theta` / `rope_scaling` of earlier versions (`before_5(rope, kwargs)` adjusts
    them first where a family needs it)."""
    try:
        return cls(rope_parameters=rope, **kwargs)
    except TypeError:  # transformers < 5
        if before_5 is not None:
            rope = before_5(rope, kwargs)
        rope = dict(rope)
        rope_theta = rope.pop("rope_theta")
        scaling = None if rope.get("rope_type", "default") == "default" else rope
        return cls(rope_theta=rope_theta, rope_scaling=scaling, **kwargs)


def _to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    kwargs = to_hf_kwargs(c, common)
    layer_types = hf_layer_types(c)
    if c.model_type == "llama":
        cls = transformers.LlamaConfig
        kwargs.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    elif c.model_type == "mistral":
        cls = transformers.MistralConfig
        kwargs.update(sliding_window=c.sliding_window)
    elif c.model_type == "qwen2":
        cls = transformers.Qwen2Config
        kwargs.update(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                      layer_types=layer_types)
    else:
        cls = transformers.Qwen3Config
        kwargs.update(attention_bias=c.qkv_bias, use_sliding_window=c.sliding_window is not None,
                      sliding_window=c.sliding_window, layer_types=layer_types)
    return make_hf_config(cls, dict(c.rope_params, rope_theta=c.rope_theta), kwargs)


FAMILY = ModelFamily(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    architectures={t: (f"{p}ForCausalLM", f"{p}ForSequenceClassification")
                   for t, p in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))},
    config_from_hf=_from_hf,
    config_to_hf=_to_hf,
    block=LlamaBlock,
    trunk_name="model",
    layers_prefix="layers",
    embed_name="embed_tokens",
    embed=embed_tokens,
    final_norm=_final_norm,
    hf_block_names=HF_BLOCK_NAMES,
    lora_targets=LORA_TARGETS,
)
