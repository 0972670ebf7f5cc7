"""`Model`: a hashable handle on a built-in transformer with pure `apply(params, ...)`.

Kinds:
  "causal_lm"        apply -> logits (B, L, V)
  "causal_lm_value"  apply -> (logits (B, L, V), values (B, L)); value head on the policy trunk
  "reward"           apply -> scores (B,), read at the last real token that is not padding (reward models)
  "value"            apply -> values (B, L); a separate critic trunk with a scalar head

A `Model` is a frozen dataclass, so it (and its bound `apply`) can be a static jit argument
and a `TrainState.apply_fn`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional, Union

import jax
import jax.numpy as jnp

from jaxppo.models.config import ModelConfig
from jaxppo.models.context import CONTEXT_ATTENTION
from jaxppo.models.family import family_of
from jaxppo.models.heads import LMHead, token_logprobs, top_logprobs
from jaxppo.models.lora import LoraConfig
from jaxppo.models.moe import load_balancing_loss
from jaxppo.models.stacking import layer_prefix, matrices_in_compute_dtype, stack_layers, trunk_name, unstack_layers
from jaxppo.models.transformer import ATTENTION, CausalLMModule, GroupedKV, ScoreModule, default_positions
from jaxppo.models.vision.prompt import ImagePrompt, joined_positions, response_positions

__all__ = ["Model", "KINDS", "PolicyAndCritic", "joined_inputs", "stack_layers", "unstack_layers", "matrices_in_compute_dtype",
           "check_attention_backend", "check_cudnn_dtype", "describe_model", "is_model_spec"]

KINDS = ("causal_lm", "causal_lm_value", "reward", "value")
# The compute and storage dtypes a model may use (by name).
DTYPES = ("float32", "bfloat16", "float16")


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


# Rematerialisation policies by name (`jax.checkpoint_policies`): what a block keeps from its
# forward pass for the backward pass; the rest is recomputed.
REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def _check_model(self: "Model") -> None:
    """Model's own checks, each error naming the field and what would be valid ("full"
    remat normalised to True, dtypes to their names)."""
    if self.remat == "full":
        object.__setattr__(self, "remat", True)
    if not isinstance(self.remat, bool) and self.remat not in REMAT_POLICIES:
        raise ValueError(f"Model.remat={self.remat!r} is invalid; valid: False, True (or 'full'), or a policy "
                         f"name: {', '.join(REMAT_POLICIES)}")
    for flag in ("scan_layers", "hoist_layers"):
        if not isinstance(getattr(self, flag), bool):
            raise ValueError(f"Model.{flag}={getattr(self, flag)!r} is invalid; use True or False")
    k = self.logits_chunk_size
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k <= 0):
        raise ValueError(f"Model.logits_chunk_size={k!r} is invalid; use None (no chunking) or a positive int")
    w = self.head_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
        raise ValueError(f"Model.head_window={w!r} is invalid; use None (every position) or a positive int")
    if self.kind not in KINDS:
        raise ValueError(f"Model.kind={self.kind!r} is invalid; valid kinds: {', '.join(KINDS)}")
    if self.lora is not None:
        if not isinstance(self.lora, LoraConfig):
            raise ValueError(f"Model.lora={self.lora!r} is invalid; use None or a jaxppo.models.LoraConfig")
        self.lora.modules(self.config)  # the targets exist in this architecture
    for field in ("dtype", "param_dtype"):
        name = _dtype_name(getattr(self, field))
        if name not in DTYPES:
            raise ValueError(f"Model.{field}={name!r} is invalid; use {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")
        object.__setattr__(self, field, name)
    _check_attention(self)


def _check_attention(model: "Model"):
    """`Model.attention` is one of `ATTENTION`; "cudnn" with a compute dtype and head size
    cuDNN's flash attention takes. (Whether a GPU is there is checked where a run starts:
    `check_attention_backend`.)"""
    if model.attention not in ATTENTION:
        raise ValueError(f"Model.attention={model.attention!r} is invalid; valid: {', '.join(map(repr, ATTENTION))}")
    if model.context_attention not in CONTEXT_ATTENTION:
        raise ValueError(f"Model.context_attention={model.context_attention!r} is invalid; valid: "
                         f"{', '.join(map(repr, CONTEXT_ATTENTION))}")
    if model.attention != "cudnn":
        return
    check_cudnn_dtype("Model", model.dtype)
    head_dim = model.config.head_dim
    if head_dim % 8 or head_dim > 256:
        raise ValueError(f"Model.attention='cudnn' needs a head size that is a multiple of 8 and at most 256 (at most "
                         f"128 before Hopper GPUs); this model's is {head_dim}; use attention='xla'")


def check_cudnn_dtype(owner: str, dtype):
    """Refuse attention="cudnn" (set on `owner`: "Model", "LayoutConfig") with a compute
    dtype cuDNN's flash attention does not take."""
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float16"):
        raise ValueError(f"{owner}.attention='cudnn' needs a bfloat16 or float16 compute dtype (cuDNN's flash "
                         f"attention takes no float32), got dtype={name!r}; use dtype='bfloat16', or attention='xla'")


