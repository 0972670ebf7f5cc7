"""Gemma 3: the Llama block with norms after attention and around the MLP, RMSNorm with
(1 + weight), q/k norms, GeGLU, embeddings scaled by sqrt(hidden_size), sliding and global
layers with their own rope bases, optional logit soft-capping. Text (`gemma3_text`,
`FAMILY`), and with images (`gemma3`, `Gemma3ForConditionalGeneration`, `VISION_FAMILY`):
a SigLIP encoder and projector (`jaxppo.models.vision.gemma`) whose image token embeddings
replace the embeddings of the text's image tokens, each image's tokens attending to each
other both ways."""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.families import llama
from jaxppo.models.transformer import RMSNorm
from jaxppo.models.vision.gemma import GemmaImageInput, GemmaVisionConfig, GemmaVisionEncoder, gemma_vision_hf_name
from jaxppo.models.vision.prompt import image_slots, merge_images, row_encoder

__all__ = ["GemmaBlock", "FAMILY", "VISION_FAMILY"]


class GemmaBlock(llama.LlamaBlock):
    """The Gemma 3 block: `LlamaBlock` with sandwich norms of (1 + weight)."""

    sandwich_norms = True


def _embed(trunk, c: ModelConfig, input_ids, positions):
    x, table = llama.embed_tokens(trunk, c, input_ids, positions)
    # Scaled by sqrt(hidden_size), rounded to the parameter dtype as Hugging Face does.
    return x * jnp.asarray(c.hidden_size ** 0.5, trunk.param_dtype).astype(x.dtype), table


def _final_norm(trunk, c: ModelConfig):
    return RMSNorm(c.norm_eps, trunk.dtype, trunk.param_dtype, True, name="norm")


def _from_hf(d: dict, common: dict) -> ModelConfig:
    # transformers >= 5: one rope dict per layer type; earlier: rope_theta, rope_scaling
    # (global layers) and rope_local_base_freq (sliding layers).
    rope = dict(d.get("rope_parameters") or {})
    local = dict(rope.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding-layer rope_type {local['rope_type']!r} is not supported; supported: default")
    local_theta = float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0)))
    rope = dict(rope.get("full_attention") or {})
    if not rope:
        rope = dict(d.get("rope_scaling") or {})
        rope["rope_theta"] = d.get("rope_theta", 1000000.0)
    if d.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=True is not a causal LM; not supported")
    window = d.get("sliding_window")
    layer_types = d.get("layer_types") if window is not None else None
    if layer_types is None and window is not None:
        pattern = d.get("sliding_window_pattern", 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(d["num_hidden_layers"])]
    return ModelConfig(qk_norm=True, local_rope_theta=local_theta,
                       query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                       final_logit_softcapping=d.get("final_logit_softcapping"),
                       **llama.config_kwargs(d, common, window, layer_types), **llama.rope_fields(rope, d))


def _before_5(rope: dict, kwargs: dict) -> dict:
    """transformers < 5: the sliding layers' base as `rope_local_base_freq`."""
    kwargs["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    return rope["full_attention"]


def _to_hf(c: ModelConfig, architecture: str, common: dict):
    import transformers

    kwargs = llama.to_hf_kwargs(c, common)
    kwargs["hidden_activation"] = kwargs.pop("hidden_act")
    kwargs.update(attention_bias=c.qkv_bias, sliding_window=c.sliding_window, layer_types=llama.hf_layer_types(c),
                  query_pre_attn_scalar=c.query_pre_attn_scalar, final_logit_softcapping=c.final_logit_softcapping)
    rope = {"full_attention": dict(c.rope_params, rope_theta=c.rope_theta),
            "sliding_attention": {"rope_type": "default", "rope_theta": c.local_rope_theta or c.rope_theta}}
    return llama.make_hf_config(transformers.Gemma3TextConfig, rope, kwargs, before_5=_before_5)


# The Llama family's module and tensor names and LoRA targets; its own block, embeddings,
# final norm and configs.
FAMILY = dataclasses.replace(
    llama.FAMILY,
    name="gemma3",
    model_types=("gemma3_text",),
    architectures={"gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextForSequenceClassification")},
    config_from_hf=_from_hf,
    config_to_hf=_to_hf,
    tied_by_default=True,
    hints={},
    block=GemmaBlock,
    embed=_embed,
    final_norm=_final_norm,
)


