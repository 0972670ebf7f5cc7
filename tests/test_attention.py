"""`Model.attention`: attention over whole sequences through `jax.nn.dot_product_attention`
("xla" here; "cudnn" needs an NVIDIA GPU) against jaxppo's own einsum path and against
Hugging Face transformers on the same weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import hf_models
import jaxppo
import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate

ARCHS = {
    "gpt2": dict(model_type="gpt2"),
    "llama-gqa": dict(model_type="llama", num_kv_heads=2),
    "gemma3-sliding": dict(model_type="gemma3_text", num_kv_heads=1, sliding_window=3, query_pre_attn_scalar=24,
                           layer_types=("sliding_attention", "full_attention")),
}


def _model(arch, scan, attention="einsum"):
    config = jm.ModelConfig(**{**dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=4,
                                      intermediate_size=64, max_position_embeddings=32), **ARCHS[arch]})
    return jm.Model(config, scan_layers=scan, attention=attention)


def _batch():
    ids = jax.random.randint(jax.random.key(1), (3, 9), 3, 64)
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9, [0, 0, 0, 0, 1, 1, 1, 1, 1]])
    return ids, mask


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_xla_attention_equals_einsum_logits_and_gradients(arch, scan, monkeypatch):
    model = _model(arch, scan)
    params = model.init(jax.random.key(0))
    xla = dataclasses.replace(model, attention="xla")
    calls = []
    real_attention = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda *a, **k: calls.append(k["implementation"]) or real_attention(*a, **k))
    ids, mask = _batch()
    real = np.asarray(mask, bool)  # logits at padding slots are meaningless either way

    def loss(m, p):
        return jnp.sum(jax.nn.log_softmax(m.apply(p, ids, mask))[..., 5] * mask)

    ours = np.asarray(model.apply(params, ids, mask))
    assert not calls
    theirs = np.asarray(xla.apply(params, ids, mask))
    assert set(calls) == {"xla"} and len(calls) >= (1 if scan else 2)  # each layer (the scan traces its body)
    assert np.abs(ours[real]).max() > 1.0
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-5, rtol=0)
    g1, g2 = jax.grad(lambda p: loss(model, p))(params), jax.grad(lambda p: loss(xla, p))(params)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g1)) > 1e-2
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_xla_attention_matches_transformers(hf_checkpoints, name):
    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=True)
    model = dataclasses.replace(model, attention="xla")
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(3), 4, 11)
    ours = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          position_ids=torch.tensor(positions)).logits.numpy()
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


def test_xla_attention_in_packed_streams_and_the_prefill():
    model = _model("llama-gqa", scan=True)
    params = model.init(jax.random.key(0))
    xla = dataclasses.replace(model, attention="xla")
    # Two streams: rows of 4 and 3 tokens, then one of 6 and an unused tail.
    segments = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    positions = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 0, 0]])
    tokens = jax.random.randint(jax.random.key(2), segments.shape, 3, 64)
    targets = jnp.roll(tokens, -1, axis=1)
    lp1, _, ent1 = model.packed_outputs(params, tokens, segments, positions, targets)
    lp2, _, ent2 = xla.packed_outputs(params, tokens, segments, positions, targets)
    used = np.asarray(segments > 0)
    np.testing.assert_allclose(np.asarray(lp2)[used], np.asarray(lp1)[used], atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent2)[used], np.asarray(ent1)[used], atol=1e-5, rtol=0)
    # Sampling: the prefill goes through jax's attention, decode steps through the einsum.
    ids, mask = _batch()
    settings = dict(response_length=5, greedy=True, stop_token_ids=None, pad_token_id=0)
    out1 = generate(model, params, ids, mask, jax.random.key(4), **settings)
    out2 = generate(xla, params, ids, mask, jax.random.key(4), **settings)
    np.testing.assert_array_equal(np.asarray(out2.tokens), np.asarray(out1.tokens))
    np.testing.assert_allclose(np.asarray(out2.logprobs), np.asarray(out1.logprobs), atol=1e-5, rtol=0)


def test_trainer_settings_reach_the_models(tmp_path):
    from trainer_setup import small_trainer

    trainer = small_trainer(tmp_path, iterations=1, attention="xla", hoist_layers=True)
    critic = trainer.state.apply_fn.critic
    assert (trainer.policy_model.attention, critic.attention) == ("xla", "xla")
    assert trainer.parts.spec.policy.hoist_layers  # the sampler's model
    assert trainer.parts.spec.ref_apply.model.attention == "xla"


def test_attention_settings_are_checked(tmp_path):
    model = _model("llama-gqa", scan=False)
    with pytest.raises(ValueError, match=r"Model.attention='flash' is invalid; valid: 'einsum', 'xla', 'cudnn'"):
        dataclasses.replace(model, attention="flash")
    with pytest.raises(ValueError, match=r"attention='cudnn' needs a bfloat16 or float16 compute dtype.*'float32'"):
        dataclasses.replace(model, attention="cudnn")
    odd = jm.ModelConfig(model_type="llama", vocab_size=64, hidden_size=36, num_layers=1, num_heads=3,
                         num_kv_heads=3, intermediate_size=64, max_position_embeddings=32)  # head size 12
    with pytest.raises(ValueError, match="head size that is a multiple of 8 and at most 256.*is 12"):
        jm.Model(odd, dtype="bfloat16", attention="cudnn")
    with pytest.raises(ValueError, match=r"LayoutConfig.attention='flash' is invalid"):
        jaxppo.Config.from_settings(attention="flash")
    if jax.default_backend() != "gpu":  # refused before any weights load or anything compiles
        from trainer_setup import small_trainer

        with pytest.raises(ValueError, match="needs a bfloat16 or float16 compute dtype"):
            small_trainer(tmp_path, attention="cudnn")
        bf16 = dataclasses.replace(model, dtype="bfloat16", attention="cudnn")
        with pytest.raises(ValueError, match="attention='cudnn' .*needs an NVIDIA GPU; JAX's backend here is 'cpu'"):
            jm.check_attention_backend([bf16])
