"""Real model layouts and the PPO pieces built on them, shared by the memory and GPU
benchmarks. Parameters can be abstract (`jax.eval_shape`: nothing allocated) or real."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo
from jaxppo.models import Model, ModelConfig
from jaxppo.models.model import PolicyAndCritic
from jaxppo.config.optimizer import build_optimizer


def qwen25_05b(layers=24):
    """Qwen2.5-0.5B: vocab 151936, hidden 896, 14 heads / 2 KV heads, MLP 4864, tied, q/k/v bias."""
    return ModelConfig(model_type="qwen2", vocab_size=151936, hidden_size=896, num_layers=layers, num_heads=14,
                       num_kv_heads=2, intermediate_size=4864, max_position_embeddings=32768, qkv_bias=True,
                       tie_word_embeddings=True, rope_theta=1000000.0, activation="silu", norm_eps=1e-6)


def llama32_1b(layers=16):
    """Llama-3.2-1B: vocab 128256, hidden 2048, 32 / 8 heads, MLP 8192, tied."""
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=2048, num_layers=layers, num_heads=32,
                       num_kv_heads=8, intermediate_size=8192, max_position_embeddings=131072, activation="silu",
                       tie_word_embeddings=True, rope_theta=500000.0)


def llama31_8b(layers=32):
    """Llama-3.1-8B: vocab 128256, hidden 4096, 32 / 8 heads, MLP 14336, untied."""
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=4096, num_layers=layers, num_heads=32,
                       num_kv_heads=8, intermediate_size=14336, max_position_embeddings=131072, activation="silu",
                       tie_word_embeddings=False, rope_theta=500000.0)


def qwen3_17b(layers=28):
    """Qwen3-1.7B: vocab 151936, hidden 2048, 16 / 8 heads of 128, MLP 6144, tied, q/k RMSNorm."""
    return ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2048, num_layers=layers, num_heads=16,
                       num_kv_heads=8, head_dim=128, intermediate_size=6144, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0, activation="silu", norm_eps=1e-6, qk_norm=True)


def qwen3_30b_a3b(layers=48):
    """Qwen3-30B-A3B: vocab 151936, hidden 2048, 32 / 4 heads of 128, 128 experts of 768 (8 a token), untied."""
    return ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=layers, num_heads=32,
                       num_kv_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                       tie_word_embeddings=False, rope_theta=1000000.0, activation="silu", norm_eps=1e-6,
                       qk_norm=True)


LAYOUTS = {"qwen2.5-0.5b": qwen25_05b, "qwen3-1.7b": qwen3_17b, "llama3.2-1b": llama32_1b, "llama3.1-8b": llama31_8b,
           "qwen3-30b-a3b": qwen3_30b_a3b}


@dataclasses.dataclass(frozen=True)
class Setup:
    """How the trained models are built: compute dtype, layout, remat, logit chunks."""

    dtype: str = "float32"
    scan_layers: bool = True
    remat: object = False
    logits_chunk_size: object = None
    attention: str = "einsum"
    hoist_layers: bool = False

    def models(self, config):
        kw = dict(dtype=self.dtype, param_dtype="float32", remat=self.remat, scan_layers=self.scan_layers,
                  attention=self.attention, hoist_layers=self.hoist_layers)
        return (Model(config, logits_chunk_size=self.logits_chunk_size, **kw), Model(config, kind="value", **kw))


def make_state(config, setup: Setup, abstract=True):
    """The trainer's train state (policy + separate critic, float32 master weights, the
    trainer's optimizer: clipped Adam per part)."""
    policy, critic = setup.models(config)
    _, tx = build_optimizer(jaxppo.OptimizerConfig(learning_rate=1e-6), 1, critic=True)

    def build():
        params = {"policy": policy.init(jax.random.key(0), seq_len=2),
                  "critic": critic.init(jax.random.key(1), seq_len=2)}
        return jaxppo.TrainState.create(apply_fn=PolicyAndCritic(policy, critic), params=params, tx=tx)

    return jax.eval_shape(build) if abstract else jax.jit(build)()


