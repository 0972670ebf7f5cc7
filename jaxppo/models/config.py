"""`ModelConfig`: the architecture of a causal transformer, read from / written to a
Hugging Face `config.json`. Frozen and hashable, so models can be static jit arguments."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "qwen2")
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GPT-2 or Llama-family (Llama 2/3, Qwen2) causal transformer.

    `model_type` selects the block: "gpt2" (learned positions, LayerNorm, fused qkv with
    biases, GELU MLP) or "llama"/"qwen2" (RoPE, RMSNorm, grouped-query attention, SwiGLU
    MLP; qwen2 adds q/k/v biases). `rope_scaling` is a sorted tuple of (key, value) pairs
    of Hugging Face's rope parameters (rope_type "default", "linear" or "llama3").
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

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported model types: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling or ())

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers `PretrainedConfig` (or its dict)."""
        d = hf if isinstance(hf, dict) else hf.to_dict()
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        common = dict(
            vocab_size=d["vocab_size"],
            pad_token_id=d.get("pad_token_id"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type == "gpt2")),
            num_labels=len(d.get("id2label") or {0: 0}) if d.get("num_labels") is None else d["num_labels"],
        )
        if model_type == "gpt2":
            if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
                raise ValueError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
            if not d.get("scale_attn_weights", True):
                raise ValueError("GPT-2 with scale_attn_weights=False is not supported")
            n_embd = d["n_embd"]
            return cls(
                model_type="gpt2",
                hidden_size=n_embd,
                num_layers=d["n_layer"],
                num_heads=d["n_head"],
                num_kv_heads=d["n_head"],
                intermediate_size=d.get("n_inner") or 4 * n_embd,
                max_position_embeddings=d["n_positions"],
                norm_eps=d.get("layer_norm_epsilon", 1e-5),
                activation=d.get("activation_function", "gelu_new"),
                qkv_bias=True,
                mlp_bias=True,
                **common,
            )
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=True is not supported")
        rope = dict(d.get("rope_parameters") or {})
        if not rope:  # transformers < 5: rope_theta and rope_scaling are separate
            rope = dict(d.get("rope_scaling") or {})
            rope["rope_theta"] = d.get("rope_theta", 10000.0)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
        rope.setdefault("rope_type", "default")
        return cls(
            model_type=model_type,
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=d["num_attention_heads"],
            num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim"),
            intermediate_size=d["intermediate_size"],
            max_position_embeddings=d["max_position_embeddings"],
            norm_eps=d.get("rms_norm_eps", 1e-6),
            activation=d.get("hidden_act", "silu"),
            qkv_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, _hashable(v)) for k, v in rope.items())),
            **common,
        )

    def to_hf(self, architecture: str):
        """A transformers config object for this architecture (e.g. "LlamaForCausalLM")."""
        import transformers

        eos = None if not self.eos_token_ids else (self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids))
        common = dict(
            vocab_size=self.vocab_size,
            pad_token_id=self.pad_token_id,
            bos_token_id=self.bos_token_id,
            eos_token_id=eos,
            tie_word_embeddings=self.tie_word_embeddings,
            num_labels=self.num_labels,
            architectures=[architecture],
        )
        if self.model_type == "gpt2":
            return transformers.GPT2Config(
                n_embd=self.hidden_size,
                n_layer=self.num_layers,
                n_head=self.num_heads,
                n_inner=self.intermediate_size,
                n_positions=self.max_position_embeddings,
                layer_norm_epsilon=self.norm_eps,
                activation_function=self.activation,
                **common,
            )
        rope = dict(self.rope_params, rope_theta=self.rope_theta)
        kwargs = dict(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.norm_eps,
            hidden_act=self.activation,
            **common,
        )
        if self.model_type == "llama":
            cls = transformers.LlamaConfig
            kwargs.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        else:
            cls = transformers.Qwen2Config
        try:
            return cls(rope_parameters=rope, **kwargs)
        except TypeError:  # transformers < 5
            rope_theta = rope.pop("rope_theta")
            scaling = None if rope.get("rope_type", "default") == "default" else rope
            return cls(rope_theta=rope_theta, rope_scaling=scaling, **kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _hashable(value):
    if isinstance(value, list):
        return tuple(value)
    return value