def check_attention_backend(models):
    """Refuse attention="cudnn" (among `models`: Models, others ignored, or attention
    names) where JAX's default backend is not a GPU, before anything compiles (cuDNN would
    fail only when a program is traced)."""
    names = [m.attention if isinstance(m, Model) else m for m in models]
    if "cudnn" in names and jax.default_backend() != "gpu":
        raise ValueError(f"attention='cudnn' (cuDNN flash attention) needs an NVIDIA GPU; JAX's backend here is "
                         f"{jax.default_backend()!r}. Use attention='xla' or 'einsum'")


def _response_top(model: "Model", params, query_tokens, query_mask, response_tokens, response_mask, k: int,
                  temperature=1.0):
    """(log-probs (B, R) of `response_tokens`, the k largest log-probs (B, R, k) at each
    response position and their token ids (B, R, k)), from one forward, the LM head at the
    response positions only (in chunks of `logits_chunk_size`): on-policy distillation's
    teacher with `distill_top_k` (`Model.response_top_logprobs`)."""
    if not model.is_causal_lm:
        raise ValueError(f"response_top_logprobs needs a causal LM; this model's kind is {model.kind!r}")
    q, r = query_tokens.shape[1], response_tokens.shape[1]
    tokens, mask = join_sequences(query_tokens, query_mask, response_tokens, response_mask)
    hidden = model.hidden(params, tokens, mask)[0][:, q - 1 : q - 1 + r]
    return top_logprobs(hidden, model.lm_head(params), response_tokens, k, temperature, model.logits_chunk_size)


def joined_inputs(query_tokens, query_mask, response_tokens, response_mask):
    """(tokens, mask, images, positions), each over the queries followed by the responses:
    `query_tokens` may be a vision-language model's `ImagePrompt` (its images, and its rotary
    positions continued through the responses); else images and positions are None (the
    positions then count along the mask)."""
    if not isinstance(query_tokens, ImagePrompt):
        return (*join_sequences(query_tokens, query_mask, response_tokens, response_mask), None, None)
    tokens, mask = join_sequences(query_tokens.ids, query_mask, response_tokens, response_mask)
    return tokens, mask, query_tokens.images, joined_positions(query_tokens, response_mask)


def _response_outputs(model: "Model", params, query_tokens, query_mask, response_tokens, response_mask,
                      temperature=1.0, also=None):
    """Log-probs (B, R) of `response_tokens` given the left-padded queries, per-position
    entropies (B, R) (float32, of softmax(logits / temperature)), and values (B, R) (a
    "causal_lm_value" model; None for "causal_lm"). Equal to slicing `apply`'s full logits
    at positions Q - 1 ... Q + R - 2, but the LM head runs only there, in chunks of
    `logits_chunk_size` positions when set; a "value" model gives (None, values, None).
    `query_tokens` may be an `ImagePrompt` (a vision-language model's queries with their
    images). The protocol by which built-in models score without full logits
    (`jaxppo.response_outputs`; `Model.response_outputs`)."""
    r = response_tokens.shape[1]
    tokens, mask, images, positions = joined_inputs(query_tokens, query_mask, response_tokens, response_mask)
    q = tokens.shape[1] - r
    if not model.is_causal_lm:  # position q - 1 + t predicts response token t
        values = model.apply(params, tokens, mask, images, positions)[:, q - 1 : q - 1 + r]
        return None, values.astype(jnp.float32), None
    hidden, values = model.hidden(params, tokens, mask, images, positions)
    logprobs, entropy = token_logprobs(hidden[:, q - 1 : q - 1 + r], model.lm_head(params),
                                       _targets(response_tokens, also), temperature, model.logits_chunk_size)
    values = None if values is None else values[:, q - 1 : q - 1 + r].astype(jnp.float32)
    return logprobs, values, entropy


