"""Tiny random Hugging Face checkpoints built locally with transformers + PyTorch (CPU)."""

import os

import numpy as np

VOCAB = 97


def _configs():
    import transformers

    return {
        "gpt2": (transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
                                         eos_token_id=2, pad_token_id=0),
                 transformers.GPT2LMHeadModel),
        "llama": (transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                           tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                           rope_theta=500.0),
                  transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                                           tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                  transformers.Qwen2ForCausalLM),
        "gpt2-reward": (transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                        transformers.GPT2ForSequenceClassification),
        "llama-reward": (transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                                  num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                         transformers.LlamaForSequenceClassification),
    }


NAMES = tuple(["gpt2", "llama", "qwen2", "gpt2-reward", "llama-reward"])


def build(name, directory, seed=0):
    """Save a tiny random `name` checkpoint to `directory`; return the torch model (eval)."""
    import torch

    config, cls = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Larger-than-default random weights so that logits differ visibly between tokens.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    return model


def left_padded_batch(rng, batch, length, min_len=1):
    lengths = rng.integers(min_len, length + 1, size=batch)
    lengths[0] = length  # one row unpadded
    mask = (np.arange(length)[None, :] >= (length - lengths)[:, None]).astype(np.int64)
    ids = rng.integers(3, VOCAB, size=(batch, length)) * mask  # pad id 0
    return ids, mask


def build_byte_level_pair(directory, tokenizer, width=32, layers=1, positions=48, seed=0):
    """A GPT-2 policy (with the tokenizer saved beside it) and a GPT-2 reward model over the
    tokenizer's vocabulary, saved to <directory>/policy and <directory>/rm."""
    import os

    import torch
    import transformers

    common = dict(vocab_size=len(tokenizer), n_embd=width, n_layer=layers, n_head=2, n_positions=positions,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=0)
    torch.manual_seed(seed)
    policy, rm = os.path.join(directory, "policy"), os.path.join(directory, "rm")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**common)).save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    transformers.GPT2ForSequenceClassification(transformers.GPT2Config(num_labels=1, **common)).save_pretrained(rm)
    return policy, rm
