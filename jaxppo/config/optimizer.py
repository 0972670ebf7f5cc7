"""The optimizer's settings (`OptimizerConfig`), and the optimizer they build: one function,
`build_optimizer`, makes the optax transformation and the learning-rate schedule of a run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import jax
import optax

from jaxppo.config.fields import Concern, check_choice, check_real, setting
from jaxppo.update.checks import invalid, is_int
from jaxppo.update.minibatches import clip_by_global_norm, key_names

__all__ = ["OptimizerConfig", "LR_SCHEDULES", "DECAYED", "decay_mask", "schedule", "build_optimizer"]

LR_SCHEDULES = ("constant", "linear", "cosine", "cosine_with_min_lr")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig(Concern):
    """The optimizer of the trained models (the policy, and PPO's critic).

    Attributes:
      learning_rate: the policy's; > 0 (above 1 is warned about).
      critic_learning_rate: the critic's (a separate critic, or the value head of a shared
        trunk); None: `learning_rate`.
      lr_schedule: "constant", "linear" (decay to 0), "cosine" (to 0) or
        "cosine_with_min_lr" (to `min_lr_ratio * learning_rate`), over the run's updates.
      min_lr_ratio: in [0, 1); read by "cosine_with_min_lr" only.
      warmup_updates: linear warm-up from 0: an int >= 0 of updates, or a float in (0, 1):
        that fraction of the run's updates (TRL's `warmup_ratio`), rounded up.
      max_grad_norm: clip the gradient to this global norm first; None: no clipping.
      adam_eps, adam_beta1, adam_beta2: Adam's epsilon and decay rates (TRL's `adam_epsilon`,
        `adam_beta1`, `adam_beta2`).
      weight_decay: > 0: AdamW, decoupled decay on the linear layers' kernels and the LoRA
        matrices (not embeddings, norms and biases); 0: Adam.
      weight_decay_mask: "matrices" (as said) or "all" (every parameter).
      transformation: None (the built-in Adam / AdamW of the settings above), or an optax
        `GradientTransformation`, or a function of the learning-rate schedule returning
        one (`max_grad_norm` clipping still comes first). Not a flag of the command.
    """

    learning_rate: float = 1e-5
    critic_learning_rate: Optional[float] = None
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    warmup_updates: Union[int, float] = 0
    max_grad_norm: Optional[float] = 1.0
    adam_eps: float = 1e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    weight_decay: float = 0.0
    weight_decay_mask: str = "matrices"
    transformation: Any = setting(None, flag=False)

    def __post_init__(self):
        for name in ("learning_rate", "adam_eps"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise invalid("OptimizerConfig", name, value, "a finite number > 0")
        for name in ("critic_learning_rate", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                      or not math.isfinite(value) or value <= 0):
                raise invalid("OptimizerConfig", name, value, "None or a finite number > 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"OptimizerConfig.lr_schedule={self.lr_schedule!r} is invalid; valid: "
                             f"{', '.join(LR_SCHEDULES)}")
        check_real(self, "min_lr_ratio", 0.0, 1.0, high_open=True)
        if self.min_lr_ratio and self.lr_schedule != "cosine_with_min_lr":
            raise ValueError(f"OptimizerConfig.min_lr_ratio={self.min_lr_ratio} is read by lr_schedule="
                             f"'cosine_with_min_lr' only; lr_schedule is {self.lr_schedule!r}")
        w = self.warmup_updates
        if not ((is_int(w) and w >= 0) or (isinstance(w, float) and 0.0 <= w < 1.0)):
            raise invalid("OptimizerConfig", "warmup_updates", w,
                          "an int >= 0 (updates) or a float in [0, 1) (that fraction of the run's updates)")
        for name in ("adam_beta1", "adam_beta2"):
            check_real(self, name, 0.0, 1.0, high_open=True)
        check_real(self, "weight_decay", 0.0, note=" (0: Adam)")
        check_choice(self, "weight_decay_mask", ("matrices", "all"),
                     note=" ('matrices': linear layers' kernels and LoRA matrices)")
        t = self.transformation
        if t is not None and not isinstance(t, optax.GradientTransformation) and not callable(t):
            raise TypeError(f"OptimizerConfig.transformation={t!r} is invalid: None (the built-in Adam/AdamW), an optax "
                            "GradientTransformation, or a function of the learning-rate schedule returning one")
        _warn_rates(self)

    def warmup_for(self, total_updates: int) -> int:
        """The warm-up in updates for a run of `total_updates`."""
        w = self.warmup_updates
        return math.ceil(w * total_updates) if isinstance(w, float) else int(w)

    @property
    def warmup_is_fraction(self) -> bool:
        """The warm-up is a fraction of the run: its length follows the run's."""
        return isinstance(self.warmup_updates, float) and self.warmup_updates > 0


