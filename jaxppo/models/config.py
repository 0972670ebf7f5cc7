"""`ModelConfig`: the architecture of a causal transformer, read from / written to a
Hugging Face `config.json`. Frozen and hashable, so models can be static jit arguments."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Tuple

import numpy as np

from jaxppo.models.family import family_of

__all__ = ["ModelConfig"]

LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a causal transformer: GPT-2, the Llama family (Llama 2/3, Mistral,
    Qwen2, Qwen3), Gemma 3 text, or a registered family of your own.

    `model_type` selects the family (`jaxppo.models.family`) and so the block: "gpt2"
    (learned positions, LayerNorm, fused qkv with biases, GELU MLP),
    "llama"/"mistral"/"qwen2"/"qwen3" (RoPE, RMSNorm, grouped-query attention, gated MLP;
    qwen2 adds q/k/v biases, qwen3 RMS-normalises each query and key head), or
    "gemma3_text" (Gemma 3: embeddings scaled by sqrt(hidden_size), RMSNorm with
    (1 + weight), q/k norms, norms before and after both attention and MLP, GeGLU).
    `rope_scaling` is a sorted tuple of (key, value) pairs of Hugging Face's rope
    parameters (rope_type "default", "linear" or "llama3").

    Attention options (the Llama family and Gemma): `sliding_window` (a key slot s is seen
    from query slot q when q - window < s <= q, as Hugging Face counts it) applies to the
    layers whose `layer_types` entry is "sliding_attention" (None: every layer when
    `sliding_window` is set, as Mistral); `local_rope_theta` is the rope base of the
    sliding layers when it differs from the global one (Gemma 3); `query_pre_attn_scalar`
    replaces head_dim in the 1/sqrt scaling of the attention scores;
    `final_logit_softcapping` caps the output logits at +-cap with cap * tanh(x / cap).
    (Gemma 3 configs may carry `attn_logit_softcapping`; Hugging Face's Gemma 3 attention
    does not apply it, and neither does jaxppo.)

    Mixture of experts (Qwen3-MoE `qwen3_moe`, Mixtral `mixtral`; `jaxppo.models.moe`):
    with `num_experts` > 0 every block's MLP is `num_experts` gated MLPs of
    `moe_intermediate_size` of which a router picks `num_experts_per_tok` per token, their
    weights renormalised to sum to one where `norm_topk_prob`.

    Vision-language models (Qwen2.5-VL `qwen2_5_vl`; `jaxppo.models.vision`): `vision`
    is the vision encoder's config (`jaxppo.models.vision.QwenVisionConfig`), whose image
    token embeddings replace the embeddings of the text's `image_token_id` tokens;
    `rope_scaling`'s "mrope_section" makes the rotary positions three-dimensional
    (`mrope_section`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    head_dim: Optional[int] = None
    norm_eps: float = 1e-5
    activation: str = "gelu_new"
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Optional[Tuple[Tuple[str, object], ...]] = None
    pad_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None
    eos_token_ids: Tuple[int, ...] = ()
    num_labels: int = 1
    qk_norm: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[Tuple[str, ...]] = None
    local_rope_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: Optional[int] = None
    norm_topk_prob: bool = True
    vision: Any = None
    image_token_id: Optional[int] = None

    def __post_init__(self):
        family = family_of(self.model_type)  # ValueError naming the supported types
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
        rope_type = self.rope_params.get("rope_type", "default")
        if rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_layers} layers; "
                                 f"got {list(self.layer_types)}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} is invalid; use None or a positive int")
        if self.num_experts:
            if self.moe_intermediate_size is None:
                object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                                 f"num_experts={self.num_experts}")
        elif self.num_experts < 0 or self.num_experts_per_tok:
            raise ValueError(f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}: "
                             "experts per token need num_experts > 0")
        if (self.vision is None) != (self.image_token_id is None):
            raise ValueError("a vision-language config needs both `vision` and `image_token_id`; got "
                             f"vision={self.vision!r}, image_token_id={self.image_token_id!r}")
        family.check(self)

    @property
    def sliding_layers(self) -> Tuple[bool, ...]:
        """Per layer: does it attend through the sliding window?"""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def mrope_section(self) -> Optional[Tuple[int, ...]]:
        """Qwen2.5-VL's multimodal rotary sections (frequencies turning with the temporal,
        height and width positions; `jaxppo.models.transformer.apply_rope`), or None."""
        sections = self.rope_params.get("mrope_section")
        return None if sections is None else tuple(int(s) for s in sections)

    @property
    def mrope_axes(self) -> Optional[Tuple[int, ...]]:
        """The position axis (0 temporal, 1 height, 2 width) each rotary frequency turns
        with under M-RoPE, or None: `mrope_section` in sections (Qwen2.5-VL), or, with
        rope parameters' "mrope_interleaved" (Qwen3-VL), interleaved as Hugging Face
        recomposes them: frequency j turns with the height where j % 3 == 1 and j < 3 x
        sections[1], with the width where j % 3 == 2 and j < 3 x sections[2], else with
        the temporal position."""
        sections = self.mrope_section
        if sections is None:
            return None
        if not self.rope_params.get("mrope_interleaved"):
            return tuple(int(a) for a in np.repeat(np.arange(3), sections))
        axes = [0] * sum(sections)
        for axis in (1, 2):
            for j in range(axis, min(3 * sections[axis], len(axes)), 3):
                axes[j] = axis
        return tuple(axes)

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers `PretrainedConfig` (or its dict): see `config_from_hf`."""
        return config_from_hf(hf)

    def to_hf(self, architecture: str):
        """A transformers config object for this architecture (e.g. "LlamaForCausalLM"),
        built by the model's family (`jaxppo.models.family`)."""
        family = family_of(self)
        if family.config_to_hf is None:
            raise ValueError(f"the {family.name} family has no Hugging Face export (its config_to_hf is None)")
        eos = None if not self.eos_token_ids else (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                                    else list(self.eos_token_ids))
        common = dict(vocab_size=self.vocab_size, pad_token_id=self.pad_token_id, bos_token_id=self.bos_token_id,
                      eos_token_id=eos, tie_word_embeddings=self.tie_word_embeddings, num_labels=self.num_labels,
                      architectures=[architecture])
        return family.config_to_hf(self, architecture, common)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def settings(self) -> dict:
        """The config as a dict for a run's settings, without the fields added in 0.3
        (Qwen3 / Gemma 3 / sliding windows) where they hold their defaults, so that runs
        saved before them still match."""
        out = dataclasses.asdict(self)
        for name in ADDED_FIELDS:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return json.loads(json.dumps(out))


def config_from_hf(hf) -> ModelConfig:
    """The `ModelConfig` of a transformers `PretrainedConfig` (or its dict): the fields
    every family reads alike here, the rest by the family of its `model_type`."""
    d = hf if isinstance(hf, dict) else hf.to_dict()
    if isinstance(d.get("text_config"), dict):  # a vision-language model: the language model's fields, nested
        d = {**d["text_config"], **{k: v for k, v in d.items() if k != "text_config"}}
    family = family_of(d.get("model_type"))
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    common = dict(
        vocab_size=d["vocab_size"],
        pad_token_id=d.get("pad_token_id"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=eos_ids,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", family.tied_by_default)),
        num_labels=len(d.get("id2label") or {0: 0}) if d.get("num_labels") is None else d["num_labels"],
    )
    return family.config_from_hf(d, common)


ADDED_FIELDS = ("qk_norm", "sliding_window", "layer_types", "local_rope_theta", "query_pre_attn_scalar",
                "final_logit_softcapping", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "norm_topk_prob", "vision", "image_token_id")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
