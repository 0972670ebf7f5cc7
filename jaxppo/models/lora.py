"""LoRA layers: low-rank adapters on the built-in models' linear layers.

A `Model` with `lora=LoraConfig(rank, alpha, targets)` computes, in each targeted
projection, `x @ W + b + (alpha / rank) * (x @ A) @ B`, with A (in, rank) drawn at random
and B (rank, out) zero, so that training starts from the base model exactly. Its variables
are `{"params": base, "lora": adapters}`: the adapters are a Flax collection of their own
(`lora_a` / `lora_b` beside each targeted `kernel`, stacked on the layer axis with
`scan_layers`), so the trainer trains them alone (`jaxppo.Freeze` of "params") and the
reference policy is the same variables with `Model(adapters=False)`.

Hugging Face's module names select targets: `q_proj`, `k_proj`, `v_proj`, `o_proj`,
`gate_proj`, `up_proj`, `down_proj` (Llama family, Gemma 3), `c_attn`, `c_proj`, `c_fc`
(GPT-2; `c_proj` is both the attention and the MLP output, as in PEFT), or "all-linear"
(every projection in the blocks; not the LM head). With `vision=True`, a vision-language
model's vision encoder gets adapters too, on every linear layer of its blocks and merger
(what PEFT's "all-linear" reaches in the tower; not the patch embedding).

This module is the layer and its configuration. Adding adapters to a model's variables and
folding them back (`add_lora`, `merge_lora`) live in `jaxppo.models.adapters`; PEFT's file
format (`save_peft_adapter`, `load_peft_adapter`) in `jaxppo.models.peft`.
"""

from __future__ import annotations

import dataclasses
from typing import Tuple, Union

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.family import family_of

__all__ = ["LoraConfig", "LoraDense", "target_names", "tower_dense", "ALL_LINEAR"]

ALL_LINEAR = "all-linear"


def target_names(config: ModelConfig) -> dict:
    """{Hugging Face (and PEFT) target name: our block module names} for this architecture:
    its family's `lora_targets`."""
    return dict(family_of(config).lora_targets)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Rank, alpha (the adapters' output is scaled by alpha / rank) and target modules
    (Hugging Face module names, or "all-linear") of the language model; `vision`: a
    vision-language model's encoder gets adapters on all its linear layers too. Hashable."""

    rank: int = 8
    alpha: float = 16.0
    targets: Union[Tuple[str, ...], str] = ("q_proj", "v_proj")
    vision: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid; use a positive int (8, 16, 64 are typical)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r} is invalid; use a positive number (often 2 x rank)")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"LoraConfig.targets={self.targets!r} is invalid; give module names such as "
                             "('q_proj', 'v_proj') or 'all-linear'")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"LoraConfig.targets={targets!r}: 'all-linear' stands alone")
        if not isinstance(self.vision, bool):
            raise ValueError(f"LoraConfig.vision={self.vision!r} is invalid; use True (adapters on the vision encoder "
                             "too) or False")
        object.__setattr__(self, "targets", tuple(sorted(set(targets))))
        object.__setattr__(self, "alpha", float(self.alpha))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def modules(self, config: ModelConfig) -> frozenset:
        """Our module names that get adapters on a `config` model; ValueError for a target
        this architecture does not have, listing the valid ones."""
        names = target_names(config)
        if self.vision and config.vision is None:
            raise ValueError(f"LoraConfig.vision=True puts adapters on a vision encoder, which a {config.model_type} "
                             "model does not have; use vision=False")
        if self.targets == (ALL_LINEAR,):
            return frozenset(m for ms in names.values() for m in ms)
        unknown = [t for t in self.targets if t not in names]
        if unknown:
            raise ValueError(f"LoRA targets (LoraConfig.targets, --lora-targets) {unknown} are not linear layers of a "
                             f"{config.model_type} model; valid: "
                             f"{', '.join(names)} or '{ALL_LINEAR}'")
        return frozenset(m for t in self.targets for m in names[t])

    def tower(self, enabled: bool):
        """The vision encoder's adapters as its layers take them: (rank, scale, `enabled`),
        or None where the encoder has none."""
        return (self.rank, self.scale, enabled) if self.vision else None

    def hf_targets(self, config: ModelConfig) -> list:
        """The target names as PEFT records them (all-linear expanded)."""
        names = target_names(config)
        return sorted(names) if self.targets == (ALL_LINEAR,) else sorted(self.targets)


class LoraDense(nn.Module):
    """`nn.Dense` (same `kernel` / `bias` params and numerics) plus, in the "lora"
    collection, `lora_a` (in, rank) and `lora_b` (rank, out), float32, whose product scaled
    by `scale` is added to the output when `enabled`."""

    features: int
    use_bias: bool
    dtype: object
    param_dtype: object
    rank: int
    scale: float
    enabled: bool = True

    @nn.compact
    def __call__(self, x):
        d_in = x.shape[-1]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (d_in, self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype) if self.use_bias else None
        # A as PEFT initialises it (Kaiming-uniform with a = sqrt(5): U(+-1/sqrt(in))), B zero.
        a = self.variable("lora", "lora_a", lambda: nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")(
            self.make_rng("params"), (d_in, self.rank), jnp.float32))
        b = self.variable("lora", "lora_b", lambda: jnp.zeros((self.rank, self.features), jnp.float32))
        x = x.astype(self.dtype)
        y = jax.lax.dot_general(x, kernel.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        if bias is not None:
            y = y + bias.astype(self.dtype)
        if self.enabled:
            low = jax.lax.dot_general(x, a.value.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
            y = y + (self.scale * jax.lax.dot_general(low, b.value.astype(self.dtype),
                                                      (((low.ndim - 1,), (0,)), ((), ())))).astype(self.dtype)
        return y


def tower_dense(features: int, name: str, dtype, param_dtype, lora=None, use_bias: bool = True):
    """A vision encoder's linear layer: `nn.Dense`, or `LoraDense` where `lora` is the
    tower's adapters, (rank, scale, enabled) (`LoraConfig.tower`)."""
    if lora is None:
        return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, name=name)
    rank, scale, enabled = lora
    return LoraDense(features, use_bias, dtype, param_dtype, rank, scale, enabled, name=name)
