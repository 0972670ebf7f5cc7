"""Rollout engines: what samples the policy's completions, behind one interface.

    engine = engine_class(name, num_slots).create(spec, params, config, query_width=Q, mesh=mesh)
    engine.set_weights(policy_params, version)       # take new weights
    gen = engine.sample(prompt_ids, prompt_mask, key, num_generations=G, response_length=R)
      # GenerationOutput: tokens, the behaviour policy's log-probs, mask; each (B, R)
    gen = engine.sample(..., temperature=0.0)      # an evaluation's own temperature (0: greedy)
    engine.close()

The wing's rooms:

- `base`: what an engine is (`RolloutEngine`) and declares it can do (`Capabilities`);
- `registry`: the engines by name (`register_rollout_engine`, `engine_class`) and the one
  place a run's settings are checked against its engine (`check_settings`);
- `static`: the static sampler (`generate`), its multi-turn form that keeps the KV cache
  between turns (`first_turn`, `next_turn`) and `StaticEngine`, which runs them;
- `continuous`: continuous batching (`generate_continuous`, `generate_inflight`) and
  `ContinuousEngine`;
- `vllm`: vLLM's engines, in this process (`vllm.inprocess`) or on servers
  (`vllm.server`, their pool `vllm.pool`, the weight plugin `vllm.plugin`, NCCL
  `vllm.nccl`), loaded the first time their name is asked for.

Every sampler takes one `Sampling` value (`jaxppo.models.sampling`: temperature, filters,
penalty, stops, budget), which a run's spec gives (`RolloutSpec.sampling`). The built-in
engines are both named "jaxppo" (`SamplingConfig.num_slots` picks the continuous one). An
engine of your own is a subclass registered by name (`register_rollout_engine`) and chosen
with `SamplingConfig.rollout_engine` (docs/architecture.md, "Adding a rollout engine").
"""

from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.base import BuiltinEngine, Capabilities, RolloutEngine, takes_temperature
from jaxppo.rollout.engines.continuous import ContinuousEngine
from jaxppo.rollout.engines.registry import (BUILT_IN, PACKAGED, ROLLOUT_ENGINES, check_engine_name, check_settings,
                                             engine_class, inflight_missing, register_rollout_engine,
                                             rollout_engine_names, sample_responses, takes_server_urls)
from jaxppo.rollout.engines.static import StaticEngine

__all__ = ["Sampling", "Capabilities", "RolloutEngine", "BuiltinEngine", "StaticEngine", "ContinuousEngine", "BUILT_IN",
           "ROLLOUT_ENGINES", "PACKAGED", "register_rollout_engine", "rollout_engine_names", "engine_class",
           "check_engine_name", "check_settings", "inflight_missing", "takes_server_urls", "sample_responses",
           "takes_temperature"]
