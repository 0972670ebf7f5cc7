"""Qwen's vision-language models: Qwen2.5-VL (`qwen2_5_vl`,
`Qwen2_5_VLForConditionalGeneration`), Qwen2's language model with three-dimensional rotary
positions (M-RoPE) and a vision transformer (`jaxppo.models.vision.qwen`) whose image token
embeddings replace the embeddings of the text's image tokens; and Qwen3-VL (`qwen3_vl`,
`Qwen3VLForConditionalGeneration`), Qwen3's language model with interleaved M-RoPE and
Qwen3-VL's vision transformer (`jaxppo.models.vision.qwen3`), whose DeepStack features are
added to the image tokens' hidden states after the language model's first layers. The
images come as a `jaxppo.models.vision.ImageInput`; the positions of a prompt with images
from `jaxppo.models.vision.mrope_positions` (the same for both)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.families import llama
from jaxppo.models.vision.qwen import (ImageInput, QwenVisionConfig, QwenVisionEncoder, smallest_image_input,
                                       vision_hf_name)
from jaxppo.models.vision.prompt import image_slots, merge_images, row_encoder, take_slots
from jaxppo.models.vision.qwen3 import Qwen3VisionConfig, Qwen3VisionEncoder, vision3_hf_name

__all__ = ["FAMILY", "QWEN3_FAMILY", "deepstack_additions"]

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
ARCHITECTURE_3 = "Qwen3VLForConditionalGeneration"


def _config(d: dict, common: dict, model_type: str, text_type: str, vision) -> ModelConfig:
    """A Qwen-VL config: the language model's (as `text_type`'s) with M-RoPE, and the vision
    config class `vision`'s."""
    if "vision_config" not in d or "image_token_id" not in d:
        raise KeyError("vision_config and image_token_id")
    text = llama._from_hf(dict(d, model_type=text_type), common)
    if text.mrope_section is None:
        raise ValueError(f"a {model_type} config's rope parameters must give mrope_section")
    return dataclasses.replace(text, model_type=model_type, vision=vision.from_hf(d["vision_config"]),
                               image_token_id=int(d["image_token_id"]))


def _from_hf(d: dict, common: dict) -> ModelConfig:
    return _config(d, common, "qwen2_5_vl", "qwen2", QwenVisionConfig)


def _nested_config(config_class, c: ModelConfig, common: dict, **text_fields):
    """transformers' `config_class` of a Qwen-VL config: the language model's fields (and
    `text_fields`) as its text config, the vision config's own."""
    text = llama.to_hf_kwargs(c, llama.nested_common(common))
    text.update(rope_parameters=dict(c.rope_params, rope_theta=c.rope_theta), **text_fields)
    return config_class(text_config=text, vision_config=c.vision.to_hf(), image_token_id=c.image_token_id,
                        tie_word_embeddings=c.tie_word_embeddings, architectures=common["architectures"])


def _to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    return _nested_config(transformers.Qwen2_5_VLConfig, c, common, use_sliding_window=False)


def deepstack_additions(slots, deep, dtype):
    """DeepStack's additions (K, B, L, D) to the hidden states, from the encoder's DeepStack
    features `deep` (B, K, N, D) (K layers, N image tokens per row): row b's n-th image token
    (`slots`, from `image_slots`) gets `deep[b, :, n]`; 0 everywhere else."""
    picked = jax.vmap(lambda d: take_slots(d, slots), in_axes=1)(deep)
    return jnp.where(slots[0][None, ..., None], picked, 0).astype(dtype)


def _encoded(trunk, c: ModelConfig, images, encoder_cls):
    """The trunk's vision encoder ("visual", `encoder_cls` over the batch's rows) applied to
    `images` (an `ImageInput`): its output, or None without images (at init the encoder's
    parameters are made from one image token's blank patches)."""
    encoder = row_encoder(trunk, encoder_cls, c.vision, in_axes=(0, 0))
    if images is None:
        if trunk.is_initializing():
            blank = smallest_image_input(c.vision)
            encoder(jnp.asarray(blank.pixels), blank.layout)
        return None
    if not isinstance(images, ImageInput):
        raise TypeError(f"a {c.model_type} model takes its images as a jaxppo.models.vision.ImageInput; got "
                        f"{type(images).__name__}")
    return encoder(images.pixels, images.layout)


def _vision(trunk, c: ModelConfig, x, input_ids, images):
    features = _encoded(trunk, c, images, QwenVisionEncoder)
    if features is None:
        return x, None, None
    return merge_images(x, image_slots(input_ids, c.image_token_id, images.tokens), features), None, None


def _vision3(trunk, c: ModelConfig, x, input_ids, images):
    encoded = _encoded(trunk, c, images, Qwen3VisionEncoder)
    if encoded is None:
        return x, None, None
    features, deep = encoded  # (B, N, D), (B, K, N, D)
    slots = image_slots(input_ids, c.image_token_id, images.tokens)
    x = merge_images(x, slots, features)
    if not c.vision.deepstack_visual_indexes:
        return x, None, None
    return x, deepstack_additions(slots, deep, x.dtype), None


def _images(c: ModelConfig, processor, tokenizer):
    from jaxppo.models.vision.qwen_images import QwenImages

    return QwenImages(processor, c, None if tokenizer is None else tokenizer.convert_ids_to_tokens(c.image_token_id))


def _encoder_names(prefix: str, name_of):
    """A family's `hf_extra_name`: the vision encoder's parameters (under the trunk's
    "visual") named `prefix` + their names in the encoder (`name_of`: `vision_hf_name`,
    `vision3_hf_name`)."""

    def hf_extra_name(path, c: ModelConfig):
        if len(path) < 3 or path[1] != "visual":
            return None
        name, layout = name_of(path[2:], c.vision)
        return prefix + name, layout

    return hf_extra_name


def _from_hf3(d: dict, common: dict) -> ModelConfig:
    return _config(d, common, "qwen3_vl", "qwen3", Qwen3VisionConfig)


def _to_hf3(c: ModelConfig, architecture: str, common: dict):
    import transformers

    return _nested_config(transformers.Qwen3VLConfig, c, common, attention_bias=c.qkv_bias)


FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    architectures={"qwen2_5_vl": (ARCHITECTURE, None)},
    config_from_hf=_from_hf,
    config_to_hf=_to_hf,
    hints={},
    vision=_vision,
    hf_extra_name=_encoder_names("visual.", vision_hf_name),
    images=_images,
    peft_trunk_name="model.language_model",
    peft_tower_name=("visual", "model.visual"),
    peft_exclude=r".*\.visual\..*",
)

QWEN3_FAMILY = dataclasses.replace(
    FAMILY,
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    architectures={"qwen3_vl": (ARCHITECTURE_3, None)},
    config_from_hf=_from_hf3,
    config_to_hf=_to_hf3,
    vision=_vision3,
    hf_extra_name=_encoder_names("model.visual.", vision3_hf_name),
    hf_trunk_name="model.language_model",
    peft_trunk_name=None,
)