def _routed_outputs(model: "Model", params, query_tokens, query_mask, response_tokens, response_mask, temperature=1.0,
                   replay=None, aux_loss=False):
    """`response_outputs` of a mixture of experts with its routing, from the same forward:
    ((log-probs, values, entropies), routing). `routing["chosen"]` (B, Q + R, layers, k)
    int32: the experts the router picks for every token of the joined sequence (its own
    choice, also under replay); with `aux_loss`, `routing["aux_loss"]`: the
    load-balancing loss over the real tokens, pooled over the layers as Hugging Face
    pools them (`jaxppo.models.moe.load_balancing_loss`). `replay` (B, Q + R, layers, k):
    compute with these experts instead of the router's choice (routing replay)."""
    if not model.config.num_experts or not model.is_causal_lm:
        raise ValueError(f"routed_outputs needs a causal LM with experts; this is a {model.config.model_type} "
                         f"{model.kind!r} model")
    q, r = query_tokens.shape[1], response_tokens.shape[1]
    tokens, mask = join_sequences(query_tokens, query_mask, response_tokens, response_mask)
    variables = dict(params)
    if replay is not None:
        variables["replay"] = _per_layer(model, replay)
    collections = ["router", "router_probs"] if aux_loss else ["router"]
    (hidden, values, _), sown = model.module.apply(variables, tokens, mask, default_positions(mask),
                                                  return_hidden=True, mutable=collections)
    logprobs, entropy = token_logprobs(hidden[:, q - 1 : q - 1 + r], model.lm_head(params), response_tokens,
                                       temperature, model.logits_chunk_size)
    values = None if values is None else values[:, q - 1 : q - 1 + r].astype(jnp.float32)
    routing = {"chosen": _layers_last(model, sown["router"], "chosen")}
    if aux_loss:
        probs = _layers_last(model, sown["router_probs"], "probs")
        real = jnp.broadcast_to(mask[:, :, None], probs.shape[:3])
        routing["aux_loss"] = load_balancing_loss(probs, routing["chosen"], real)
    return (logprobs, values, entropy), routing


