"""Rollouts: from prompts and a policy to a `RolloutBatch` the update consumes.

- `prompts`: the prompt set and the order it is walked in;
- `sampling`: `RolloutConfig` (the rollout's settings) and `RolloutSpec` (what is static
  about rollouts);
- `engines`: the rollout-engine interface (`RolloutEngine`, `Capabilities`), the built-in
  engines (static, continuous) and their registry; `samplers`: the compiled samplers
  the built-in engines drive (static, continuous, multi-turn with kept KV caches);
- `rewards`: reward functions as users write them, checked, weighted, with columns;
- `scoring`: the scoring pass (`finish_rollout`): log-probs, reference, values, scores,
  KL-shaped rewards;
- `environments` and `tools`: multi-turn episodes and tool calls;
- `dynamic`: DAPO's dynamic sampling;
- `vllm`: vLLM as a rollout engine ("vllm"; registered on import).
"""

from jaxppo.errors import RewardError
from jaxppo.rollout import vllm  # registers the "vllm" rollout engine
from jaxppo.rollout.engines import Capabilities, RolloutEngine, register_rollout_engine, sample_responses
from jaxppo.rollout.rewards import check_scores, nonfinite_rows
from jaxppo.rollout.sampling import RolloutSpec
from jaxppo.rollout.scoring import finish_rollout

__all__ = ["RolloutSpec", "sample_responses", "finish_rollout", "check_scores", "nonfinite_rows", "RewardError",
           "RolloutEngine", "Capabilities", "register_rollout_engine", "vllm"]
