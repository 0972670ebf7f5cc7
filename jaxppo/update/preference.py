"""The reward model's loss: Bradley-Terry on preference pairs, as TRL 1.12's `RewardTrainer`
computes it, and the pure loss function the mini-batch loop (`update_epochs`) walks.

For pairs i with scores r_c (chosen) and r_r (rejected) and an optional margin m_i:

    loss = mean_i -log sigmoid(r_c,i - r_r,i - m_i)
         + center_rewards_coefficient * mean_i (r_c,i + r_r,i)^2      (when given)

The second term (Eisenstein et al. 2023, eq. 2) pulls the scores towards mean zero. A
mini-batch is a batch of pairs; each pair's chosen and rejected sequences are scored in one
forward pass of 2 x pairs rows.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

__all__ = ["bradley_terry_loss", "pair_scores", "preference_loss_fn"]


def bradley_terry_loss(chosen, rejected, margin=None, center_rewards_coefficient: Optional[float] = None):
    """(loss, stats) of scores `chosen` and `rejected` (each (P,) float) and optional
    margins (P,): the mean Bradley-Terry loss above, plus the centring term when
    `center_rewards_coefficient` is given. `stats`: accuracy (the share of pairs whose
    chosen score is strictly higher, TRL's), margin (mean r_c - r_r), chosen and rejected
    (mean scores), all float32 scalars."""
    chosen = chosen.astype(jnp.float32)
    rejected = rejected.astype(jnp.float32)
    diff = chosen - rejected
    shifted = diff if margin is None else diff - margin.astype(jnp.float32)
    loss = -jnp.mean(jax.nn.log_sigmoid(shifted))
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * jnp.mean(jnp.square(chosen + rejected))
    stats = {"accuracy": jnp.mean((chosen > rejected).astype(jnp.float32)), "margin": jnp.mean(diff),
             "chosen": jnp.mean(chosen), "rejected": jnp.mean(rejected)}
    return loss, stats


def pair_scores(apply_fn, params, tokens, mask):
    """Scores (chosen (P,), rejected (P,)) of pairs `tokens`/`mask` (P, 2, L), the chosen
    sequence first: one forward pass of the 2P sequences, chosen rows then rejected rows
    (as TRL's collator stacks them). `apply_fn(params, ids, mask) -> (rows,)` scores at
    each row's last real token that is not padding (`Model.apply` of a "reward" model)."""
    p, _, length = tokens.shape
    ids = jnp.concatenate([tokens[:, 0], tokens[:, 1]], axis=0)
    attention = jnp.concatenate([mask[:, 0], mask[:, 1]], axis=0)
    scores = apply_fn(params, ids, attention)
    if scores.shape != (2 * p,):
        raise ValueError(f"the reward model must give one score per sequence, shape ({2 * p},); it gave "
                         f"{scores.shape} for {2 * p} sequences of length {length} (a model with num_labels=1)")
    return scores[:p], scores[p:]


def preference_loss_fn(apply_fn, center_rewards_coefficient: Optional[float] = None):
    """`loss_fn(params, minibatch) -> (loss, stats)` for `update_epochs`: `minibatch` a dict
    of "tokens" and "mask" (P, 2, L) and "margin" (P,) (zeros where the pairs have none:
    the loss is then TRL's without a margin). A mean over pairs, so gradient accumulation
    over equal micro-batches gives exactly the mini-batch's gradient."""

    def loss_fn(params, minibatch):
        chosen, rejected = pair_scores(apply_fn, params, minibatch["tokens"], minibatch["mask"])
        return bradley_terry_loss(chosen, rejected, minibatch["margin"], center_rewards_coefficient)

    return loss_fn
