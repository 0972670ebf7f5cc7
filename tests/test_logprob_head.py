"""Log-probs without full logits: the built-in models' `response_outputs` (LM head at the
response positions only, optionally in rematerialised chunks) against slicing the full
(B, L, V) logits, which is what any user `apply_fn` gets."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.update.batch import scorer
from jaxppo.update.objective import total_loss

Q, R, V = 5, 6, 61


def _config(model_type, tie):
    return jm.ModelConfig(model_type=model_type, vocab_size=V, hidden_size=16, num_layers=2, num_heads=2,
                          num_kv_heads=1 if model_type == "llama" else 2, intermediate_size=32,
                          max_position_embeddings=32, tie_word_embeddings=tie)


def _batch(seed=0, b=4):
    rng = np.random.default_rng(seed)
    pads = np.array([0, 2, 4, 1][:b])[:, None]  # left padding, one row unpadded
    lengths = np.array([R, 3, 1, 5][:b])[:, None]
    return {
        "query_tokens": jnp.asarray(rng.integers(0, V, (b, Q)), jnp.int32),
        "query_mask": jnp.asarray(np.arange(Q)[None] >= pads, jnp.int32),
        "response_tokens": jnp.asarray(rng.integers(0, V, (b, R)), jnp.int32),
        "response_mask": jnp.asarray(np.arange(R)[None] < lengths, jnp.int32),
        "logprobs": jnp.asarray(-np.log(V) + 0.3 * rng.normal(size=(b, R)), jnp.float32),
        "values": jnp.asarray(0.5 * rng.normal(size=(b, R)), jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=(b, R)), jnp.float32),
        "returns": jnp.asarray(rng.normal(size=(b, R)), jnp.float32),
    }


def _full_logits(apply_fn):
    """The same forward without the protocol: full logits, sliced (any user apply_fn)."""
    fn = lambda params, tokens, mask: apply_fn(params, tokens, mask)
    assert scorer(fn) is None
    return fn


def _models(kind, model_type, tie, chunk):
    cfg = _config(model_type, tie)
    if kind == "shared":
        model = jm.Model(cfg, kind="causal_lm_value", logits_chunk_size=chunk)
        params = model.init(jax.random.key(0))
        head = params["params"]["value_head"]
        params["params"]["value_head"] = {"kernel": jax.random.normal(jax.random.key(2), head["kernel"].shape) * 0.1,
                                          "bias": head["bias"]}
        return model.apply, params
    policy = jm.Model(cfg, logits_chunk_size=chunk)
    critic = jm.Model(cfg, kind="value")
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    params["critic"]["params"]["score"]["kernel"] = jax.random.normal(jax.random.key(3), (16, 1)) * 0.1
    return jm.PolicyAndCritic(policy, critic), params


CASES = [("separate", "llama", False, None), ("separate", "llama", False, 2), ("separate", "llama", True, 4),
         ("shared", "gpt2", True, 4), ("shared", "llama", False, 6), ("separate", "gpt2", True, 1)]


@pytest.mark.parametrize("kind,model_type,tie,chunk", CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("ent_coef", [0.0, 0.05])
def test_loss_and_gradients_equal_the_full_logits_path(kind, model_type, tie, chunk, ent_coef):
    apply_fn, params = _models(kind, model_type, tie, chunk)
    assert scorer(apply_fn) is not None
    batch = _batch()
    config = jaxppo.Config.from_settings(batch_size=4, mini_batch_size=4, temperature=0.7, ent_coef=ent_coef, cliprange=0.1)

    outs = [jaxppo.update.response_outputs(fn, params, batch, 0.7) for fn in (apply_fn, _full_logits(apply_fn))]
    for a, b in zip(*outs):  # log-probs, values, entropies
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)

    grads = [jax.value_and_grad(total_loss, has_aux=True)(params, batch, apply_fn=fn, config=config)
             for fn in (apply_fn, _full_logits(apply_fn))]
    (loss, aux), g = grads[0]
    (ref_loss, ref_aux), ref_g = grads[1]
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, atol=1e-6)
    for name in aux:
        np.testing.assert_allclose(float(aux[name]), float(ref_aux[name]), rtol=1e-5, atol=1e-6, err_msg=name)
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(ref_g))
    assert scale > 1e-3  # gradients that are not all ~0
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5 * scale, rtol=1e-5)


def test_train_step_with_chunked_head_equals_full_logits():
    apply_fn, params = _models("separate", "llama", False, 4)
    b = _batch()
    rollout = jaxppo.RolloutBatch(query_tokens=b["query_tokens"], query_mask=b["query_mask"],
                                  response_tokens=b["response_tokens"], response_mask=b["response_mask"],
                                  logprobs=b["logprobs"], values=b["values"], rewards=b["advantages"])
    config = jaxppo.Config.from_settings(batch_size=4, mini_batch_size=2, ppo_epochs=2, temperature=0.9)
    outs = []
    for fn in (apply_fn, _full_logits(apply_fn)):
        state = jaxppo.TrainState.create(apply_fn=fn, params=params, tx=optax.adam(1e-2, eps=1e-3))
        outs.append(jaxppo.train_step(state, rollout, jax.random.key(0), config))
    assert int(outs[0][0].step) == int(outs[1][0].step) == config.batch.updates_per_step
    for a, b in zip(jax.tree.leaves(outs[0][0].params), jax.tree.leaves(outs[1][0].params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_reference_scoring_and_prefill_use_no_full_logits_and_agree():
    """The rollout's reference log-probs (through `scorer`) and the sampler's prefill (the
    head at the last prompt position only) equal the full-logits computations."""
    model = jm.Model(_config("llama", True), logits_chunk_size=4)
    params = model.init(jax.random.key(0))
    b = _batch()
    lp, values, _ = scorer(model.apply)(params, b["query_tokens"], b["query_mask"], b["response_tokens"],
                                        b["response_mask"], 0.8)
    assert values is None
    tokens = jnp.concatenate([b["query_tokens"], b["response_tokens"]], axis=1)
    mask = jnp.concatenate([b["query_mask"], b["response_mask"]], axis=1)
    full = model.apply(params, tokens, mask)
    want = jaxppo.update.losses.logprobs_from_logits(full[:, Q - 1 : Q - 1 + R], b["response_tokens"], 0.8)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want), atol=1e-5)
    cache = model.init_cache(4, Q + 2)
    kv = jnp.concatenate([b["query_mask"], jnp.zeros((4, 2), jnp.int32)], axis=1)
    last, _ = model.decode(params, b["query_tokens"], kv, jm.default_positions(b["query_mask"]), cache, 0,
                           last_only=True)
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, Q - 1]), atol=1e-5)


def _loss_grad_temp_bytes(chunk):
    cfg = jm.ModelConfig(model_type="llama", vocab_size=4096, hidden_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=False)
    if chunk == "full":
        fn = _full_logits(jm.Model(cfg, kind="causal_lm_value").apply)
    else:
        fn = jm.Model(cfg, kind="causal_lm_value", logits_chunk_size=chunk).apply
    params = jax.eval_shape(lambda: jm.Model(cfg, kind="causal_lm_value").init(jax.random.key(0)))
    b, q, r = 4, 64, 64
    spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype)
    batch = {"query_tokens": spec((b, q), jnp.int32), "query_mask": spec((b, q), jnp.int32),
             "response_tokens": spec((b, r), jnp.int32), "response_mask": spec((b, r), jnp.int32),
             "logprobs": spec((b, r)), "values": spec((b, r)), "advantages": spec((b, r)), "returns": spec((b, r))}
    config = jaxppo.Config.from_settings(batch_size=4, mini_batch_size=4)
    grad = jax.jit(jax.grad(lambda p, mb: total_loss(p, mb, apply_fn=fn, config=config)[0]))
    return grad.lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_compiled_temporaries_fall_without_full_logits():
    """Structural (compiled memory, nothing allocated): the head at response positions only
    needs less than full logits, and chunks of 8 less again."""
    full, response_only, chunked = (_loss_grad_temp_bytes(c) for c in ("full", None, 8))
    logits_bytes = 4 * 128 * 4096 * 4  # one float32 (B, L, V)
    assert full > response_only > chunked, (full, response_only, chunked)
    assert full - chunked > logits_bytes, (full, chunked)


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="Model.logits_chunk_size=0 is invalid; use None .* or a positive int"):
        jm.Model(_config("llama", True), logits_chunk_size=0)
