"""The built-in model families, one module each, registered by `model_type` on import
(`jaxppo.models.family`): GPT-2 (`gpt2`), the Llama family (`llama`: Llama 2/3, Mistral,
Qwen2, Qwen3), Gemma 3, text and with images (`gemma3`), the mixtures of experts (`moe`: Qwen3-MoE, Mixtral) and
Qwen2.5-VL and Qwen3-VL (`qwen_vl`, images through `jaxppo.models.vision`)."""

from jaxppo.models.families import gemma3, gpt2, llama, moe, qwen_vl
from jaxppo.models.family import register_family

BUILT_IN = (gpt2.FAMILY, llama.FAMILY, gemma3.FAMILY, moe.QWEN3_MOE, moe.MIXTRAL, qwen_vl.FAMILY, qwen_vl.QWEN3_FAMILY,
            gemma3.VISION_FAMILY)
for _family in BUILT_IN:
    register_family(_family)

__all__ = ["BUILT_IN", "gpt2", "llama", "gemma3", "moe", "qwen_vl"]
