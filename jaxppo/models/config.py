"""`ModelConfig`: the architecture of a causal transformer, read from / written to a
Hugging Face `config.json`. Frozen and hashable, so models can be static jit arguments."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Tuple

__all__ = ["ModelConfig", "SUPPORTED_MODEL_TYPES"]

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# Hugging Face architecture prefixes (`<prefix>ForCausalLM`, `<prefix>ForSequenceClassification`).
ARCHITECTURE_PREFIX = {"gpt2": "GPT2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                       "gemma3_text": "Gemma3Text"}
LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu", "relu", "silu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a GPT-2, Llama-family (Llama 2/3, Mistral, Qwen2, Qwen3) or Gemma 3
    text causal transformer.

    `model_type` selects the block: "gpt2" (learned positions, LayerNorm, fused qkv with
    biases, GELU MLP), "llama"/"mistral"/"qwen2"/"qwen3" (RoPE, RMSNorm, grouped-query
    attention, gated MLP; qwen2 adds q/k/v biases, qwen3 RMS-normalises each query and
    key head), or "gemma3_text" (Gemma 3: embeddings scaled by sqrt(hidden_size), RMSNorm
    with (1 + weight), q/k norms, norms before and after both attention and MLP, GeGLU).
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
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad or len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_layers} layers; "
                                 f"got {list(self.layer_types)}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} is invalid; use None or a positive int")
        if self.model_type == "gpt2" and (self.sliding_window or self.qk_norm or self.local_rope_theta):
            raise ValueError("gpt2 models take no sliding_window, qk_norm or local_rope_theta")

    @property
    def sliding_layers(self) -> Tuple[bool, ...]:
        """Per layer: does it attend through the sliding window?"""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        if self.layer_types is None:
            return (True,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def is_gemma(self) -> bool:
        return self.model_type == "gemma3_text"

    @property
    def o_proj_bias(self) -> bool:
        """Does the attention output projection have a bias? (Hugging Face's
        `attention_bias` covers it, except in Qwen2, whose q/k/v biases are built in.)"""
        return self.qkv_bias and self.model_type != "qwen2"

    @property
    def rope_params(self) -> dict:
        return dict(self.rope_scaling or ())

    # ------------------------------------------------------------------ Hugging Face

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """From a transformers `PretrainedConfig` (or its dict): see `config_from_hf`."""
        return config_from_hf(hf)

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
        layer_types = None if self.sliding_window is None else [
            "sliding_attention" if s else "full_attention" for s in self.sliding_layers]
        if self.model_type == "llama":
            cls = transformers.LlamaConfig
            kwargs.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        elif self.model_type == "mistral":
            cls = transformers.MistralConfig
            kwargs.update(sliding_window=self.sliding_window)
        elif self.model_type == "qwen2":
            cls = transformers.Qwen2Config
            kwargs.update(use_sliding_window=self.sliding_window is not None, sliding_window=self.sliding_window,
                          layer_types=layer_types)
        elif self.model_type == "qwen3":
            cls = transformers.Qwen3Config
            kwargs.update(attention_bias=self.qkv_bias, use_sliding_window=self.sliding_window is not None,
                          sliding_window=self.sliding_window, layer_types=layer_types)
        else:
            cls = transformers.Gemma3TextConfig
            kwargs["hidden_activation"] = kwargs.pop("hidden_act")
            kwargs.update(attention_bias=self.qkv_bias, sliding_window=self.sliding_window, layer_types=layer_types,
                          query_pre_attn_scalar=self.query_pre_attn_scalar,
                          final_logit_softcapping=self.final_logit_softcapping)
            local = {"rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}
            rope = {"full_attention": rope, "sliding_attention": local}
        try:
            return cls(rope_parameters=rope, **kwargs)
        except TypeError:  # transformers < 5
            if self.model_type == "gemma3_text":
                kwargs["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
                rope = rope["full_attention"]
            rope_theta = rope.pop("rope_theta")
            scaling = None if rope.get("rope_type", "default") == "default" else rope
            return cls(rope_theta=rope_theta, rope_scaling=scaling, **kwargs)

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
    """The `ModelConfig` of a transformers `PretrainedConfig` (or its dict): the mapping of
    each supported architecture's Hugging Face fields."""
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
        tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in ("gpt2", "gemma3_text"))),
        num_labels=len(d.get("id2label") or {0: 0}) if d.get("num_labels") is None else d["num_labels"],
    )
    if model_type == "gpt2":
        if d.get("scale_attn_by_inverse_layer_idx") or d.get("reorder_and_upcast_attn"):
            raise ValueError("GPT-2 options scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
        if not d.get("scale_attn_weights", True):
            raise ValueError("GPT-2 with scale_attn_weights=False is not supported")
        n_embd = d["n_embd"]
        return ModelConfig(
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
    gemma = model_type == "gemma3_text"
    rope = dict(d.get("rope_parameters") or {})
    local_theta = None
    if gemma:
        # transformers >= 5: one rope dict per layer type; earlier: rope_theta,
        # rope_scaling (global layers) and rope_local_base_freq (sliding layers).
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3 sliding-layer rope_type {local['rope_type']!r} is not supported; "
                             "supported: default")
        local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
        rope = dict(rope.get("full_attention") or {})
        if not rope:
            rope = dict(d.get("rope_scaling") or {})
            rope["rope_theta"] = d.get("rope_theta", 1000000.0)
    elif not rope:  # transformers < 5: rope_theta and rope_scaling are separate
        rope = dict(d.get("rope_scaling") or {})
        rope["rope_theta"] = d.get("rope_theta", 10000.0)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    rope.setdefault("rope_type", "default")
    # Sliding-window attention: Mistral and Gemma 3 set `sliding_window` (Gemma per
    # `layer_types`); Qwen2/3 only with use_sliding_window (then per `layer_types`).
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not d.get("use_sliding_window"):
        window = None
    if model_type == "llama":
        window = None
    if gemma and d.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True is not a causal LM; not supported")
    layer_types = d.get("layer_types") if window is not None else None
    if gemma and layer_types is None and window is not None:
        pattern = d.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(d["num_hidden_layers"])]
    return ModelConfig(
        model_type=model_type,
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
        head_dim=d.get("head_dim"),
        intermediate_size=d["intermediate_size"],
        max_position_embeddings=d["max_position_embeddings"],
        norm_eps=d.get("rms_norm_eps", 1e-6),
        activation=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        qkv_bias=True if model_type == "qwen2" else bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        rope_theta=theta,
        rope_scaling=tuple(sorted((k, _hashable(v)) for k, v in rope.items())),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=window,
        layer_types=None if layer_types is None else tuple(layer_types),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
        final_logit_softcapping=d.get("final_logit_softcapping") if gemma else None,
        **common,
    )


def _hashable(value):
    if isinstance(value, list):
        return tuple(value)
    return value


ADDED_FIELDS = ("qk_norm", "sliding_window", "layer_types", "local_rope_theta", "query_pre_attn_scalar",
                "final_logit_softcapping")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
