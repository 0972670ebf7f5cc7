"""Built-in language models: GPT-2 and the Llama family (Llama 2/3, Qwen2) in Flax, value and
score heads, Hugging Face checkpoint import/export, tokenizers, and KV-cache sampling."""

from jaxppo.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from jaxppo.models.generate import GenerationOutput, filter_logits, generate
from jaxppo.models.hf import from_pretrained, params_from_hf_tensors, params_to_hf_tensors, save_pretrained
from jaxppo.models.model import KINDS, Model, PolicyAndCritic, stack_layers, unstack_layers
from jaxppo.models.tokenizer import decode_responses, encode_prompts, load_tokenizer
from jaxppo.models.transformer import default_positions

__all__ = [
    "ModelConfig",
    "SUPPORTED_MODEL_TYPES",
    "Model",
    "KINDS",
    "PolicyAndCritic",
    "stack_layers",
    "unstack_layers",
    "from_pretrained",
    "save_pretrained",
    "params_from_hf_tensors",
    "params_to_hf_tensors",
    "generate",
    "GenerationOutput",
    "filter_logits",
    "load_tokenizer",
    "encode_prompts",
    "decode_responses",
    "default_positions",
]
