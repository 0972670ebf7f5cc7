"""Tiny random-weight vision-language checkpoints for the tests, built here from
transformers' own config classes (no hub download): a Qwen2.5-VL and a Qwen3-VL model, and
beside them a
word-level tokenizer with a chat template that shows image parts, and the model's image
processor (`Qwen2VLImageProcessorPil`, saved as `preprocessor_config.json`)."""

import json
import os

import numpy as np

# Windows of 2 x 2 image tokens (16 px / merge 2 / patch 4); block 1 attends over its whole image.
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=40, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
IMAGE = 90  # the image token's id
PLACEHOLDER = "<|image_pad|>"  # jaxppo.demo_vision.PLACEHOLDER
WORDS = ["user", "assistant", ":", "<eol>", "what", "colour", "is", "this", "red", "blue", "green", "it", "a", "b",
         "picture", "and", "or", "yes", "no", "the"]
def _jitter(model, *names):
    """Biases and norm weights (and parameters whose names hold any of `names`) moved away
    from their 0 / 1 start, so that every parameter matters to the outputs."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or any(n in name for n in names):
                p.add_(0.1 * torch.randn_like(p))


def tiny_qwen_vl(path, seed: int = 0):
    """A tiny random Qwen2.5-VL checkpoint saved by transformers at `path` (vocabulary 97,
    image token 90); returns the torch model."""
    import torch
    import transformers

    text = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0})
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=64),
                                     image_token_id=IMAGE)).eval()
    _jitter(model, "ln_q")
    model.save_pretrained(path)
    return model


# Qwen3-VL's: no windows, a 4 x 4 grid of learned positions, DeepStack after blocks 0 and 2.
VISION_3 = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                deepstack_visual_indexes=[0, 2])


def tiny_qwen3_vl(path, seed: int = 0):
    """A tiny random Qwen3-VL checkpoint saved by transformers at `path` (vocabulary 97,
    image token 90; interleaved M-RoPE sections (3, 3, 2), which differ from the sections
    laid end to end); returns the torch model."""
    import torch
    import transformers

    text = dict(vocab_size=97, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                pad_token_id=0, rope_parameters={"rope_type": "default", "mrope_section": [3, 3, 2],
                                                 "mrope_interleaved": True, "rope_theta": 1000.0})
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(
        transformers.Qwen3VLConfig(text_config=text, vision_config=VISION_3, image_token_id=IMAGE)).eval()
    _jitter(model)
    model.save_pretrained(path)
    return model


def tokenizer():
    """A word-level tokenizer of the tiny model's 97 ids (`jaxppo.demo_vision`'s kind):
    <pad> 0, <s> 1, </s> 2, <unk> 3, `WORDS`, fillers, the image token at 90; its chat
    template renders a message's image parts as the image token."""
    from jaxppo.demo_vision import word_level_tokenizer

    return word_level_tokenizer(WORDS, 97, IMAGE)


