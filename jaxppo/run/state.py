"""`RunState`: everything a run carries from one iteration to the next, as one pytree.

    RunState(train, kl, score_moments, iteration, skipped_iterations, key, entropy_coef,
             prompts_consumed, behind)

It is what a checkpoint holds (`checkpoint_tree`), with one exception: with LoRA the
frozen base weights are left out of the checkpoint (they are loaded again from the policy's
checkpoint path). The iteration's keys are `fold_in(key, iteration)`, so the state alone
determines everything a resumed run does next.
"""

from __future__ import annotations

from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxppo.update.minibatches import TrainState
from jaxppo.update.kl import KLControllerState, kl_controller
from jaxppo.update.stats import RunningMoments

__all__ = ["RunState"]


class RunState(flax.struct.PyTreeNode):
    """The state of a training run.

    Attributes:
      train: the `TrainState` (parameters, optimizer state, update counters).
      kl: the KL controller (`jaxppo.update.kl.KLControllerState`: beta, target, horizon).
      score_moments: running moments of the scores (`normalize_scores`).
      iteration: iterations completed (a Python int; the next iteration's index).
      skipped_iterations: iterations skipped for non-finite scores (`skip_nonfinite_scores`).
      key: the run's base PRNG key (typed); iteration i uses `fold_in(key, i)`.
      entropy_coef: the adaptive entropy coefficient (float32 scalar) with
        `LossConfig.entropy_target`, else None.
      prompts_consumed: with dynamic sampling (`RewardConfig.dynamic_sampling`), the
        prompts taken from the data stream so far (a Python int; the next iteration starts
        there); None otherwise (iteration i then takes the i-th slice of the stream).
      behind: with pipelined iterations (`SamplingConfig.max_staleness` k >= 1), the trained
        parameters (`TrainState.trained_params`) of iterations max(0, i - k) .. max(0, i - 1)
        for the run at iteration i, oldest first: the policies that iterations i .. i + k - 1
        are sampled from (`jaxppo.run.pipeline`); None when k = 0.
    """

    train: TrainState
    kl: KLControllerState
    score_moments: RunningMoments
    iteration: Any
    skipped_iterations: Any
    key: jax.Array
    entropy_coef: Any = None
    prompts_consumed: Any = None
    behind: Any = None

    @classmethod
    def create(cls, train: TrainState, *, seed: int, kl_coef: float, adaptive_kl_target: float = 0.0,
               kl_horizon: float = 1.0, entropy_coef: Optional[float] = None,
               dynamic_sampling: bool = False) -> "RunState":
        """A run at iteration 0: `train`, a KL controller at `kl_coef` (adaptive toward
        `adaptive_kl_target` when > 0), empty score moments, the key of `seed`, and the adaptive
        entropy coefficient's start (None: no adaptive coefficient), and the prompts
        consumed (0) with dynamic sampling."""
        return cls(train=train, kl=kl_controller(kl_coef, adaptive_kl_target, kl_horizon), score_moments=RunningMoments.zeros(),
                   iteration=0, skipped_iterations=0, key=jax.random.key(seed),
                   entropy_coef=None if entropy_coef is None else jnp.float32(entropy_coef),
                   prompts_consumed=0 if dynamic_sampling else None)

    def iteration_keys(self, iteration: int):
        """(sampling key, update key) of `iteration`."""
        return _iteration_keys(self.key, iteration)

    def checkpoint_tree(self) -> dict:
        """The tree a checkpoint saves (the 0.2.0 layout, unchanged): the trained parameters
        (with LoRA, the adapters and a critic, not the frozen base), optimizer state,
        counters, KL controller, score moments, iteration, skipped count and key data. Small
        host values are numpy: every process holds them whole (orbax cannot save
        process-local jax arrays in multi-host runs). With an adaptive entropy coefficient
        the tree also holds it ("entropy_coef"), with dynamic sampling the prompts consumed
        ("prompts_consumed"), with pipelined iterations the parameters still to be sampled
        from ("behind"); without any of them it is the 0.2.0 tree."""
        tree = {
            "params": self.train.trained_params(),
            "opt_state": self.train.opt_state,
            "step": self.train.step,
            "skipped_nonfinite": self.train.skipped_nonfinite,
            "kl": tuple(np.asarray(x) for x in self.kl),
            "score_moments": tuple(np.asarray(x) for x in self.score_moments),
            "iteration": np.asarray(self.iteration, np.int32),
            "skipped_iterations": np.asarray(self.skipped_iterations, np.int32),
            "key": np.asarray(jax.random.key_data(self.key)),
        }
        if self.entropy_coef is not None:
            tree["entropy_coef"] = np.asarray(self.entropy_coef, np.float32)
        if self.prompts_consumed is not None:
            tree["prompts_consumed"] = np.asarray(self.prompts_consumed, np.int64)
        if self.behind is not None:
            tree["behind"] = list(self.behind)
        return tree

    def restored(self, tree: dict) -> "RunState":
        """This state with a checkpoint's tree (as `checkpoint_tree` lays it out) put in."""
        train = self.train.with_trained(tree["params"]).replace(
            opt_state=tree["opt_state"], step=tree["step"], skipped_nonfinite=tree["skipped_nonfinite"])
        return self.replace(
            train=train,
            kl=KLControllerState(*(jnp.asarray(x, jnp.float32) for x in tree["kl"])),
            score_moments=RunningMoments(*(jnp.asarray(x, jnp.float32) for x in tree["score_moments"])),
            iteration=int(tree["iteration"]),
            skipped_iterations=int(tree["skipped_iterations"]),
            entropy_coef=jnp.float32(tree["entropy_coef"]) if "entropy_coef" in tree else self.entropy_coef,
            prompts_consumed=int(tree["prompts_consumed"]) if "prompts_consumed" in tree else self.prompts_consumed,
            behind=tuple(tree["behind"]) if "behind" in tree else self.behind)


@jax.jit
def _iteration_keys(key, iteration):
    """The two halves of split(fold_in(key, iteration)), as one compiled program."""
    keys = jax.random.split(jax.random.fold_in(key, iteration))
    return keys[0], keys[1]
