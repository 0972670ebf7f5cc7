"""`PPOConfig`: the sizes and coefficients of one PPO update, validated up front.

The config is a frozen dataclass, so it is hashable and can be passed to `jax.jit` as a
static argument: every size in it is part of the compiled shape of the update loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

__all__ = ["PPOConfig"]


def _is_int(value) -> bool:
    # bool is a subclass of int; a bool where a count is due is a mistake, not a 0/1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _fail(field: str, value, valid: str):
    raise ValueError(f"PPOConfig.{field}={value!r} is invalid: {field} must be {valid}.")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """Sizes and coefficients of a PPO update (one `train_step`).

    Sizes (all counts of rollout rows, global over all devices):
      batch_size: rows collected per PPO iteration (one rollout).
      mini_batch_size: rows per optimizer update. `batch_size % mini_batch_size == 0`.
      ppo_epochs: passes over the rollout per iteration, each with a fresh permutation.
      gradient_accumulation_steps: micro-batches one mini-batch is split into to cut memory;
        still exactly one optimizer update per mini-batch.
        `mini_batch_size % gradient_accumulation_steps == 0`.

    Loss coefficients:
      cliprange: PPO ratio clip epsilon (ratio is clipped to [1 - c, 1 + c]); >= 0.
      cliprange_value: value clip range around the old values; >= 0.
      vf_coef: weight of the value loss in the total loss; >= 0.
      ent_coef: weight of the entropy bonus (subtracted from the loss); >= 0.

    Advantages:
      gamma: discount per token, in [0, 1].
      lam: GAE lambda, in [0, 1].
      whiten_advantages: whiten advantages over the whole rollout (masked) before updates.
      whiten_rewards: whiten per-token rewards (no mean shift) before GAE.

    Sampling and early stopping:
      temperature: logits are divided by this before log-softmax, as at sampling time; > 0.
      target_kl: if set (> 0), once a mini-batch's approximate KL (measured before its
        update) exceeds it, that update and every later one in the same `train_step` are
        not applied. None disables early stopping.

    RLHF rollout (used by the rollout layer, not by the update itself):
      kl_coef: initial beta of the KL penalty in the per-token rewards; >= 0.
    """

    batch_size: int = 64
    mini_batch_size: int = 16
    ppo_epochs: int = 4
    gradient_accumulation_steps: int = 1
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    temperature: float = 1.0
    target_kl: Optional[float] = None
    kl_coef: float = 0.05

    def __post_init__(self):
        for name in ("batch_size", "mini_batch_size", "ppo_epochs", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not _is_int(value):
                _fail(name, value, f"a positive int (got type {type(value).__name__})")
            if value <= 0:
                _fail(name, value, "a positive int")
        if self.batch_size % self.mini_batch_size != 0:
            raise ValueError(
                f"PPOConfig.batch_size={self.batch_size} is not divisible by "
                f"PPOConfig.mini_batch_size={self.mini_batch_size}: every rollout row must "
                f"land in exactly one mini-batch per epoch. Valid mini_batch_size values for "
                f"this batch_size: {_divisors(self.batch_size)}."
            )
        if self.mini_batch_size % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"PPOConfig.mini_batch_size={self.mini_batch_size} is not divisible by "
                f"PPOConfig.gradient_accumulation_steps={self.gradient_accumulation_steps}: "
                f"a mini-batch must split into equal micro-batches. Valid "
                f"gradient_accumulation_steps values: {_divisors(self.mini_batch_size)}."
            )
        for name in ("cliprange", "cliprange_value", "vf_coef", "ent_coef", "kl_coef"):
            value = getattr(self, name)
            if not _is_real(value) or value < 0:
                _fail(name, value, "a finite real number >= 0")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                _fail(name, value, "a real number in [0, 1]")
        for name in ("whiten_advantages", "whiten_rewards"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                _fail(name, value, "a bool (True or False)")
        if not _is_real(self.temperature) or self.temperature <= 0:
            _fail("temperature", self.temperature, "a finite real number > 0")
        if self.target_kl is not None and (not _is_real(self.target_kl) or self.target_kl <= 0):
            _fail("target_kl", self.target_kl, "None (no early stopping) or a finite real number > 0")

    @property
    def num_minibatches(self) -> int:
        """Optimizer updates per epoch: `batch_size // mini_batch_size`."""
        return self.batch_size // self.mini_batch_size

    @property
    def micro_batch_size(self) -> int:
        """Rows per gradient computation: `mini_batch_size // gradient_accumulation_steps`."""
        return self.mini_batch_size // self.gradient_accumulation_steps

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates planned per `train_step`: `ppo_epochs * num_minibatches`."""
        return self.ppo_epochs * self.num_minibatches

    def replace(self, **changes) -> "PPOConfig":
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]
