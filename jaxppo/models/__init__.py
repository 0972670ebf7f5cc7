"""Built-in language models: GPT-2, the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and
Gemma 3 in Flax, each a family registered by `model_type` (`jaxppo.models.families`; add
your own with `register_family`), value and score heads, LoRA adapters (PEFT format),
Hugging Face checkpoint import/export, tokenizers, and the KV-cache decoding primitives
(`decoding`) the samplers of `jaxppo.rollout.engines` are made of."""

from jaxppo.models.config import ModelConfig
from jaxppo.models.family import ModelFamily, family_of, model_types, register_family
from jaxppo.models.decoding import GenerationOutput, filter_logits
from jaxppo.models.sampling import Sampling
from jaxppo.models.lora import LoraConfig
from jaxppo.models.adapters import add_lora, merge_lora
from jaxppo.models.peft import load_peft_adapter, save_peft_adapter
from jaxppo.models.hf import from_pretrained, params_from_hf_tensors, params_to_hf_tensors, save_pretrained
from jaxppo.models.model import KINDS, Model, PolicyAndCritic, check_attention_backend, stack_layers, unstack_layers
from jaxppo.models.stops import StopStrings
from jaxppo.models.tokenizer import decode_responses, encode_prompts, load_tokenizer
from jaxppo.models.transformer import ATTENTION, default_positions
from jaxppo.models import families  # registers the built-in families

__all__ = [
    "ModelConfig",
    "LoraConfig",
    "add_lora",
    "merge_lora",
    "save_peft_adapter",
    "load_peft_adapter",
    "ModelFamily",
    "register_family",
    "family_of",
    "model_types",
    "families",
    "Model",
    "KINDS",
    "PolicyAndCritic",
    "stack_layers",
    "unstack_layers",
    "from_pretrained",
    "save_pretrained",
    "params_from_hf_tensors",
    "params_to_hf_tensors",
    "GenerationOutput",
    "Sampling",
    "filter_logits",
    "StopStrings",
    "load_tokenizer",
    "encode_prompts",
    "decode_responses",
    "default_positions",
    "ATTENTION",
    "check_attention_backend",
]
