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
        # Qwen3: q/k norms, head_dim unlike hidden / heads, untied; the second layer attends
        # through a sliding window (use_sliding_window, max_window_layers=1).
        "qwen3": (transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           max_position_embeddings=128, tie_word_embeddings=False,
                                           use_sliding_window=True, sliding_window=5, max_window_layers=1,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0),
                  transformers.Qwen3ForCausalLM),
        # Gemma 3: sliding layers (window 4) around a global one, two rope bases, linear rope
        # scaling on the global layer, final-logit soft capping (and attention soft capping,
        # which Hugging Face's Gemma 3 ignores: so must jaxppo).
        "gemma3": (transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 max_position_embeddings=128, query_pre_attn_scalar=12, sliding_window=4,
                                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                                     "rope_theta": 1000.0},
                                                                  "sliding_attention": {"rope_type": "default",
                                                                                        "rope_theta": 50.0}},
                                                 attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                                 bos_token_id=1, eos_token_id=2, pad_token_id=0),
                   transformers.Gemma3ForCausalLM),
        # Mistral: the Llama layout with a sliding window on every layer.
        "mistral": (transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                               sliding_window=5, tie_word_embeddings=False, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0),
                    transformers.MistralForCausalLM),
        # Mixtures of experts: Qwen3-MoE with its top-k weights as the router gives them
        # (norm_topk_prob off), Mixtral (renormalised); 6 and 4 experts, 2 per token.
        "qwen3_moe": (transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                  moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2,
                                                  norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                                  pad_token_id=0),
                      transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
                                               num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                                               pad_token_id=0),
                    transformers.MixtralForCausalLM),
        "qwen3_moe-reward": (transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                         moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                                         norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                                                         num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                                                         num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                             transformers.Qwen3MoeForSequenceClassification),
        "gpt2-reward": (transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                        transformers.GPT2ForSequenceClassification),
        "llama-reward": (transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                                  num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                         transformers.LlamaForSequenceClassification),
        "qwen3-reward": (transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                  max_position_embeddings=128, num_labels=1, pad_token_id=0, eos_token_id=2,
                                                  bos_token_id=1),
                         transformers.Qwen3ForSequenceClassification),
        "gemma3-reward": (transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                        head_dim=16, max_position_embeddings=128, query_pre_attn_scalar=12,
                                                        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                                        num_labels=1, pad_token_id=0, eos_token_id=2, bos_token_id=1),
                          transformers.Gemma3TextForSequenceClassification),
    }


NAMES = tuple(["gpt2", "llama", "qwen2", "qwen3", "gemma3", "mistral", "qwen3_moe", "mixtral", "gpt2-reward",
               "llama-reward", "qwen3-reward", "gemma3-reward", "qwen3_moe-reward"])


def build(name, directory, seed=0):
    """Save a tiny random `name` checkpoint to `directory`; return the torch model (eval)."""
    import torch

    config, cls = _configs()[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Larger-than-default random weights so that logits differ visibly between tokens.
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
            elif "norm" in name_:  # norm weights away from their initial values, so that they matter
                p.add_(torch.randn_like(p) * 0.3)
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


def build_qwen3_with_tokenizer(directory, tokenizer, width=32, layers=2, positions=64, seed=0):
    """A tiny random Qwen3 causal LM over `tokenizer`'s vocabulary, saved with the tokenizer."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen3Config(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=positions, tie_word_embeddings=True,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model
