"""What an algorithm is, as a value: an advantage estimator (how advantages, and a
critic's returns, come from a rollout) and a preset (the settings that define a published
method, with its source). The registry in `jaxppo.algorithms` maps names to them;
`jaxppo.Config` validates against it, and the CLI help, the demo and the docs read it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp

from jaxppo.update.stats import masked_sum

__all__ = ["Advantages", "AdvantageEstimator", "EstimatorConfig", "Algorithm", "loss_terms", "sequence_scores"]


class Advantages(NamedTuple):
    """What an estimator returns for a whole rollout.

    advantages: (B, R) float32, 0 at padding. returns: (B, R), the critic's regression
    target, or None without a critic. stats: scalar metrics of the rollout (e.g.
    `frac_reward_zero_std`)."""

    advantages: jax.Array
    returns: Optional[jax.Array]
    stats: dict


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """What an estimator's `compute` is handed: the run's `jaxppo.AdvantageConfig` (each of
    its settings readable here by its name: `config.gamma`, `config.grpo_scale`) and the
    size of a prompt's group, `num_generations` (`jaxppo.BatchConfig`'s: a batch shape, not
    an advantage setting). Frozen and hashable, as the update's static config is."""

    advantages: Any
    num_generations: int = 1

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "advantages":  # copying and pickling look for these first
            raise AttributeError(name)
        return getattr(self.advantages, name)


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """One way of turning a rollout into advantages.

    Attributes:
      name: the value of `AdvantageConfig.advantage_estimator`.
      compute: `compute(rollout, config) -> Advantages`, pure and jittable, `config` an
        `EstimatorConfig`: the run's `jaxppo.AdvantageConfig` settings by name (gamma, lam,
        whitening, grpo_scale, grpo_eps, ...) and `num_generations`; reads the rollout's
        `rewards`, `response_mask`, and `scores` / `values` as it needs.
      uses_critic: needs a value model (`values` in the rollout, a value loss, returns).
      min_generations: the least `num_generations` it accepts (2 for the estimators that
        compare the completions of a prompt).
      per_token: advantages vary along a completion (GAE, REINFORCE++ returns) rather
        than one number per completion; a sequence-level importance ratio (GSPO) needs
        one number per completion and refuses these.
      config_fields: the settings it reads (documentation, and the CLI help).
      metrics: names of the statistics it adds to `train_step`'s metrics.
      uses_reference: reads the frozen model's log-probs of the sampled tokens
        (`rollout.ref_logprobs`: on-policy distillation's teacher), so a run builds and
        scores that model whatever its KL settings.
      summary: one line for tables and help.
    """

    name: str
    compute: Callable
    summary: str
    uses_critic: bool = False
    min_generations: int = 1
    per_token: bool = False
    config_fields: Tuple[str, ...] = ()
    metrics: Tuple[str, ...] = ()
    uses_reference: bool = False


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A published method: the settings that define it, by name (everything else, such as
    the batch sizes, stays the user's; every field may be overridden), and where its
    defaults come from.

    `estimator` names its `AdvantageEstimator`; `settings` includes
    `advantage_estimator=estimator`. Which loss terms apply follows from a config
    (`loss_terms`), and so do the models it needs (`needs_critic`, `needs_reference`)."""

    name: str
    settings: Mapping
    source: str
    summary: str

    @property
    def estimator(self) -> str:
        return self.settings["advantage_estimator"]


def loss_terms(config) -> Tuple[str, ...]:
    """The terms of the loss a `jaxppo.Config` trains with, in the order the loss adds them:
    "policy" (always), "value" (a critic), "entropy" (ent_coef > 0, or an adaptive
    coefficient: `entropy_target`), "kl" (kl_loss_coef > 0), "distill" (the divergence to a
    teacher's top k: `distill_top_k` > 0)."""
    terms = ["policy"]
    if config.uses_critic:
        terms.append("value")
    if config.loss.ent_coef or config.loss.entropy_target is not None:
        terms.append("entropy")
    if config.kl.kl_loss_coef:
        terms.append("kl")
    if config.advantages.distill_top_k:
        terms.append("distill")
    return tuple(terms)


def sequence_scores(rollout):
    """(B,) each completion's score: `rollout.scores` when the rollout carries it (the
    trainer's rollouts: the sequence score plus any per-token KL penalty), else the sum of
    its per-token rewards over real tokens (rollouts built by hand)."""
    if getattr(rollout, "scores", None) is not None:
        return rollout.scores.astype(jnp.float32)
    return masked_sum(rollout.rewards.astype(jnp.float32), rollout.response_mask.astype(jnp.float32), axis=1)
