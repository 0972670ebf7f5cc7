"""An iteration's data before its rollout is built: the prompts, the samples (the run's
rollout engine, single-turn or multi-turn episodes) and the host scores; with dynamic
sampling, the rounds of `jaxppo.rollout.dynamic.collect`."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, NamedTuple, Optional

from jaxppo.config import PPOConfig
from jaxppo.rollout import dynamic
from jaxppo.rollout.environments import EnvironmentSpec, run_episodes
from jaxppo.rollout.prompts import PromptBatch, PromptTable
from jaxppo.rollout.rewards import HostRewards
from jaxppo.rollout.engines import RolloutEngine
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.run import stages
from jaxppo.run.state import RunState
from jaxppo.trainer_config import TrainerConfig

__all__ = ["Collector", "Sampled"]


class Sampled(NamedTuple):
    """An iteration's prompts and samples before scoring, and with in-flight updates the
    version of the parameters behind each token ((B, R), else None)."""

    batch: PromptBatch
    gen: Any
    token_versions: Any = None


@dataclasses.dataclass(frozen=True)
class Collector:
    """What a run samples from and scores with, fixed for the run: `collect(run, it, key)`
    gives one iteration's `jaxppo.rollout.dynamic.Collected`.

    Attributes: the configs; the rollout spec; the prompt table; the tokenizer; the text
    reward functions (`HostRewards`, or None); the environment (`EnvironmentSpec`, or None:
    single-turn); the rollout engine (`jaxppo.rollout.engines.RolloutEngine`); the mesh (or
    None). The engine is given its weights and sampled under a lock: one batch at a time."""

    config: PPOConfig
    tc: TrainerConfig
    spec: RolloutSpec
    table: PromptTable
    tokenizer: Any
    host_rewards: Optional[HostRewards]
    environment: Optional[EnvironmentSpec]
    rollout_engine: RolloutEngine
    mesh: Any
    lock: Any = dataclasses.field(default_factory=threading.Lock, compare=False)

    def collect(self, run: RunState, it: int, key) -> dynamic.Collected:
        """The iteration's prompts, samples (or episodes) and host scores: one batch of the
        iteration's prompts, or with dynamic sampling the rounds of `dynamic.collect`."""
        if self.tc.dynamic_sampling:
            return dynamic.collect(self.table, key, run, it, self.config, self.tc,
                                   lambda batch, k: self.sample(run, batch, k, it),
                                   lambda batch, gen, episodes: self.score(batch, gen, episodes, it), self.mesh)
        batch = stages.select_prompts(self.table, run.key, it, self.config, self.mesh)
        gen, episodes = self.sample(run, batch, key, it)
        return dynamic.Collected(batch, gen, episodes, self.score(batch, gen, episodes, it), {}, None)

    @property
    def staged(self) -> bool:
        """Sampling and scoring are separate stages (`sample_stage`, `score_stage`): no
        dynamic sampling (whose rounds sample after scoring) and no environment (whose
        episodes step on the host between turns)."""
        return not self.tc.dynamic_sampling and self.environment is None

    def sample_stage(self, run: RunState, it: int, key) -> Sampled:
        """The first half of `collect` where `staged`: the prompts and the samples (possibly
        still being computed on the device). With in-flight updates
        (`TrainerConfig.inflight_updates`) and a `run.train` that offers `source()` (the
        newest parameters: `jaxppo.run.pipeline.SamplerView`), the continuous-batching
        engine takes new parameters while it decodes and the version of each token comes
        along."""
        batch = stages.select_prompts(self.table, run.key, it, self.config, self.mesh)
        source = getattr(run.train, "source", None)
        if self.tc.inflight_updates and source is not None:
            with self.lock, stages.mesh_context(self.mesh):
                gen, versions = self.rollout_engine.sample_inflight(
                    source, batch.ids, batch.mask, key, on_update=self.tc.inflight_updates,
                    steps=self.tc.inflight_steps)
            return Sampled(batch, gen, versions)
        return Sampled(batch, self.sample(run, batch, key, it)[0], None)

    def score_stage(self, sampled: Sampled, it: int) -> dynamic.Collected:
        """The second half: the host scores of `sample_stage`'s batch."""
        batch, gen, _ = sampled
        return dynamic.Collected(batch, gen, None, self.score(batch, gen, None, it), {}, None)

    def sample(self, run: RunState, batch: PromptBatch, key, it: int):
        """(the batch's sampled responses, None), or with an environment (its episodes'
        `EpisodeOutput`, the `Episodes`)."""
        spec, engine = self.spec, self.rollout_engine
        version = getattr(run.train, "version", run.iteration)  # iterations the parameters are after
        with self.lock:
            engine.set_weights(spec.policy_params(run.train.params), version)
            if self.environment is None:
                with stages.mesh_context(self.mesh):
                    return engine.sample(batch.ids, batch.mask, key, num_generations=spec.num_generations,
                                         response_length=spec.response_length), None
            episodes = run_episodes(self.environment, spec, run.train.params, self.table, batch, key, self.tokenizer,
                                    it, self.mesh, engine=engine)
        return episodes.output, episodes

    def score(self, batch: PromptBatch, gen, episodes, it: int):
        """The host scores of the batch (`jaxppo.run.stages.score`)."""
        return stages.score(self.host_rewards, self.tokenizer, self.table, batch, gen, it, episodes)