@dataclasses.dataclass(frozen=True)
class Model:
    """A built-in model: `config`, `kind`, compute `dtype`, storage `param_dtype`, `remat`.

    remat: False (keep every activation for the backward pass), True or "full" (recompute
      each transformer block's forward in the backward pass, keeping only its input), or a
      policy name from `jax.checkpoint_policies` that says what each block keeps:
      "dots_saveable" (matmul outputs), "dots_with_no_batch_dims_saveable" (matmuls with
      no batch dimension: the projections, not attention scores), "nothing_saveable" (as
      True), "everything_saveable" (as False). Same outputs and gradients either way.
    scan_layers: stack the blocks' parameters on a leading layer axis and run them as one
      `nn.scan` (compile time and program size independent of depth; the layout real-size
      models want). Params then hold `layers` (`h` for GPT-2) with a leading num_layers
      axis instead of `layers_0` ... `layers_{n-1}`; `stack_layers` / `unstack_layers`
      convert between the two layouts, and `from_pretrained` / `save_pretrained` map
      Hugging Face's per-layer tensors to either. Same outputs and gradients either way.
    logits_chunk_size: for the log-probs of given tokens (`response_outputs`, which the PPO
      loss and rollout scoring use), apply the LM head this many positions at a time, each
      chunk's logits recomputed in the backward pass instead of stored (None: all response
      positions at once). Either way the head is applied only at the positions read, never
      to the whole (B, L, V) sequence; `apply` still returns full logits.
    lora: a `LoraConfig` puts low-rank adapters on the blocks' targeted linear layers
      (`jaxppo.models.lora`); variables are then {"params": base, "lora": adapters}.
      `jm.add_lora` / `jm.load_peft_adapter` make them; `save_pretrained` writes the
      merged weights, `jm.save_peft_adapter` the adapters alone.
    adapters: with `lora`, whether the adapters are applied. False is the base model on
      the same variables: the reference policy of a LoRA run, with no second copy.
    attention: how attention over a whole sequence (training, scoring, the prefill) is
      computed: "einsum" (jaxppo's own, the default), "xla" or "cudnn"
      (`jax.nn.dot_product_attention` with that implementation; "cudnn" is cuDNN's fused
      flash attention on NVIDIA GPUs and needs a bfloat16 or float16 `dtype` and a head
      size that is a multiple of 8, at most 256). Decode steps always use "einsum". The
      same outputs and gradients up to rounding.
    context_attention: how attention runs across a mesh's "context" axis, which splits each
      row's positions in a whole forward pass: "ring", "ulysses" or "auto"
      (`jaxppo.models.context`). The same outputs up to rounding; no effect without it.
    hoist_layers: with `scan_layers`, the samplers slice each layer's weights out of the
      stacked arrays once per call (matrices in the compute dtype) and decode through the
      unrolled layers, not slicing every layer at every step: faster, for a copy of the
      weights held while sampling. The unrolled layout's tokens (the scanned layout's up
      to rounding). No effect without `scan_layers` or outside the samplers.
    head_window: for `grouped_outputs`, apply the LM head at each row's last `head_window`
      attended positions of the response region only (their log-probs and entropies; 0 at
      the others). For a layout whose trained tokens are the last of each row's region: the
      common-prefix layout (`jaxppo.update.prefix`), where the region opens with the rest of
      the prompt and the response is at most `head_window` tokens; the trainer sets it to
      `response_length` there. None: every position."""

    config: ModelConfig
    kind: str = "causal_lm"
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: Union[bool, str] = False
    scan_layers: bool = False
    logits_chunk_size: Optional[int] = None
    lora: Optional[LoraConfig] = None
    adapters: bool = True
    attention: str = "einsum"
    context_attention: str = "auto"
    hoist_layers: bool = False
    head_window: Optional[int] = None

    def __post_init__(self):
        _check_model(self)

    @property
    def module(self):
        common = dict(config=self.config, dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype), remat=self.remat,
                      scan_layers=self.scan_layers, lora=self.lora, adapters=self.adapters, attention=self.attention,
                      context_attention=self.context_attention)
        if self.kind in ("causal_lm", "causal_lm_value"):
            return CausalLMModule(with_value_head=self.kind == "causal_lm_value", **common)
        return ScoreModule(num_labels=self.config.num_labels if self.kind == "reward" else 1,
                           zero_init=self.kind == "value", **common)

    def for_decoding(self, params):
        """(model, params) the samplers decode with: the matrices cast to the compute dtype
        once per call (`matrices_in_compute_dtype`); with `hoist_layers` and scanned layers,
        the unrolled layout, its per-layer weights sliced out here once."""
        if self.hoist_layers and self.scan_layers:
            unstacked = unstack_layers(params, self.config)
            return dataclasses.replace(self, scan_layers=False), matrices_in_compute_dtype(unstacked, self.dtype)
        return self, matrices_in_compute_dtype(params, self.dtype, self.config if self.scan_layers else None)

    @property
    def is_causal_lm(self) -> bool:
        return self.kind in ("causal_lm", "causal_lm_value")

    def init(self, key, seq_len: int = 8):
        """Random parameters (value heads at zero), compiled as one program (not a hundred small ones)."""
        return _init(self, key, seq_len)

    def apply(self, params, input_ids, attention_mask, images=None, positions=None):
        """Pure forward on a (left-)padded batch; output depends on `kind` (module doc). A
        vision-language model takes `images` and 3-D `positions` (`jaxppo.models.vision`)."""
        positions = default_positions(attention_mask) if positions is None else positions
        if self.is_causal_lm:
            logits, values, _ = self.module.apply(params, input_ids, attention_mask, positions, images=images)
            return logits if self.kind == "causal_lm" else (logits, values)
        scores = self.module.apply(params, input_ids, attention_mask, positions, images=images)
        if self.kind == "value":
            return scores[..., 0]
        # Reward: the score at each row's last scored token (`score_positions`).
        last = score_positions(input_ids, attention_mask, self.config.pad_token_id)
        picked = jnp.take_along_axis(scores, last[:, None, None], axis=1)[:, 0]
        return picked[:, 0] if self.config.num_labels == 1 else picked

    def lm_head(self, params) -> LMHead:
        """The output projection of a causal LM's params (tied embeddings or `lm_head`)."""
        p = params["params"]
        if self.config.tie_word_embeddings:
            table = p[trunk_name(self.config)][family_of(self.config).embed_name]["embedding"]
            return LMHead(table, True, jnp.dtype(self.dtype), self.config.final_logit_softcapping)
        return LMHead(p["lm_head"]["kernel"], False, jnp.dtype(self.dtype), self.config.final_logit_softcapping)

    def hidden(self, params, input_ids, attention_mask, images=None, positions=None):
        """Causal LM: final hidden states (B, L, D) and values (B, L) or None, no LM head
        (`images`, `positions` as `apply` takes them)."""
        if not self.is_causal_lm:
            raise ValueError(f"hidden needs a causal LM; this model's kind is {self.kind!r}")
        positions = default_positions(attention_mask) if positions is None else positions
        hidden, values, _ = self.module.apply(params, input_ids, attention_mask, positions, return_hidden=True,
                                              images=images)
        return hidden, values

    # Log-probs, values and entropies of given responses (the protocol of `jaxppo.response_outputs`);
    # a frozen teacher's forward pass with `distill_top_k`; a mixture of experts' outputs with its routing.
    response_outputs = _response_outputs
    response_top_logprobs = _response_top
    routed_outputs = _routed_outputs

    def grouped_outputs(self, params, query_tokens, query_mask, response_tokens, response_mask, temperature=1.0,
                        also=None):
        """`response_outputs` for rows in groups of G consecutive rows that share a prompt,
        each prompt run once: `query_tokens` / `query_mask` are (B/G, Q), one per group,
        `response_tokens` / `response_mask` (B, R). The same (log-probs, values, entropies),
        each (B, R), up to float rounding; a causal LM's values are None without a value
        head, a "value" model gives (None, values, None); `also` as there.
        The prompts run first (B/G rows) and keep their keys and values per layer; the
        responses then run against them, each group's prompt slots read once for its G
        rows (the sampler's grouped cache, `GroupedKV`). Under `jax.grad` the prompts'
        activations receive the sum of their G responses' gradients. The LM head runs at
        the positions that predict response tokens only: the prompt's last position for
        token 0, the response's own positions after it; with `head_window`, at each row's last
        `head_window` attended positions only (0 at the others)."""
        hidden, values = _grouped_hidden(self, params, query_tokens, query_mask, response_tokens, response_mask)
        values = None if values is None else values.astype(jnp.float32)
        if not self.is_causal_lm:
            return None, values, None
        logprobs, entropy = _head_outputs(self, params, hidden, response_tokens, response_mask, temperature, also)
        return logprobs, values, entropy

    def packed_outputs(self, params, tokens, segment_ids, positions, targets, temperature=1.0):
        """Outputs over packed streams (`jaxppo.update.packing`): tokens, segment_ids (0 at the
        unused tail), positions and targets, each (S, T). A causal LM gives the log-probs of
        `targets` (the token each position predicts), entropies and values (or None); a
        "value" model gives (None, values, None). Each (S, T) float32; a token attends only
        to its own segment."""
        mask = segment_ids > 0
        if self.kind == "value":
            values = self.module.apply(params, tokens, mask, positions, segment_ids=segment_ids)[..., 0]
            return None, values.astype(jnp.float32), None
        if not self.is_causal_lm:
            raise ValueError(f"packed_outputs needs a causal LM or a value model; this model's kind is {self.kind!r}")
        hidden, values, _ = self.module.apply(params, tokens, mask, positions, return_hidden=True,
                                              segment_ids=segment_ids)
        logprobs, entropy = token_logprobs(hidden, self.lm_head(params), targets, temperature, self.logits_chunk_size)
        return logprobs, None if values is None else values.astype(jnp.float32), entropy

    def init_cache(self, batch: int, max_len: int):
        """Zeroed KV cache: per layer (k, v), each (batch, max_len, num_kv_heads, head_dim);
        with `scan_layers` one (k, v) pair, each (num_layers, batch, max_len, ...)."""
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        if self.scan_layers:
            shape = (c.num_layers,) + shape
            return jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)
        return tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype)) for _ in range(c.num_layers))

    def grouped_cache(self, prefix_cache, batch: int, response_len: int):
        """A cache for `batch` rows in groups sharing a prompt (`GroupedKV`): `prefix_cache`,
        an `init_cache`-shaped cache of the groups' prompt slots (after their prefill), kept
        once per group, and zeroed response slots, `response_len` per row."""
        c = self.config
        shape = (batch, response_len, c.num_kv_heads, c.head_dim)
        if self.scan_layers:
            zeros = jnp.zeros((c.num_layers,) + shape, self.dtype)
            return GroupedKV(prefix_cache[0], prefix_cache[1], zeros, zeros)
        zeros = jnp.zeros(shape, self.dtype)
        return tuple(GroupedKV(k, v, zeros, zeros) for k, v in prefix_cache)

    def decode(self, params, input_ids, attention_mask, positions, cache, cache_index, last_only=False, images=None):
        """Causal-LM forward of new tokens against a KV cache -> (logits (B, Lq, V), cache);
        with `last_only` the LM head runs at the last query position only: (B, 1, V).
        `attention_mask` (B, Lmax) marks the valid cache slots, the new tokens' included;
        `images`: a vision-language model's images of these tokens (a prefill's)."""
        if not self.is_causal_lm:
            raise ValueError(f"decode needs a causal LM; this model's kind is {self.kind!r}")
        args = (params, input_ids, attention_mask, positions, cache, cache_index)
        if last_only:
            hidden, _, cache = self.module.apply(*args, return_hidden=True, images=images)
            return self.lm_head(params).logits(hidden[:, -1:]), cache
        logits, _, cache = self.module.apply(*args, images=images)
        return logits, cache