def make_policy_state(config, setup: Setup, lora_rank=0, abstract=True):
    """The trainer's train state of a critic-free run (GRPO family): the policy alone. With
    `lora_rank`, LoRA adapters on every linear layer (alpha = 2 x rank) are trained and the
    base is frozen in the compute dtype (`jaxppo.update.Freeze`); without, every weight is trained
    (float32 master weights)."""
    from jaxppo.models.lora import LoraConfig

    lora = LoraConfig(rank=lora_rank, alpha=2.0 * lora_rank, targets="all-linear") if lora_rank else None
    policy = Model(config, dtype=setup.dtype, param_dtype=setup.dtype if lora else "float32", remat=setup.remat,
                   scan_layers=setup.scan_layers, logits_chunk_size=setup.logits_chunk_size, lora=lora)
    _, tx = build_optimizer(jaxppo.OptimizerConfig(learning_rate=1e-5), 1, critic=False)
    freeze = jaxppo.update.Freeze(prefixes=(("params",),)) if lora else None

    def build():
        return jaxppo.TrainState.create(apply_fn=policy.apply, params=policy.init(jax.random.key(0), seq_len=2),
                                        tx=tx, freeze=freeze)

    return (jax.eval_shape(build) if abstract else jax.jit(build)()), policy


def abstract_rollout(batch, q, r):
    s = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
    return jaxppo.RolloutBatch(query_tokens=s((batch, q), jnp.int32), query_mask=s((batch, q), jnp.int32),
                               response_tokens=s((batch, r), jnp.int32), response_mask=s((batch, r), jnp.int32),
                               logprobs=s((batch, r)), values=s((batch, r)), rewards=s((batch, r)))


def random_rollout(batch, q, r, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(r // 2, r + 1, size=(batch, 1))
    return jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(0, vocab, (batch, q)), jnp.int32),
        query_mask=jnp.asarray(np.arange(q)[None] >= rng.integers(0, q // 4, (batch, 1)), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(0, vocab, (batch, r)), jnp.int32),
        response_mask=jnp.asarray(np.arange(r)[None] < lengths, jnp.int32),
        logprobs=jnp.asarray(-np.log(vocab) + 0.1 * rng.normal(size=(batch, r)), jnp.float32),
        values=jnp.asarray(0.1 * rng.normal(size=(batch, r)), jnp.float32),
        rewards=jnp.asarray(rng.normal(size=(batch, r)), jnp.float32))


def trunk_params(config) -> int:
    """Parameters of the transformer blocks (what every token multiplies through)."""
    c = config
    attn = c.hidden_size * c.head_dim * (c.num_heads * 2 + c.num_kv_heads * 2)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp)


def train_flops(config, batch, q, r, epochs=1, trunks=2):
    """Model FLOPs of one PPO train_step with a policy and a critic of this layout (trunks=1:
    the policy alone, as critic-free methods train): forward + backward (3 x 2 FLOPs per
    weight per token) through the trunks at every position,
    attention scores and mixing (3 x 4 x L x D_attn x S per token, as computed: no causal
    skipping), and the policy's LM head at the response positions only."""
    c = config
    s = q + r
    per_token_trunk = 6 * trunk_params(c) + 12 * c.num_layers * c.num_heads * c.head_dim * s
    head = 6 * c.hidden_size * c.vocab_size * r
    return epochs * batch * (trunks * per_token_trunk * s + head)


def decode_bytes(config, batch, q, r, weight_bytes=2, cache_bytes=2):
    """HBM bytes the r decode steps of sampling must read at least: every weight once per
    step (trunk, final norm aside, and the LM head, tied or not: hidden x vocab) at
    `weight_bytes` each, plus the KV cache of the slots each step attends to (q + t at step
    t, every layer's k and v) at `cache_bytes` each. The prefill is left out."""
    c = config
    weights = (trunk_params(c) + c.hidden_size * c.vocab_size) * weight_bytes
    kv_per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * cache_bytes * batch
    return sum(weights + kv_per_slot * (q + t) for t in range(r))


def decode_flops(config, batch, q, r):
    """Forward FLOPs of sampling r tokens after q-token prompts (prefill + decode)."""
    c = config
    fwd = 2 * trunk_params(c)
    attn = lambda keys: 4 * c.num_layers * c.num_heads * c.head_dim * keys
    prefill = batch * (q * fwd + q * attn(q) + 2 * c.hidden_size * c.vocab_size)
    decode = batch * sum(fwd + attn(q + r) + 2 * c.hidden_size * c.vocab_size for _ in range(r))
    return prefill + decode