def _from_hf_vision(d: dict, common: dict) -> ModelConfig:
    if "vision_config" not in d:
        raise KeyError("vision_config")
    text = _from_hf(dict(d, model_type="gemma3_text"), common)
    image = d.get("image_token_index", d.get("image_token_id"))
    if image is None:
        raise KeyError("image_token_index")
    if d["vision_config"].get("model_type", "siglip_vision_model") != "siglip_vision_model":
        raise ValueError(f"a gemma3 vision_config of model_type {d['vision_config']['model_type']!r}: jaxppo loads "
                         "Gemma 3's SigLIP tower (siglip_vision_model)")
    return dataclasses.replace(text, model_type="gemma3", vision=GemmaVisionConfig.from_hf(d),
                               image_token_id=int(image))


def _to_hf_vision(c: ModelConfig, architecture: str, common: dict):
    import transformers

    text = _to_hf(dataclasses.replace(c, model_type="gemma3_text", vision=None, image_token_id=None),
                  "Gemma3ForCausalLM", llama.nested_common(common))
    vision, beside = c.vision.to_hf()
    return transformers.Gemma3Config(text_config=text, vision_config=vision, image_token_index=c.image_token_id,
                                     tie_word_embeddings=c.tie_word_embeddings, architectures=common["architectures"],
                                     num_labels=common.get("num_labels", c.num_labels), **beside)


def _vision(trunk, c: ModelConfig, x, input_ids, images):
    v = c.vision
    encoder = row_encoder(trunk, GemmaVisionEncoder, v, c.hidden_size)
    if images is None:
        if trunk.is_initializing():  # the encoder's parameters, from one blank image
            encoder(jnp.zeros((1, 1, v.num_channels, v.image_size, v.image_size), trunk.dtype))
        return x, None, None
    if not isinstance(images, GemmaImageInput):
        raise TypeError(f"a gemma3 model takes its images as a jaxppo.models.vision.gemma.GemmaImageInput; got "
                        f"{type(images).__name__}")
    features = encoder(jnp.asarray(images.pixels))  # (B, M, T, D)
    b, m, t, d = features.shape
    slots = image_slots(input_ids, c.image_token_id, images.tokens)
    x = merge_images(x, slots, features.reshape(b, m * t, d))
    return x, None, jnp.where(slots[0], slots[1] // t, -1)  # each image token's image


def _images(c: ModelConfig, processor, tokenizer):
    from jaxppo.models.vision.gemma_images import GemmaImages

    return GemmaImages(processor, c, tokenizer)


def _hf_extra_name(path, c: ModelConfig):
    """The vision encoder and projector (under the trunk's "visual", as every vision family
    names its encoder) by
    `gemma_vision_hf_name`; the language model under "language_model" as transformers saves
    Gemma 3 (its trunk "language_model.model", an untied head "language_model.lm_head")."""
    if path[0] == "lm_head":
        return "language_model.lm_head.weight", True
    if len(path) < 3 or path[1] != "visual":
        return None
    return gemma_vision_hf_name(path[2:], c.vision)


def _checkpoint_name(name: str):
    """Gemma 3's published checkpoints hold the tower under vision_tower.vision_model and
    SigLIP's pooling head, which Gemma 3 does not use; transformers saves the tower under
    vision_tower."""
    name = re.sub(r"^vision_tower\.vision_model\.", "vision_tower.", name)
    return None if name.startswith("vision_tower.head.") else name


VISION_FAMILY = dataclasses.replace(
    FAMILY,
    name="gemma3_vision",
    model_types=("gemma3",),
    architectures={"gemma3": ("Gemma3ForConditionalGeneration", "Gemma3ForSequenceClassification")},
    config_from_hf=_from_hf_vision,
    config_to_hf=_to_hf_vision,
    hints={},
    vision=_vision,
    hf_extra_name=_hf_extra_name,
    images=_images,
    hf_trunk_name="language_model.model",
    hf_checkpoint_name=_checkpoint_name,
    peft_trunk_name="model.language_model",
    peft_tower_name=("vision_tower", "model.vision_tower"),
    peft_exclude=r".*\.vision_tower\..*",
)