@dataclasses.dataclass(frozen=True)
class PolicyAndCritic:
    """`apply_fn(params, tokens, mask) -> (logits, values)` over a policy and a separate
    critic, with params `{"policy": ..., "critic": ...}` (TRL's default design).

    Use it as `TrainState.apply_fn`; give the two parts their own learning rates with
    `optax.multi_transform`."""

    policy: Model
    critic: Model

    def __post_init__(self):
        if self.policy.kind != "causal_lm":
            raise ValueError(f"policy must be a 'causal_lm' Model, got kind {self.policy.kind!r}")
        if self.critic.kind != "value":
            raise ValueError(f"critic must be a 'value' Model, got kind {self.critic.kind!r}")

    def __call__(self, params, tokens, mask):
        logits = self.policy.apply(params["policy"], tokens, mask)
        values = self.critic.apply(params["critic"], tokens, mask)
        return logits, values

    def response_outputs(self, params, query_tokens, query_mask, response_tokens, response_mask, temperature=1.0):
        """(log-probs, values, entropies), each (B, R), without full logits (see
        `Model.response_outputs`)."""
        logprobs, _, entropy = self.policy.response_outputs(params["policy"], query_tokens, query_mask,
                                                            response_tokens, response_mask, temperature)
        values = self.critic.response_outputs(params["critic"], query_tokens, query_mask, response_tokens,
                                              response_mask)[1]
        return logprobs, values, entropy

    def routed_outputs(self, params, query_tokens, query_mask, response_tokens, response_mask, temperature=1.0,
                       replay=None, aux_loss=False):
        """The policy's `Model.routed_outputs` (its routing, replayed where given), the
        critic's values beside them."""
        (logprobs, _, entropy), routing = self.policy.routed_outputs(
            params["policy"], query_tokens, query_mask, response_tokens, response_mask, temperature, replay, aux_loss)
        values = self.critic.response_outputs(params["critic"], query_tokens, query_mask, response_tokens,
                                              response_mask)[1]
        return (logprobs, values, entropy), routing

    def grouped_outputs(self, params, query_tokens, query_mask, response_tokens, response_mask, temperature=1.0):
        """(log-probs, values, entropies), each (B, R), each group's prompt run once by the
        policy and by the critic (see `Model.grouped_outputs`)."""
        logprobs, _, entropy = self.policy.grouped_outputs(params["policy"], query_tokens, query_mask,
                                                           response_tokens, response_mask, temperature)
        values = self.critic.grouped_outputs(params["critic"], query_tokens, query_mask, response_tokens,
                                             response_mask)[1]
        return logprobs, values, entropy

    def packed_outputs(self, params, tokens, segment_ids, positions, targets, temperature=1.0):
        """(log-probs, values, entropies) over packed streams (see `Model.packed_outputs`)."""
        logprobs, _, entropy = self.policy.packed_outputs(params["policy"], tokens, segment_ids, positions, targets,
                                                          temperature)
        values = self.critic.packed_outputs(params["critic"], tokens, segment_ids, positions, targets)[1]
        return logprobs, values, entropy


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init(model: Model, key, seq_len: int):
    ids = jnp.zeros((1, seq_len), jnp.int32)
    mask = jnp.ones_like(ids)
    return model.module.init(key, ids, mask, default_positions(mask))


