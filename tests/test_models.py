"""Built-in models against Hugging Face transformers (PyTorch, CPU) on the same weights."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import hf_models
import jaxppo
import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate

CAUSAL = ("gpt2", "llama", "qwen2", "qwen3", "gemma3", "mistral", "qwen3_moe", "mixtral")
REWARD = ("gpt2-reward", "llama-reward", "qwen3-reward", "gemma3-reward", "qwen3_moe-reward")
MODEL_TYPE = {"gemma3": "gemma3_text"}


def _torch_outputs(torch_model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          position_ids=torch.tensor(positions))
    return out.logits.numpy()


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", CAUSAL)
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_causal_lm_logits_match_transformers(hf_checkpoints, name, padded, scan):
    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=scan)
    assert model.kind == "causal_lm" and model.config.model_type == MODEL_TYPE.get(name, name)
    rng = np.random.default_rng(1)
    if padded:
        ids, mask = hf_models.left_padded_batch(rng, 4, 11)
    else:
        ids = rng.integers(3, hf_models.VOCAB, size=(4, 11))
        mask = np.ones_like(ids)
    ours = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _torch_outputs(torch_model, ids, mask)
    real = mask.astype(bool)  # logits at padding slots are meaningless in both
    assert np.abs(ref[real]).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", REWARD)
def test_reward_scores_match_transformers(hf_checkpoints, name, scan):
    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=scan)
    assert model.kind == "reward"
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(2), 5, 9)
    scores = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _torch_outputs(torch_model, ids, mask)[:, 0]
    assert scores.shape == (5,)
    np.testing.assert_allclose(scores, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generation_matches_transformers(hf_checkpoints, name, scan):
    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=scan)
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(3), 4, 7, min_len=3)
    r = 12
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), response_length=r,
                      greedy=True, stop_token_ids=(2,), pad_token_id=0)
    with torch.no_grad():
        ref = torch_model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=r,
                                   min_new_tokens=0, do_sample=False, eos_token_id=2, pad_token_id=0).numpy()[:, ids.shape[1]:]
    ref = np.pad(ref, ((0, 0), (0, r - ref.shape[1])), constant_values=0)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", CAUSAL + ("gpt2-reward", "gemma3-reward", "qwen3_moe-reward"))
def test_export_then_transformers_load_gives_same_logits(hf_checkpoints, tmp_path, name, scan):
    import transformers

    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=scan)
    # Change the weights so that the export cannot pass by copying the input files.
    params = jax.tree.map(lambda x: x * 1.01, params)
    out_dir = str(tmp_path / "export")
    jm.save_pretrained(model, params, out_dir)
    cls = transformers.AutoModelForSequenceClassification if model.kind == "reward" else transformers.AutoModelForCausalLM
    reloaded = cls.from_pretrained(out_dir).eval()
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(4), 3, 8)
    ours = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _torch_outputs(reloaded, ids, mask)
    if model.kind == "reward":
        np.testing.assert_allclose(ours, ref[:, 0], atol=1e-4, rtol=0)
    else:
        real = mask.astype(bool)
        np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
    # And jaxppo reads its own export back exactly.
    model2, params2 = jm.from_pretrained(out_dir, scan_layers=scan)
    assert model2 == model
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sharded_checkpoint_and_bf16(hf_checkpoints, tmp_path):
    path, torch_model = hf_checkpoints["llama"]
    sharded = str(tmp_path / "sharded")
    torch_model.save_pretrained(sharded, max_shard_size="20KB", safe_serialization=True)
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    model, params = jm.from_pretrained(sharded)
    ref_model, ref_params = jm.from_pretrained(path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    bf_model, bf_params = jm.from_pretrained(path, dtype="bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(bf_params))
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(5), 2, 6)
    f32 = np.asarray(ref_model.apply(ref_params, jnp.asarray(ids), jnp.asarray(mask)))
    bf = np.asarray(bf_model.apply(bf_params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(bf[real] - f32[real]).max() < 0.1 * np.abs(f32[real]).max()


@pytest.mark.parametrize("remat,scan", [(True, False), ("dots_saveable", False), ("dots_with_no_batch_dims_saveable", False),
                                        ("nothing_saveable", False), (False, True), (True, True),
                                        ("dots_with_no_batch_dims_saveable", True)])
def test_remat_same_logits_and_gradients(hf_checkpoints, remat, scan):
    path, _ = hf_checkpoints["qwen2"]
    model, params = jm.from_pretrained(path)
    remat_model, remat_params = jm.from_pretrained(path, remat=remat, scan_layers=scan)
    if scan:  # the same tensors, stacked on a layer axis
        assert remat_params["params"]["model"]["layers"]["q_proj"]["kernel"].shape[0] == model.config.num_layers
        for a, b in zip(jax.tree.leaves(jm.unstack_layers(remat_params, model.config)), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(6), 2, 6)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)

    def loss(m, p):
        return jnp.sum(jax.nn.log_softmax(m.apply(p, ids, mask))[..., 5] * mask)

    np.testing.assert_allclose(loss(remat_model, remat_params), loss(model, params), rtol=1e-6)
    g1 = jax.grad(lambda p: loss(model, p))(params)
    g2 = jax.grad(lambda p: loss(remat_model, p))(remat_params)
    if scan:
        g2 = jm.unstack_layers(g2, model.config)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_remat_names_are_checked():
    config = jm.ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=1, intermediate_size=32, max_position_embeddings=32)
    assert jm.Model(config, remat="full").remat is True
    with pytest.raises(ValueError, match="Model.remat='dots' is invalid; valid: False, True .*dots_saveable"):
        jm.Model(config, remat="dots")
    with pytest.raises(ValueError, match="Model.scan_layers='yes' is invalid; use True or False"):
        jm.Model(config, scan_layers="yes")
    params = jm.Model(config).init(jax.random.key(0))
    with pytest.raises(ValueError, match="unstack_layers needs the stacked layout"):
        jm.unstack_layers(params, config)
    with pytest.raises(ValueError, match="is already stacked|missing"):
        jm.stack_layers(jm.stack_layers(params, config), config)


def test_value_heads(hf_checkpoints):
    policy_path, _ = hf_checkpoints["gpt2"]
    reward_path, reward_torch = hf_checkpoints["gpt2-reward"]
    lm, lm_params = jm.from_pretrained(policy_path)
    lmv, lmv_params = jm.from_pretrained(policy_path, kind="causal_lm_value")
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(7), 3, 8)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    logits, values = lmv.apply(lmv_params, ids, mask)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(lm.apply(lm_params, ids, mask)))
    assert values.shape == (3, 8) and not np.any(np.asarray(values)), "value head starts at zero"

    # A critic on a separate trunk, initialised from the reward model: per-token values
    # equal the reward model's per-token scores.
    critic, critic_params = jm.from_pretrained(reward_path, kind="value")
    values = np.asarray(critic.apply(critic_params, ids, mask))
    ref = _torch_outputs(reward_torch, np.asarray(ids), np.asarray(mask))  # scores at the last real token
    np.testing.assert_allclose(values[:, -1], ref[:, 0], atol=1e-4)
    # From a causal LM checkpoint the critic's head starts at zero.
    critic0, critic0_params = jm.from_pretrained(policy_path, kind="value")
    assert not np.any(np.asarray(critic0.apply(critic0_params, ids, mask)))

    # Policy + separate critic through train_step: the pinned update count holds.
    apply_fn = jm.PolicyAndCritic(lm, critic)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params={"policy": lm_params, "critic": critic_params},
                                     tx=optax.multi_transform({"policy": optax.adam(1e-4), "critic": optax.adam(1e-3)},
                                                              {"policy": "policy", "critic": "critic"}))
    config = jaxppo.Config.from_settings(batch_size=4, mini_batch_size=2, ppo_epochs=1)
    q = jnp.asarray(hf_models.left_padded_batch(np.random.default_rng(8), 4, 5)[0])
    qm = (q != 0).astype(jnp.int32).at[:, -1].set(1)
    gen = generate(lm, lm_params, q, qm, jax.random.key(1), response_length=4)
    rollout = jaxppo.RolloutBatch(query_tokens=q, query_mask=qm, response_tokens=gen.tokens, response_mask=gen.mask,
                                  logprobs=gen.logprobs, values=jnp.zeros((4, 4)), rewards=jnp.ones((4, 4)))
    state, metrics = jaxppo.train_step(state, rollout, jax.random.key(2), config)
    assert int(state.step) == config.batch.updates_per_step
    # The sampler's log-probs are the ones the loss computes: the first update sees ratio 1.
    np.testing.assert_allclose(float(metrics["per_minibatch/val/ratio"][0, 0]), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3-reward", "gemma3-reward"])
def test_critic_from_new_architectures_matches_transformers_per_token(hf_checkpoints, name):
    """A critic ("value" kind) on a Qwen3 / Gemma 3 trunk: its value at every real token
    equals the sequence-classification model's score head there (transformers' per-token
    logits, before it picks the last token)."""
    path, torch_model = hf_checkpoints[name]
    critic, params = jm.from_pretrained(path, kind="value", scan_layers=True)
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(9), 3, 9)
    values = np.asarray(critic.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        hidden = torch_model.model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                   position_ids=torch.tensor(positions)).last_hidden_state
        ref = torch_model.score(hidden)[..., 0].numpy()
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 0.1
    np.testing.assert_allclose(values[real], ref[real], atol=1e-4, rtol=0)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_import_errors(hf_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoints["gpt2"]
    with pytest.raises(ValueError, match="no config.json"):
        jm.from_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        jm.from_pretrained(str(tmp_path / "nope"))

    bert = _copy(path, str(tmp_path / "bert"))
    cfg = json.load(open(os.path.join(bert, "config.json")))
    cfg["model_type"] = "bert"
    json.dump(cfg, open(os.path.join(bert, "config.json"), "w"))
    with pytest.raises(ValueError, match="'bert' is not supported; supported model types: gpt2, llama, mistral, qwen2, "
                                         "qwen3, gemma3_text"):
        jm.from_pretrained(bert)
    cfg["model_type"] = "gemma3"  # the multimodal Gemma 3 without its vision config
    json.dump(cfg, open(os.path.join(bert, "config.json"), "w"))
    with pytest.raises(ValueError, match="config.json lacks or misstates a field a gemma3 config needs: "
                                         "KeyError.'vision_config'"):
        jm.from_pretrained(bert)

    broken = _copy(path, str(tmp_path / "broken"))
    weights = load_file(os.path.join(broken, "model.safetensors"))
    del weights["transformer.h.1.mlp.c_fc.weight"]
    weights["transformer.h.1.extra.weight"] = np.zeros(3, np.float32)
    weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:10]
    save_file(weights, os.path.join(broken, "model.safetensors"))
    with pytest.raises(ValueError) as err:
        jm.from_pretrained(broken)
    message = str(err.value)
    assert "missing weights: ['transformer.h.1.mlp.c_fc.weight']" in message
    assert "unexpected weights: ['transformer.h.1.extra.weight']" in message
    assert "transformer.wpe.weight: checkpoint (10, 32) vs model (64, 32)" in message

    no_weights = str(tmp_path / "no_weights")
    os.makedirs(no_weights)
    shutil.copy(os.path.join(path, "config.json"), no_weights)
    with pytest.raises(ValueError, match="no model.safetensors"):
        jm.from_pretrained(no_weights)

    with pytest.raises(ValueError, match="missing weights: \\['score.weight'\\]"):
        jm.from_pretrained(path, kind="reward")
    with pytest.raises(ValueError, match="valid kinds"):
        jm.from_pretrained(path, kind="policy")


def test_tokenizer_left_pads_and_refuses_overlong_prompts(tmp_path):
    import transformers

    tok_dir = str(tmp_path / "tok")
    transformers.ByT5Tokenizer().save_pretrained(tok_dir)
    tok = jm.load_tokenizer(tok_dir)
    ids, mask = jm.encode_prompts(tok, ["hi", "hello"], 8)
    assert ids.shape == mask.shape == (2, 8)
    # ByT5: byte + 3, then </s> (id 1); pad id 0 on the left.
    assert ids[0].tolist() == [0, 0, 0, 0, 0, ord("h") + 3, ord("i") + 3, 1]
    assert mask[0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert mask[1].sum() == 6
    with pytest.raises(ValueError, match="prompt 1 has 12 tokens, more than max_length=8"):
        jm.encode_prompts(tok, ["ok", "hello world"], 8)
    ids, mask = jm.encode_prompts(tok, ["hello world"], 8, truncate=True)
    assert mask.all() and ids[0, -1] == 1 and tok.decode(ids[0][:-1].tolist()) == "o world"
    with pytest.raises(ValueError, match="empty"):
        jm.encode_prompts(tok, [], 8)
    assert jm.decode_responses(tok, ids, np.array([[1, 1, 1, 0, 0, 0, 0, 0]])) == ["o w"]


@pytest.mark.parametrize("arch", ["llama-attention-bias", "qwen2-sliding"])
def test_more_llama_family_options_match_transformers(tmp_path, arch):
    """Llama with attention_bias (o_proj has a bias too) and Qwen2 with use_sliding_window
    (layers past max_window_layers attend through the window)."""
    import transformers

    common = dict(vocab_size=hf_models.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    if arch == "llama-attention-bias":
        torch_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(attention_bias=True, **common))
    else:
        torch_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=3, max_window_layers=1, **common))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in torch_model.parameters():
            p.normal_(0.0, 0.2)
    torch_model.eval().save_pretrained(str(tmp_path))
    model, params = jm.from_pretrained(str(tmp_path))
    assert model.config.sliding_layers == ((False, True) if arch == "qwen2-sliding" else (False, False))
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(0), 3, 10)
    ours = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _torch_outputs(torch_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4, rtol=0)
