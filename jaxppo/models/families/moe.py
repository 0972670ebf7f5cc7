"""Mixture-of-experts families: Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B)
and Mixtral (`mixtral`). Both are the Llama block (RoPE, RMSNorm, grouped-query attention;
Qwen3-MoE with q/k norms) whose MLP is a sparse mixture of experts
(`jaxppo.models.moe.SparseMoe`): the Llama family's block with `num_experts` set.

Hugging Face stores one tensor per expert (`mlp.experts.{e}.gate_proj.weight` for
Qwen3-MoE, `block_sparse_moe.experts.{e}.w1.weight` for Mixtral, w1/w3/w2 being
gate/up/down); jaxppo stacks them on an expert axis and writes them back one per expert.

Not supported (refused when loading): Qwen3-MoE checkpoints with dense layers among the
sparse ones (`mlp_only_layers`, `decoder_sparse_step` > 1); no released Qwen3-MoE has
them. Mixtral's router jitter (`router_jitter_noise`, a training-time noise in Hugging
Face) is not applied. LoRA adapts the attention projections (`q_proj`, `k_proj`,
`v_proj`, `o_proj`) and the experts' (`gate_proj`, `up_proj`, `down_proj`; Mixtral's `w1`,
`w3`, `w2`: one adapter per expert); "all-linear" is all of them, not the router."""

from __future__ import annotations

import dataclasses

from jaxppo.models.config import ModelConfig
from jaxppo.models.families import llama

__all__ = ["QWEN3_MOE", "MIXTRAL"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTENTION_NAMES = {n: llama.HF_BLOCK_NAMES[n] for n in _ATTENTION + ("q_norm", "k_norm")}


def _experts_fields(d: dict, count_key: str, moe_size: int, normalise: bool) -> dict:
    return dict(num_experts=int(d[count_key]), num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_intermediate_size=int(moe_size), norm_topk_prob=bool(normalise))


def _qwen3_moe_from_hf(d: dict, common: dict) -> ModelConfig:
    step, dense = d.get("decoder_sparse_step", 1), list(d.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise ValueError(f"a qwen3_moe checkpoint with dense layers among the sparse ones (decoder_sparse_step={step}, "
                         f"mlp_only_layers={dense}) is not supported; supported: every layer sparse "
                         "(decoder_sparse_step=1, mlp_only_layers=[]), as the released Qwen3-MoE checkpoints are")
    window = d.get("sliding_window") if d.get("use_sliding_window") else None
    kwargs = llama.config_kwargs(d, common, window, d.get("layer_types") if window is not None else None)
    count = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
    return ModelConfig(qk_norm=True, **kwargs, **llama.rope_fields(d.get("rope_parameters") or {}, d),
                       **_experts_fields(d, count, d["moe_intermediate_size"], d.get("norm_topk_prob", False)))


def _mixtral_from_hf(d: dict, common: dict) -> ModelConfig:
    window = d.get("sliding_window")
    kwargs = llama.config_kwargs(d, common, window, None)
    return ModelConfig(**kwargs, **llama.rope_fields(d.get("rope_parameters") or {}, d),
                       **_experts_fields(d, "num_local_experts", d["intermediate_size"], True))


def _qwen3_moe_to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    kwargs = llama.to_hf_kwargs(c, common)
    kwargs.update(attention_bias=c.qkv_bias, use_sliding_window=c.sliding_window is not None,
                  sliding_window=c.sliding_window, num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                  moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                  decoder_sparse_step=1, mlp_only_layers=[])
    return llama.make_hf_config(transformers.Qwen3MoeConfig, dict(c.rope_params, rope_theta=c.rope_theta), kwargs)


def _mixtral_to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    kwargs = llama.to_hf_kwargs(c, common)
    kwargs.update(intermediate_size=c.moe_intermediate_size, sliding_window=c.sliding_window,
                  num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    return llama.make_hf_config(transformers.MixtralConfig, dict(c.rope_params, rope_theta=c.rope_theta), kwargs)


def _check(c: ModelConfig):
    if not c.num_experts:
        raise ValueError(f"a {c.model_type} model needs num_experts > 0 (its MLP is a mixture of experts)")
    if c.model_type == "mixtral" and not c.norm_topk_prob:
        raise ValueError("Mixtral always renormalises its top-k router weights: norm_topk_prob must be True")


QWEN3_MOE = dataclasses.replace(
    llama.FAMILY,
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures={"qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification")},
    config_from_hf=_qwen3_moe_from_hf,
    config_to_hf=_qwen3_moe_to_hf,
    check=_check,
    hf_block_names={**_ATTENTION_NAMES, "moe": "mlp"},
    hf_expert_names={"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},
    lora_targets={n: (n,) for n in _ATTENTION + ("gate_proj", "up_proj", "down_proj")},
    hints={"qwen2_moe": "Qwen2-MoE (shared experts) is not supported; Qwen3-MoE (qwen3_moe) is"},
)

MIXTRAL = dataclasses.replace(
    QWEN3_MOE,
    name="mixtral",
    model_types=("mixtral",),
    architectures={"mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification")},
    config_from_hf=_mixtral_from_hf,
    config_to_hf=_mixtral_to_hf,
    hf_block_names={**_ATTENTION_NAMES, "moe": "block_sparse_moe"},
    hf_expert_names={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    # Targets are Hugging Face's (and PEFT's) module names: Mixtral's experts' w1, w3, w2.
    lora_targets={**{n: (n,) for n in _ATTENTION}, "w1": ("gate_proj",), "w3": ("up_proj",), "w2": ("down_proj",)},
    hints={},
)