def _grouped_hidden(model: "Model", params, query_tokens, query_mask, response_tokens, response_mask):
    """(hidden states (B, R, D) or None, values or scores (B, R) or None) at the positions
    that predict each response token, the groups' prompts run once."""
    ids = query_tokens.ids if isinstance(query_tokens, ImagePrompt) else query_tokens
    groups, q = ids.shape
    b = response_tokens.shape[0]
    if b % groups:
        raise ValueError(f"grouped outputs: {b} response rows do not come in groups of the {groups} prompts")
    g = b // groups

    def run(ids, kv_mask, positions, cache, index, images=None):
        if model.is_causal_lm:
            return model.module.apply(params, ids, kv_mask, positions, cache, index, return_hidden=True, images=images)
        scores, cache = model.module.apply(params, ids, kv_mask, positions, cache=cache, cache_index=index,
                                           images=images)
        return None, scores[..., 0], cache

    kv_mask = jnp.concatenate([jnp.repeat(query_mask, g, axis=0), response_mask.astype(query_mask.dtype)], axis=1)
    if isinstance(query_tokens, ImagePrompt):  # each group's images encoded once, with its prompt
        prompt_run = (query_tokens.positions, query_tokens.images)
        after = response_positions(jnp.repeat(query_tokens.next_position, g, axis=0), response_mask,
                                   jnp.ndim(query_tokens.positions))
    else:
        prompt_run, after = (default_positions(query_mask), None), default_positions(kv_mask)[:, q:]
    hidden_p, values_p, cache = run(ids, query_mask, prompt_run[0], model.init_cache(groups, q), 0, prompt_run[1])
    hidden_r, values_r, _ = run(response_tokens, kv_mask, after, model.grouped_cache(cache, b, 0), q)

    def predicting(prompt, response):  # the prompt's last position, then the response's own but its last
        if prompt is None:
            return None
        return jnp.concatenate([jnp.repeat(prompt[:, -1:], g, axis=0), response[:, :-1]], axis=1)

    return predicting(hidden_p, hidden_r), predicting(values_p, values_r)