def _warn_rates(c: OptimizerConfig):
    import warnings

    for name in ("learning_rate", "critic_learning_rate"):  # legal, but almost surely a mistake
        value = getattr(c, name)
        if value is not None and value > 1:
            warnings.warn(f"OptimizerConfig.{name}={value!r} is above 1: Adam steps each parameter by about that much "
                          "per update, which destroys a pretrained model at once (typical: 1e-6 to 1e-4 for "
                          "language models)", UserWarning, stacklevel=4)


def schedule(lr, kind, warmup, total, min_lr_ratio: float = 0.0):
    """A learning-rate schedule over `total` updates: constant, linear decay to 0, cosine
    to 0, or cosine to `min_lr_ratio * lr` ("cosine_with_min_lr"), after `warmup` updates
    of linear warm-up from 0."""
    if kind == "constant":
        main = optax.constant_schedule(lr)
    elif kind == "linear":
        main = optax.linear_schedule(lr, 0.0, max(1, total - warmup))
    else:
        alpha = min_lr_ratio if kind == "cosine_with_min_lr" else 0.0
        main = optax.cosine_decay_schedule(lr, max(1, total - warmup), alpha=alpha)
    if warmup:
        return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), main], [warmup])
    return main


DECAYED = ("kernel", "lora_a", "lora_b")  # weight decay's default reach: the matrices of linear layers


def decay_mask(params):
    """True at the parameters weight decay reaches by default: linear layers' kernels and
    LoRA matrices; not embeddings, norms or biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: key_names(path)[-1] in DECAYED, params)


def _one(lr, c: OptimizerConfig) -> optax.GradientTransformation:
    """One model's optimizer at learning rate (or schedule) `lr`: global-norm clipping when
    `max_grad_norm`, then the `transformation` given or the built-in AdamW / Adam."""
    parts = [clip_by_global_norm(c.max_grad_norm)] if c.max_grad_norm else []
    custom = c.transformation
    if custom is not None:
        inner = custom if isinstance(custom, optax.GradientTransformation) else custom(lr)
        if not isinstance(inner, optax.GradientTransformation):
            raise TypeError(f"OptimizerConfig.transformation={custom!r} returned {type(inner).__name__}; give an optax "
                            "GradientTransformation, or a function of the learning-rate schedule returning one")
    elif c.weight_decay:
        inner = optax.adamw(lr, b1=c.adam_beta1, b2=c.adam_beta2, eps=c.adam_eps, weight_decay=c.weight_decay,
                            mask=decay_mask if c.weight_decay_mask == "matrices" else None)
    else:
        inner = optax.adam(lr, b1=c.adam_beta1, b2=c.adam_beta2, eps=c.adam_eps)
    return optax.chain(*parts, inner)


def build_optimizer(c: OptimizerConfig, total_updates: int, *, critic: bool, shared_trunk: bool = False):
    """(the policy's learning-rate schedule, the optax transformation of the trained
    parameters) for a run of `total_updates` updates: the policy alone (`critic=False`),
    the policy and a separate critic ({"policy", "critic"} params), or one model whose
    `value_head` has the critic's rate (`shared_trunk`)."""
    warmup = c.warmup_for(total_updates)
    policy_lr = schedule(c.learning_rate, c.lr_schedule, warmup, total_updates, c.min_lr_ratio)
    if not critic:
        return policy_lr, _one(policy_lr, c)
    critic_lr = schedule(c.critic_learning_rate or c.learning_rate, c.lr_schedule, warmup, total_updates,
                         c.min_lr_ratio)
    parts = {"policy": _one(policy_lr, c), "critic": _one(critic_lr, c)}
    if shared_trunk:
        # One model: the value head gets the critic's learning rate (the rest, or the LoRA
        # adapters when the base is frozen, the policy's).
        def labels(params):
            name = lambda path, _: "critic" if "value_head" in key_names(path) else "policy"
            return jax.tree_util.tree_map_with_path(name, params)
        return policy_lr, optax.multi_transform(parts, labels)
    return policy_lr, optax.multi_transform(parts, {"policy": "policy", "critic": "critic"})

