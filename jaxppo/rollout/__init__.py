"""Rollouts: from prompts and a policy to a `Rollout` the update consumes.

- `prompts`: the prompt set and the order it is walked in;
- `sampling`: `RolloutSpec` (what is static about rollouts) and sampling responses;
- `rewards`: reward functions as users write them, checked, weighted, with columns;
- `scoring`: the scoring pass (`finish_rollout`): log-probs, reference, values, scores,
  KL-shaped rewards;
- `environments` and `tools`: multi-turn episodes and tool calls;
- `dynamic`: DAPO's dynamic sampling;
- `vllm`: vLLM as the rollout engine.
"""

from jaxppo.errors import RewardError
from jaxppo.rollout.rewards import check_scores, nonfinite_rows
from jaxppo.rollout.sampling import RolloutSpec, sample_responses
from jaxppo.rollout.scoring import finish_rollout

__all__ = ["RolloutSpec", "sample_responses", "finish_rollout", "check_scores", "nonfinite_rows", "RewardError"]