def _layers_last(model: "Model", sown, name: str):
    """A value every MoE layer `sow`ed (each (B, L, ...)) as one array (B, L, layers, ...)."""
    trunk, prefix = sown[trunk_name(model.config)], layer_prefix(model.config)
    if model.scan_layers:  # stacked by the layer scan: (layers, B, L, ...)
        return jnp.moveaxis(trunk[prefix]["moe"][name][0], 0, 2)
    return jnp.stack([trunk[f"{prefix}_{i}"]["moe"][name][0] for i in range(model.config.num_layers)], axis=2)


def _per_layer(model: "Model", routing):
    """The "replay" collection of `routing` (B, L, layers, k): each layer's `chosen`, stacked
    on a leading layer axis for the layer scan."""
    prefix = layer_prefix(model.config)
    if model.scan_layers:
        layers = {prefix: {"moe": {"chosen": jnp.moveaxis(routing, 2, 0)}}}
    else:
        layers = {f"{prefix}_{i}": {"moe": {"chosen": routing[:, :, i]}} for i in range(model.config.num_layers)}
    return {trunk_name(model.config): layers}


def _targets(response_tokens, also):
    """The ids whose log-probs a forward reads: the response tokens (B, R), or with `also`
    (B, R, m) those first, then `also`'s (B, R, 1 + m)."""
    if also is None:
        return response_tokens
    return jnp.concatenate([response_tokens[..., None], also.astype(response_tokens.dtype)], axis=-1)


