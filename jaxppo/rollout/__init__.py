"""Rollouts: from prompts and a policy to a `RolloutBatch` the update consumes.

- `prompts`: the prompt set and the order it is walked in (`load_prompts`, `mix_prompts`);
- `spec`: `RolloutSpec`, what is static about rollouts (made from a `jaxppo.Config`);
- `engines`: the rollout-engine interface (`RolloutEngine`, `Capabilities`), the built-in
  engines (static, continuous) and their registry; `samplers`: the compiled samplers
  the built-in engines drive (static, continuous, multi-turn with kept KV caches);
- `rewards`: reward functions as users write them, checked, weighted, with columns;
- `forward`: the forward pass over sampled responses (`finish_rollout`): log-probs,
  reference, values, scores, KL-shaped rewards;
- `environments` and `tools`: multi-turn episodes and tool calls;
- `dynamic`: DAPO's dynamic sampling;
- `vllm`: vLLM as a rollout engine ("vllm"; its module loads when the name is first used).
"""

from jaxppo.errors import RewardError
from jaxppo.models.decoding import GenerationOutput
from jaxppo.rollout.engines import Capabilities, RolloutEngine, register_rollout_engine, sample_responses
from jaxppo.rollout.forward import finish_rollout
from jaxppo.rollout.prompts import PromptStreamEnded, load_prompts, mix_prompts
from jaxppo.rollout.rewards import check_scores, nonfinite_rows
from jaxppo.rollout.samplers.static import generate
from jaxppo.rollout.spec import RolloutSpec

__all__ = ["RolloutSpec", "sample_responses", "generate", "GenerationOutput", "finish_rollout", "check_scores",
           "nonfinite_rows", "RewardError", "RolloutEngine", "Capabilities", "register_rollout_engine", "load_prompts",
           "mix_prompts", "PromptStreamEnded"]
