"""Rollouts: from prompts and a policy to a `RolloutBatch` the update consumes.

- `prompts`: the prompt set and the order it is walked in (`load_prompts`); `streams`: prompt
  sets read as the run goes (`PromptStream`, `mix_prompts`);
- `spec`: `RolloutSpec`, what is static about rollouts (made from a `jaxppo.Config`);
- `engines`: the rollout engines' wing: the interface (`RolloutEngine`, `Capabilities`)
  and registry, each built-in engine beside the compiled sampler it runs (static with its
  multi-turn form, continuous), and vLLM's (`engines.vllm`, loaded when first named); every
  sampler takes one `Sampling` value;
- `rewards`: reward functions as users write them, checked, weighted, with columns;
- `forward`: the forward pass over sampled responses (`finish_rollout`): log-probs,
  reference, values, scores, KL-shaped rewards;
- `environments` and `tools`: multi-turn episodes and tool calls;
- `dynamic`: DAPO's dynamic sampling.
"""

from jaxppo.errors import RewardError
from jaxppo.models.decoding import GenerationOutput
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines import Capabilities, RolloutEngine, register_rollout_engine, sample_responses
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.rollout.prompts import PromptStreamEnded, load_prompts
from jaxppo.rollout.streams import mix_prompts
from jaxppo.rollout.rewards import check_scores, nonfinite_rows
from jaxppo.rollout.engines.static import generate
from jaxppo.rollout.spec import RolloutSpec

__all__ = ["RolloutSpec", "sample_responses", "generate", "Sampling", "GenerationOutput", "finish_rollout", "Shaping",
           "check_scores", "nonfinite_rows", "RewardError", "RolloutEngine", "Capabilities", "register_rollout_engine",
           "load_prompts", "mix_prompts", "PromptStreamEnded"]
