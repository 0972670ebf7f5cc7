"""Model families: everything about one family of architectures that the rest of
`jaxppo.models` asks, in one value, and the registry that finds a family by Hugging Face
`model_type`.

A family (`ModelFamily`) holds its block (a Flax module), how its trunk embeds tokens and
normalises the last hidden states, its Hugging Face names (config mapping both ways, the
tensor names of its block's modules, which kernels Hugging Face stores untransposed), its
LoRA targets and what the sampler must know of it (learned positions). The built-in
families live in `jaxppo.models.families` (GPT-2; the Llama family with Mistral, Qwen2 and
Qwen3; Gemma 3); a family of your own is registered with `register_family` (docs:
"Architecture", "Adding a model family"). Nothing outside the families and this registry
compares model-type strings (a structure test checks it).

This module is a leaf of `jaxppo.models` (it imports nothing of the package), so the
config, the trunk and the loaders can all ask it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["ModelFamily", "register_family", "family_of", "model_types", "unsupported_model_type", "to_hf_layout",
           "from_hf_layout"]


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFamily:
    """One family of causal transformers.

    Identity and Hugging Face configs:
      name: the family's name ("gpt2", "llama", "gemma3").
      model_types: the Hugging Face `model_type` values it loads, e.g. ("llama", "mistral").
      architectures: {model_type: (causal-LM class name, sequence-classification class
        name)} as Hugging Face names them, e.g. ("LlamaForCausalLM", "LlamaForSequenceClassification");
        None for a class transformers does not have (Qwen2.5-VL's classifier).
      config_from_hf: (config dict, common) -> ModelConfig, where `common` holds the fields
        every family reads alike (vocab_size, special token ids, tie_word_embeddings as the
        checkpoint states it or None, num_labels); the family fills in the rest.
      config_to_hf: (ModelConfig, architecture, common) -> a transformers config object;
        `common` holds the shared keyword arguments (vocab, token ids, tying, labels,
        architectures). None: the family cannot export to Hugging Face.
      check: ModelConfig -> None, raising ValueError for settings the family cannot run.
      tied_by_default: whether the LM head is tied to the embeddings when a checkpoint's
        config does not say.
      hints: {other model_type: sentence}: what to say when a checkpoint of a related,
        unsupported model_type is given (e.g. a multimodal sibling).

    The modules (parameter names mirror Hugging Face's, so conversion is a renaming):
      block: the Flax block, called as `block(config, dtype, param_dtype, lora, adapters,
        attention, name=...)(x, masks, positions, layer_cache, cache_index, sliding)` and
        returning (x, new k/v); see `jaxppo.models.transformer`.
      trunk_name: the trunk's module name ("model", "transformer").
      layers_prefix: the blocks' name prefix ("layers" gives layers_0, layers_1, ...).
      embed_name: the token embedding's module name ("embed_tokens", "wte").
      embed: (trunk module, config, input_ids, positions) -> (hidden (B, L, D), the token
        embedding table (V, D)), called inside the trunk (the modules it makes are the
        trunk's).
      final_norm: (trunk module, config) -> the final norm module, made inside the trunk.

    Hugging Face tensor names and adapters:
      hf_block_names: {block module name: Hugging Face sub-module path}, e.g.
        {"q_proj": "self_attn.q_proj"}; a module not named keeps its name.
      hf_untransposed: block modules whose kernels Hugging Face stores as (in, out), like
        Flax (GPT-2's Conv1D); every other kernel is transposed.
      hf_expert_names: {expert kernel name: Hugging Face per-expert module name} for a
        mixture of experts, whose kernels (E, in, out) under an `experts` module Hugging
        Face stores as one (out, in) tensor per expert, `...experts.{e}.<name>.weight`
        (e.g. Mixtral's {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}).
      lora_targets: {target name a user gives: block modules it covers}; "all-linear" is
        all of them.
      learned_positions: positions come from a table of `max_position_embeddings` rows (the
        sampler then refuses longer sequences and keeps finished rows inside the table).

    Vision-language families:
      vision: (trunk module, config, embeddings (B, L, D), input_ids, images) -> (the
        embeddings with the images' token embeddings at the image tokens, DeepStack's
        additions or None, each token's image or None), called inside the trunk after
        `embed` (the encoder's modules are the trunk's); `images` is the family's image
        input, or None (text only; at init the encoder's parameters are made all the same).
        DeepStack's additions (K, B, L, D) are added to the hidden states after each of the
        first K blocks (Qwen3-VL); each token's image (B, L), -1 for text, makes an image's
        tokens attend to each other both ways (Gemma 3).
      hf_checkpoint_name: (a checkpoint's tensor name) -> the name the family's mapping
        reads it by, or None for a tensor the model does not use (e.g. the one of a
        published layout that differs from what transformers saves); None: as they are.
      hf_trunk_name: the trunk's name in Hugging Face checkpoints where it is not
        `trunk_name` ("model.language_model" in Qwen3-VL's), or None.
      peft_trunk_name: the trunk's name in transformers' modules where it differs from the
        checkpoint's (Qwen2.5-VL: saved as "model", "model.language_model" in memory): PEFT
        names adapters by the modules; None where they agree.
      peft_tower_name: (the vision encoder's name in checkpoints, in transformers' modules)
        where they differ (Qwen2.5-VL: "visual", "model.visual"), or None.
      peft_exclude: a regular expression of the modules PEFT must leave alone (a vision
        encoder whose layers share the language model's names), or None.
      hf_extra_name: (flat param path, config) -> (Hugging Face name, layout) for parameters the
        block mapping does not name (a vision encoder), or None for the generic mapping;
        layout as `jaxppo.models.hf.hf_name` returns it (`to_hf_layout`).
      images: (config, image processor, tokenizer) -> how a run's prompts give the model
        their images (e.g. `jaxppo.models.vision.qwen_images.QwenImages`: the image tokens
        of each image, a batch's images processed into an `ImagePrompt`); with None for
        both, what a plan asks (the grid of an image size, the shapes of a batch's images).
    """

    name: str
    model_types: Tuple[str, ...]
    architectures: Mapping[str, Tuple[str, str]]
    config_from_hf: Callable[[dict, dict], Any]
    block: Any
    trunk_name: str
    layers_prefix: str
    embed_name: str
    embed: Callable
    final_norm: Callable
    hf_block_names: Mapping[str, str]
    lora_targets: Mapping[str, Tuple[str, ...]]
    config_to_hf: Optional[Callable] = None
    check: Callable[[Any], None] = lambda config: None
    tied_by_default: bool = False
    hints: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hf_untransposed: frozenset = frozenset()
    hf_expert_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    learned_positions: bool = False
    vision: Optional[Callable] = None
    hf_extra_name: Optional[Callable] = None
    hf_trunk_name: Optional[str] = None
    peft_trunk_name: Optional[str] = None
    peft_tower_name: Optional[Tuple[str, str]] = None
    peft_exclude: Optional[str] = None
    hf_checkpoint_name: Optional[Callable] = None
    images: Optional[Callable] = None

    def __post_init__(self):
        if not self.model_types or not all(isinstance(t, str) and t for t in self.model_types):
            raise ValueError(f"family {self.name!r}: model_types must be non-empty strings; got {self.model_types!r}")
        missing = [t for t in self.model_types if t not in self.architectures]
        if missing:
            raise ValueError(f"family {self.name!r}: architectures names no classes for model types {missing}")
        for field in ("trunk_name", "layers_prefix", "embed_name"):
            if not isinstance(getattr(self, field), str) or not getattr(self, field):
                raise ValueError(f"family {self.name!r}: {field} must be a non-empty string")

    @property
    def peft_fan_in_fan_out(self) -> bool:
        """PEFT's `fan_in_fan_out`: the adapted layers store (in, out) in Hugging Face."""
        return bool(self.hf_untransposed)

    def architecture(self, model_type: str, kind: str) -> str:
        """The Hugging Face class name of `model_type` for a causal LM ("causal_lm") or a
        sequence classifier (any other kind)."""
        causal, classifier = self.architectures[model_type]
        if kind != "causal_lm" and classifier is None:
            raise ValueError(f"a {model_type} model of kind {kind!r} has no Hugging Face class to export to "
                             "(transformers has no sequence classifier for it); keep its parameters with the run's "
                             "checkpoints, or export the causal LM")
        return causal if kind == "causal_lm" else classifier


_FAMILIES: Dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make `family` load, build, sample and export its model types. A model type another
    family already claims is refused unless `replace=True`. Returns the family."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a jaxppo.models.ModelFamily; got {type(family).__name__}")
    taken = {t: _FAMILIES[t].name for t in family.model_types if t in _FAMILIES and _FAMILIES[t] is not family}
    if taken and not replace:
        raise ValueError(f"model types already registered: {taken}; pass replace=True to take them over")
    for t in family.model_types:
        _FAMILIES[t] = family
    return family


def model_types() -> Tuple[str, ...]:
    """Every registered model type, in registration order."""
    return tuple(_FAMILIES)


def unsupported_model_type(model_type) -> str:
    """The sentence for a model type no family loads: what is supported, and a family's
    hint where one names this model type."""
    hints = [f.hints[model_type] for f in dict.fromkeys(_FAMILIES.values()) if model_type in f.hints]
    return (f"model_type {model_type!r} is not supported; supported model types: {', '.join(model_types())}"
            + "".join(f"; {h}" for h in hints))


def family_of(config_or_type) -> ModelFamily:
    """The family of a `ModelConfig` (or a model-type string); ValueError naming the
    supported types for one no family loads."""
    model_type = getattr(config_or_type, "model_type", config_or_type)
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ValueError(unsupported_model_type(model_type))
    return family


def to_hf_layout(array, layout):
    """A parameter as Hugging Face stores it, from a layout as `jaxppo.models.hf.hf_name`
    gives it: True (transposed: a torch Linear's (out, in)), a shape (transposed and reshaped
    to it: a convolution whose stride is its kernel, flat (in, out) here), False (as it is).
    Arrays of numpy, JAX or torch."""
    if isinstance(layout, tuple):
        return array.T.reshape(layout)
    return array.T if layout else array


def from_hf_layout(tensor, layout):
    """The inverse of `to_hf_layout`: a Hugging Face tensor in this package's layout."""
    if isinstance(layout, tuple):
        return tensor.reshape(tensor.shape[0], -1).T
    return tensor.T if layout else tensor
