"""The vision demo (`jaxppo --demo vision`): a tiny randomly initialised Qwen2.5-VL-layout
policy learns to name the colour of the picture it is shown, with GRPO, on a CPU in a few
minutes, and only because it reads the images.

Everything is made here, nothing downloaded and no PyTorch needed: the model (from
transformers' own `Qwen2_5_VLConfig`, initialised by jaxppo), a word-level tokenizer with a
chat template that shows image parts, the model's image processor
(`Qwen2VLImageProcessorPil`) and the pictures (PIL). Every prompt asks the same question;
only its picture differs: a square of one of `COLOURS` on a background, at a random place.
The reward is 1 when the answer's first word is the picture's colour. A policy that cannot
see the pictures scores 1/len(COLOURS) at best; `blank=True` gives it grey pictures, the
control that shows the score rises because of the images.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["COLOURS", "word_level_tokenizer", "vision_tokenizer", "vision_image_processor", "vision_policy", "vision_checkpoint", "vision_prompts",
           "colour_reward", "DEMO_VISION_GRPO", "DEMO_VISION_TRAINER", "PLACEHOLDER"]

COLOURS = {"red": (220, 30, 30), "green": (30, 190, 30), "blue": (30, 30, 220)}
PLACEHOLDER = "<|image_pad|>"
_WORDS = ["user", "assistant", ":", "<eol>", "what", "colour", "is", "the", "square", "?", "it", "a", "and", "or",
          "yes", "no", "picture", "this", *COLOURS]
VOCAB = 64  # the model's vocabulary: the tokenizer's ids and unused ones up to here
IMAGE_TOKEN = VOCAB - 1
_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} :{% if m['content'] is string %} {{ m['content'] }}{% else %}"
             "{% for p in m['content'] %}{% if p['type'] == 'image' %} " + PLACEHOLDER + "{% else %} {{ p['text'] }}"
             "{% endif %}{% endfor %}{% endif %} <eol> {% endfor %}{% if add_generation_prompt %}assistant :"
             "{% endif %}")

# The demo's settings; every one can be overridden on the command line. 16 prompts x 8
# completions per iteration, one update each.
DEMO_VISION_GRPO = dict(batch_size=128, mini_batch_size=128, ppo_epochs=1, num_generations=8, kl_loss_coef=0.0)
DEMO_VISION_TRAINER = dict(iterations=80, query_length=24, response_length=2, learning_rate=3e-3, sample_every=10,
                           output_dir="runs/demo_vision")


def word_level_tokenizer(words, size: int, image_token: int, specials: dict = None, placeholder: str = PLACEHOLDER,
                         named: dict = None):
    """A word-level tokenizer of `size` ids: <pad> 0, <s> 1, </s> 2, <unk> 3, `words`,
    unused fillers, and special tokens: `specials` ({id: text}; default the image token
    `PLACEHOLDER` at `image_token`). Its chat template renders a message's image parts as
    `placeholder`, once per image; `named` special tokens ({"boi_token": text, ...}) become
    the tokenizer's attributes, as a model's processor may read them."""
    import tokenizers
    import transformers

    specials = {image_token: PLACEHOLDER} if specials is None else specials
    names = ["<pad>", "<s>", "</s>", "<unk>", *words]
    vocab = {specials[i] if i in specials else names[i] if i < len(names) else f"<unused{i}>": i for i in range(size)}
    model = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    model.decoder = tokenizers.decoders.WordPiece()
    extra = {"extra_special_tokens": named} if named else {}
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="<pad>", eos_token="</s>",
                                                     bos_token="<s>", unk_token="<unk>",
                                                     additional_special_tokens=list(specials.values()), **extra)
    tokenizer.chat_template = _TEMPLATE.replace(PLACEHOLDER, placeholder)
    return tokenizer


def vision_tokenizer():
    """The demo's tokenizer (`word_level_tokenizer` of its words; the image token last)."""
    return word_level_tokenizer(_WORDS, VOCAB, IMAGE_TOKEN)


def vision_image_processor():
    """The policy's image processor: 4-pixel patches merged 2 x 2, pictures resized to
    16 x 16 pixels (4 image tokens)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=16 * 16,
                                    max_pixels=16 * 16)


def vision_policy(seed: int = 0, width: int = 64, layers: int = 2):
    """(Model, params): a random Qwen2.5-VL-layout policy: a `layers`-layer language model of
    `width`, a 2-block vision encoder (windows of 2 x 2 image tokens, one full-attention
    block), over the tokenizer's vocabulary."""
    import transformers

    from jaxppo.models.config import config_from_hf
    from jaxppo.models.model import Model

    text = dict(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0})
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=width, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1])
    hf = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                       tie_word_embeddings=True)
    model = Model(config_from_hf(hf))
    return model, model.init(jax.random.key(seed + 4321))


def vision_checkpoint(directory: str, seed: int = 0) -> str:
    """`vision_policy` saved as a Hugging Face checkpoint in `directory`, with its tokenizer
    and image processor beside it (what `--model` takes); returns the directory."""
    from jaxppo.models.hf import save_pretrained

    model, params = vision_policy(seed)
    save_pretrained(model, params, directory)
    vision_tokenizer().save_pretrained(directory)
    vision_image_processor().save_pretrained(directory)
    return directory


def _picture(colour, rng, blank: bool):
    """A 32 x 32 picture: a square of `colour` (RGB) of 12 to 20 pixels at a random place on a
    dark background with noise; grey all over with `blank`."""
    import PIL.Image

    pixels = rng.integers(0, 40, (32, 32, 3)).astype(np.uint8)
    if blank:
        pixels[:] = 128
    else:
        side = int(rng.integers(12, 21))
        top, left = rng.integers(0, 33 - side, 2)
        pixels[top:top + side, left:left + side] = colour
    return PIL.Image.fromarray(pixels)


def vision_prompts(n: int = 96, seed: int = 0, blank: bool = False):
    """`n` prompt rows {"prompt": chat messages with one image part, "images": [picture],
    "colour": its colour's name}, the colours in turn; the question is the same for all."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    question = [{"type": "image"}, {"type": "text", "text": "what colour is the square ?"}]
    return [{"prompt": [{"role": "user", "content": question}],
             "images": [_picture(COLOURS[names[i % len(names)]], rng, blank)], "colour": names[i % len(names)]}
            for i in range(n)]


def colour_reward(prompts, completions, colour):
    """1 where the completion's first word is the picture's colour, else 0."""
    return [float(c.split()[:1] == [k]) for c, k in zip(completions, colour)]
