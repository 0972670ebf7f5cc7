"""Gemma 3 (text): the Llama block with norms after attention and around the MLP, RMSNorm
with (1 + weight), q/k norms, GeGLU, embeddings scaled by sqrt(hidden_size), sliding and
global layers with their own rope bases, optional logit soft-capping."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.families import llama
from jaxppo.models.transformer import RMSNorm

__all__ = ["GemmaBlock", "FAMILY"]


class GemmaBlock(llama.LlamaBlock):
    """The Gemma 3 block: `LlamaBlock` with sandwich norms of (1 + weight)."""

    sandwich_norms = True


def _embed(trunk, c: ModelConfig, input_ids, positions):
    x, table = llama.embed_tokens(trunk, c, input_ids, positions)
    # Scaled by sqrt(hidden_size), rounded to the parameter dtype as Hugging Face does.
    return x * jnp.asarray(c.hidden_size ** 0.5, trunk.param_dtype).astype(x.dtype), table


def _final_norm(trunk, c: ModelConfig):
    return RMSNorm(c.norm_eps, trunk.dtype, trunk.param_dtype, True, name="norm")


def _from_hf(d: dict, common: dict) -> ModelConfig:
    # transformers >= 5: one rope dict per layer type; earlier: rope_theta, rope_scaling
    # (global layers) and rope_local_base_freq (sliding layers).
    rope = dict(d.get("rope_parameters") or {})
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding-layer rope_type {local['rope_type']!r} is not supported; supported: default")
    local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    rope = dict(rope.get("full_attention") or {})
    if not rope:
        rope = dict(d.get("rope_scaling") or {})
        rope["rope_theta"] = d.get("rope_theta", 1000000.0)
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True is not a causal LM; not supported")
    window = d.get("sliding_window")
    layer_types = d.get("layer_types") if window is not None else None
    if layer_types is None and window is not None:
        pattern = d.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(d["num_hidden_layers"])]
    return ModelConfig(qk_norm=True, local_rope_theta=local_theta,
                       query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                       final_logit_softcapping=d.get("final_logit_softcapping"),
                       **llama.config_kwargs(d, common, window, layer_types), **llama.rope_fields(rope, d))


def _before_5(rope: dict, kwargs: dict) -> dict:
    """transformers < 5: the sliding layers' base as `rope_local_base_freq`."""
    kwargs["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    return rope["full_attention"]


def _to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    kwargs = llama.to_hf_kwargs(c, common)
    kwargs["hidden_activation"] = kwargs.pop("hidden_act")
    kwargs.update(attention_bias=c.qkv_bias, sliding_window=c.sliding_window, layer_types=llama.hf_layer_types(c),
                  query_pre_attn_scalar=c.query_pre_attn_scalar, final_logit_softcapping=c.final_logit_softcapping)
    rope = {"full_attention": dict(c.rope_params, rope_theta=c.rope_theta),
            "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta or c.rope_theta}}
    return llama.make_hf_config(transformers.Gemma3TextConfig, rope, kwargs, before_5=_before_5)


# The Llama family's module and tensor names and LoRA targets; its own block, embeddings,
# final norm and configs.
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="gemma3",
    model_types=("gemma3_text",),
    architectures={"gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification")},
    config_from_hf=_from_hf,
    config_to_hf=_to_hf,
    tied_by_default=True,
    hints={"gemma3": "this is a multimodal Gemma3ForConditionalGeneration checkpoint: jaxppo loads Gemma 3 text "
                     "checkpoints (model_type gemma3_text, Gemma3ForCausalLM) only"},
    block=GemmaBlock,
    embed=_embed,
    final_norm=_final_norm,
)