def image_processor(max_side: int = 16):
    """The tiny model's image processor: 4-pixel patches, merged 2 x 2, images resized to at
    most `max_side`^2 pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8,
                                    max_pixels=max_side * max_side)


def tiny_vl_checkpoint(path, seed: int = 0, family: str = "qwen2_5_vl"):
    """`tiny_qwen_vl` (or `tiny_qwen3_vl`, family "qwen3_vl") at `path` with its tokenizer
    and image processor saved beside it."""
    (tiny_qwen3_vl if family == "qwen3_vl" else tiny_qwen_vl)(path, seed)
    tokenizer().save_pretrained(path)
    image_processor().save_pretrained(path)
    return os.fspath(path)


def colour_image(colour, size=(16, 16)):
    """A PIL image of one colour ("red", "green", "blue", or an RGB triple), `size` (w, h)."""
    import PIL.Image

    rgb = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}.get(colour, colour)
    return PIL.Image.new("RGB", size, tuple(rgb))


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f)


def noise_image(seed, size=(16, 16)):
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


# Gemma 3: a 16 x 16 image in 4-pixel patches, pooled to 4 image tokens (ids 97 start of
# image, 98 end of image, 99 image token of a 100-id vocabulary).
BOI, EOI, GEMMA_IMAGE = 97, 98, 99
GEMMA_SPECIALS = {BOI: "<start_of_image>", EOI: "<end_of_image>", GEMMA_IMAGE: "<image_soft_token>"}


def tiny_gemma3_vl(path, seed: int = 0):
    """A tiny random Gemma 3 with its SigLIP tower (`Gemma3ForConditionalGeneration`) saved
    by transformers at `path`: 3 layers, sliding and full, a window of 3 tokens (narrower
    than an image's 4 tokens); returns the torch model."""
    import torch
    import transformers

    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, sliding_window=3,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=8,
                bos_token_id=1, eos_token_id=2, pad_token_id=0,
                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}})
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=4, vision_use_head=False)
    torch.manual_seed(seed)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=GEMMA_IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    _jitter(model, "mm_input")
    model.save_pretrained(path)
    return model


def gemma_tokenizer():
    """The word-level tokenizer of the tiny Gemma 3's 100 ids, its chat template showing an
    image part as the start-of-image token, and the marker tokens Gemma 3's processor reads."""
    from jaxppo.demo_vision import word_level_tokenizer

    return word_level_tokenizer(WORDS, 100, GEMMA_IMAGE, GEMMA_SPECIALS, GEMMA_SPECIALS[BOI],
                                dict(boi_token=GEMMA_SPECIALS[BOI], eoi_token=GEMMA_SPECIALS[EOI],
                                     image_token=GEMMA_SPECIALS[GEMMA_IMAGE]))


def gemma_image_processor():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 16, "width": 16})


def tiny_gemma_checkpoint(path, seed: int = 0):
    """`tiny_gemma3_vl` at `path` with its tokenizer and image processor saved beside it."""
    tiny_gemma3_vl(path, seed)
    gemma_tokenizer().save_pretrained(path)
    gemma_image_processor().save_pretrained(path)
    return os.fspath(path)


def moved_adapters(variables, scale=0.1, seed=3):
    """LoRA variables with every adapter moved from its start (B = 0), so that they change
    the outputs."""
    import jax

    leaves, tree = jax.tree.flatten(variables["lora"])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return {**variables, "lora": jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape)
                                                           for x, k in zip(leaves, keys)])}


def assert_continuous_is_static(model, params, batch, num_slots: int, response_length: int):
    """Continuous batching over `batch` (a `PromptBatch` with images; fewer slots than rows,
    so most rows are prefilled, images and all, into a freed slot mid-run) gives the static
    sampler's tokens and log-probs for the same key; with in-flight updates that recompute
    every slot's cache (the same parameters as a new version), greedy tokens are unchanged."""
    import jax

    from jaxppo.rollout.engines.continuous import generate_continuous, generate_inflight
    from jaxppo.rollout.engines.static import generate

    key = jax.random.key(3)
    static = generate(model, params, batch.queries, batch.mask, key, response_length=response_length, temperature=1.0)
    continuous = generate_continuous(model, params, batch.queries, batch.mask, key, num_slots=num_slots,
                                     response_length=response_length, temperature=1.0)
    np.testing.assert_array_equal(continuous.tokens, static.tokens)
    np.testing.assert_allclose(continuous.logprobs, static.logprobs, atol=1e-5)
    greedy = generate(model, params, batch.queries, batch.mask, key, response_length=response_length, greedy=True)
    versions = iter(range(100))
    inflight, _ = generate_inflight(model, lambda: (next(versions), params), batch.queries, batch.mask, key,
                                    num_slots=num_slots, steps_per_check=2, on_update="recompute",
                                    response_length=response_length, greedy=True)
    np.testing.assert_array_equal(inflight.tokens, greedy.tokens)
