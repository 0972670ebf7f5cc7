"""Which weights train: every weight of the policy, or LoRA adapters on a frozen base
(`AdapterConfig`; `jaxppo.models.lora`)."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from jaxppo.config.fields import Concern, check_bools, check_counts, check_real
from jaxppo.models.lora import ALL_LINEAR, LoraConfig
from jaxppo.update.checks import invalid

__all__ = ["AdapterConfig", "DEFAULT_TARGETS"]

DEFAULT_TARGETS = (ALL_LINEAR,)


@dataclasses.dataclass(frozen=True)
class AdapterConfig(Concern):
    """LoRA: train low-rank adapters on the policy's linear layers instead of every weight.
    The base stays frozen (in `LayoutConfig.dtype`); the reference is the policy with its
    adapters off; the final export adds `final_adapter/` in PEFT's format. Off by default.

    Attributes:
      lora_rank: None (train every weight) or the adapters' rank (8, 16, 64 ...).
      lora_alpha: the adapters' output is scaled by alpha / rank; None: 2 x rank.
      lora_targets: the Hugging Face module names that get adapters ("q_proj", "v_proj",
        ...; GPT-2: "c_attn", "c_proj", "c_fc"), or "all-linear" (the default: every
        linear layer of the trunk). A text with commas is split ("q_proj,v_proj").
      lora_init: a PEFT LoRA adapter directory to start from (its rank, alpha and targets
        apply; give no lora_rank with it).
      train_vision_encoder: a vision-language policy's vision encoder trains with the rest
        of the policy: every weight of it in full fine-tuning; with `lora_rank`, adapters
        on all its linear layers (blocks and merger) beside the language model's. False
        (the default): it stays frozen (no gradient, no optimizer state; the images'
        features are the initial encoder's). With `lora_init`, the adapter decides.

    A resumed run must match these: the run's settings record them as the policy's adapters
    (with the adapter directory's path), where runs before 0.5 recorded them.
    """

    lora_rank: Optional[int] = None
    lora_alpha: Optional[float] = None
    lora_targets: Tuple[str, ...] = DEFAULT_TARGETS
    lora_init: Optional[str] = None
    train_vision_encoder: bool = False

    def __post_init__(self):
        if self.lora_rank is not None:
            check_counts(self, ("lora_rank",))
        if self.lora_alpha is not None:
            check_real(self, "lora_alpha", 0.0, low_open=True, note=" (None: 2 x lora_rank)")
        targets = self.lora_targets
        if isinstance(targets, str):
            targets = (targets,)
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise invalid("AdapterConfig", "lora_targets", self.lora_targets,
                          "module names such as ('q_proj', 'v_proj'), or 'all-linear'")
        targets = tuple(part.strip() for t in targets for part in t.split(",") if part.strip())
        if not targets or (ALL_LINEAR in targets and len(targets) > 1):
            raise invalid("AdapterConfig", "lora_targets", self.lora_targets,
                          "module names such as ('q_proj', 'v_proj'), or 'all-linear' alone")
        object.__setattr__(self, "lora_targets", targets)
        if self.lora_init is not None and (not isinstance(self.lora_init, str) or not self.lora_init):
            raise invalid("AdapterConfig", "lora_init", self.lora_init, "None or a PEFT adapter directory")
        if self.lora_init is not None and self.lora_rank is not None:
            raise ValueError(f"AdapterConfig.lora_init={self.lora_init!r} takes its rank, alpha and targets from the "
                             f"adapter; drop lora_rank={self.lora_rank} (or lora_init)")
        check_bools(self, ("train_vision_encoder",))
        if self.train_vision_encoder and self.lora_init is not None:
            raise ValueError(f"AdapterConfig.train_vision_encoder=True with lora_init={self.lora_init!r}: the adapter "
                             "decides where adapters are (on the vision encoder where it has the encoder's tensors); "
                             "drop train_vision_encoder")
        if self.lora_rank is None and self.lora_init is None:
            given = [name for name, default in (("lora_alpha", None), ("lora_targets", DEFAULT_TARGETS))
                     if getattr(self, name) != default]
            if given:
                raise ValueError(f"AdapterConfig: {' and '.join(given)} need lora_rank (or lora_init): without a rank "
                                 "every weight trains and there are no adapters to shape")

    @property
    def lora(self) -> Optional[LoraConfig]:
        """The adapters as the model takes them (`jaxppo.models.LoraConfig`), or None (no
        rank: full fine-tuning, or the adapter of `lora_init`)."""
        if self.lora_rank is None:
            return None
        alpha = 2.0 * self.lora_rank if self.lora_alpha is None else self.lora_alpha
        return LoraConfig(rank=self.lora_rank, alpha=alpha, targets=self.lora_targets,
                          vision=self.train_vision_encoder)

    @classmethod
    def of(cls, lora: Optional[LoraConfig], lora_init: Optional[str] = None) -> dict:
        """The settings that say `lora` (a `jaxppo.models.LoraConfig`) and `lora_init`, by
        name (for `Config.replace`)."""
        out = {} if lora_init is None else {"lora_init": str(lora_init)}
        if lora is not None:
            out.update(lora_rank=lora.rank, lora_alpha=lora.alpha, lora_targets=tuple(lora.targets))
            if lora.vision:
                out.update(train_vision_encoder=True)
        return out