def _head_outputs(model: "Model", params, hidden, response_tokens, response_mask, temperature, also=None):
    """(log-probs, entropies) of the response tokens (with `also`, (B, R, 1 + m): `_targets`)
    from the hidden states that predict them (B, R, D): the LM head at every position, or
    with `head_window` w at each row's last w attended positions (its attended region a
    prefix of ones; from 0 where it holds fewer), 0 at the others."""
    w, head, targets = model.head_window, model.lm_head(params), _targets(response_tokens, also)
    if w is None or w >= targets.shape[1]:
        return token_logprobs(hidden, head, targets, temperature, model.logits_chunk_size)
    end = jnp.sum(response_mask > 0, axis=1)
    index = jnp.maximum(end - w, 0)[:, None] + jnp.arange(w)[None, :]  # (B, w)
    extra = (slice(None), slice(None)) + (None,) * (targets.ndim - 2)
    picked, entropy = token_logprobs(jnp.take_along_axis(hidden, index[:, :, None], axis=1), head,
                                     jnp.take_along_axis(targets, index[extra], axis=1), temperature,
                                     model.logits_chunk_size)
    rows = jnp.arange(index.shape[0])[:, None]
    spread = lambda x: jnp.zeros(targets.shape[:2] + x.shape[2:], x.dtype).at[rows, index].set(x)  # noqa: E731
    return spread(picked), spread(entropy)


def scored_mask(input_ids, attention_mask, pad_token_id):
    """The tokens a reward model may read its score at: real tokens (`attention_mask`) that
    are not the padding token, transformers' rule for `...ForSequenceClassification`
    (which reads the score at the last token that is not `pad_token_id`). Where the padding
    token is the EOS token (Llama, Qwen, SmolLM2) a sequence ending with EOS is scored at
    the token before it, as transformers and TRL score it. A row of padding tokens only
    keeps its real tokens."""
    mask = attention_mask.astype(jnp.int32)
    if pad_token_id is None:
        return mask
    kept = mask * (input_ids != pad_token_id).astype(jnp.int32)
    return jnp.where(jnp.any(kept > 0, axis=1, keepdims=True), kept, mask)


def score_positions(input_ids, attention_mask, pad_token_id):
    """(B,) int: each row's last token of `scored_mask`, where a reward model reads its score."""
    mask = scored_mask(input_ids, attention_mask, pad_token_id)
    return mask.shape[1] - 1 - jnp.argmax(jnp.flip(mask, axis=1), axis=1)


def join_sequences(query_tokens, query_mask, response_tokens, response_mask):
    """(tokens, mask), each (B, Q + R): the left-padded queries followed by the responses.
    Position Q - 1 + t of the joined sequence predicts response token t."""
    return (jnp.concatenate([query_tokens, response_tokens], axis=1),
            jnp.concatenate([query_mask, response_mask], axis=1))


def is_model_spec(spec) -> bool:
    """Whether `spec` names a model (a checkpoint path or a `(Model, params)` pair) rather
    than a reward function."""
    return isinstance(spec, (str, os.PathLike)) or (isinstance(spec, tuple) and len(spec) == 2
                                                    and isinstance(spec[0], Model))


def describe_model(spec, model, dtype) -> dict:
    """A model's identity for the run settings: its checkpoint path (when loaded from one),
    its architecture, kind and dtypes."""
    out = {"path": os.path.abspath(os.fspath(spec))} if isinstance(spec, (str, os.PathLike)) else {}
    if model is None and isinstance(spec, tuple):
        model = spec[0]
    if model is not None:
        out.update(config=model.config.settings(), kind=model.kind, dtype=str(jnp.dtype(model.dtype)),
                   param_dtype=str(jnp.dtype(model.param_dtype)))
        if model.scan_layers:  # another parameter layout: its checkpoints do not fit the other
            out["scan_layers"] = True
        if model.lora is not None:
            out["lora"] = {"rank": model.lora.rank, "alpha": model.lora.alpha, "targets": list(model.lora.targets),
                           **({"vision": True} if model.lora.vision else {})}
    else:
        out["dtype"] = dtype
    return out
