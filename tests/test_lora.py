"""LoRA: adapters on the built-in models, the reference with adapters off, training only
the adapters, PEFT-format export/import (checked with `peft` on the transformers model),
merged export, checkpoints, meshes and every algorithm."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import hf_models
import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.algorithms import ALGORITHMS
from test_grpo_trainer import assert_on_policy, grpo_trainer


def _perturbed(variables, scale=0.1, seed=3):
    """Adapters moved away from their start (B = 0), so that they change the outputs."""
    leaves, treedef = jax.tree.flatten(variables["lora"])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return {**variables, "lora": jax.tree.unflatten(treedef, moved)}


def _torch_logits(torch_model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           position_ids=torch.tensor(positions)).logits.numpy()


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name,targets", [("qwen3", "all-linear"), ("gpt2", ("c_attn", "c_proj")),
                                          ("gemma3", ("down_proj", "q_proj", "v_proj")),
                                          ("qwen3_moe", "all-linear"), ("mixtral", ("q_proj", "w1", "w3", "w2"))])
def test_adapters_start_at_the_base_model_and_match_peft(hf_checkpoints, tmp_path, name, targets, scan):
    import peft

    path, torch_model = hf_checkpoints[name]
    model, params = jm.from_pretrained(path, scan_layers=scan)
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(rank=4, alpha=8, targets=targets),
                                        jax.random.key(1))
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(0), 3, 10)
    base = np.asarray(model.apply(params, ids, mask))
    # B starts at zero: exactly the base model.
    np.testing.assert_array_equal(np.asarray(lora_model.apply(variables, ids, mask)), base)
    assert not any(np.any(np.asarray(b)) for p, b in jax.tree_util.tree_leaves_with_path(variables["lora"])
                   if "lora_b" in jax.tree_util.keystr(p))

    trained = _perturbed(variables)
    adapted = np.asarray(lora_model.apply(trained, ids, mask))
    real = mask.astype(bool)
    assert np.abs(adapted[real] - base[real]).max() > 0.5  # the adapters matter
    # Adapters off: the base model exactly, on the same variables.
    off = dataclasses.replace(lora_model, adapters=False)
    np.testing.assert_array_equal(np.asarray(off.apply(trained, ids, mask)), base)

    # PEFT's format: peft loads it onto the transformers base model with equal logits.
    adapter_dir = str(tmp_path / "adapter")
    jm.save_peft_adapter(lora_model, trained, adapter_dir, base_model_name_or_path=path)
    peft_model = peft.PeftModel.from_pretrained(torch_model, adapter_dir).eval()
    try:
        ref = _torch_logits(peft_model, ids, mask)
    finally:
        peft_model.unload()  # the shared fixture's model loses its LoRA layers again
    np.testing.assert_allclose(adapted[real], ref[real], atol=1e-4, rtol=0)
    # ... and jaxppo reads it back exactly.
    again_model, again = jm.load_peft_adapter(model, params, adapter_dir)
    assert again_model.lora.modules(model.config) == lora_model.lora.modules(model.config)
    for a, b in zip(jax.tree.leaves(again["lora"]), jax.tree.leaves(trained["lora"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Merged export: transformers loads it, logits equal jaxppo's adapted model.
    import transformers

    merged_dir = str(tmp_path / "merged")
    jm.save_pretrained(lora_model, trained, merged_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    np.testing.assert_allclose(_torch_logits(merged, ids, mask)[real], adapted[real], atol=1e-4, rtol=0)


def test_lora_errors(hf_checkpoints, tmp_path):
    path, _ = hf_checkpoints["llama"]
    model, params = jm.from_pretrained(path)
    with pytest.raises(ValueError, match=r"\['c_attn'\] are not linear layers of a llama model; valid: q_proj"):
        jm.add_lora(model, params, jm.LoraConfig(targets=("c_attn", "q_proj")), jax.random.key(0))
    with pytest.raises(ValueError, match="vision=True puts adapters on a vision encoder, which a llama model does not"):
        jm.add_lora(model, params, jm.LoraConfig(vision=True), jax.random.key(0))
    for bad, match in [(dict(rank=0), "rank=0"), (dict(alpha=-1), "alpha=-1"), (dict(targets=()), "targets"),
                       (dict(targets=("all-linear", "q_proj")), "stands alone"), (dict(vision=1), "vision=1")]:
        with pytest.raises(ValueError, match=match):
            jm.LoraConfig(**bad)
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(), jax.random.key(0))
    adapter = str(tmp_path / "adapter")
    jm.save_peft_adapter(lora_model, variables, adapter)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        jm.add_lora(lora_model, variables, jm.LoraConfig(), jax.random.key(0))
    config_file = os.path.join(adapter, "adapter_config.json")
    config = json.load(open(config_file))
    json.dump(dict(config, use_dora=True), open(config_file, "w"))
    with pytest.raises(ValueError, match="'use_dora': True.*not supported"):
        jm.load_peft_adapter(model, params, adapter)
    json.dump(dict(config, r=2), open(config_file, "w"))  # the tensors are rank 8
    with pytest.raises(ValueError, match="shape mismatches"):
        jm.load_peft_adapter(model, params, adapter)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        jm.load_peft_adapter(model, params, str(tmp_path))


@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n != "distill"])  # its teacher: tests/test_distill.py
def test_every_algorithm_trains_only_the_adapters(tmp_path, name):
    """One iteration of each algorithm with LoRA: the first update is on-policy, the frozen
    base is bit-identical afterwards, the optimizer state covers the adapters (and the
    critic) only, and the reference (adapters off) scores exactly as the initial policy."""
    ppo = jaxppo.Config.for_algorithm(name, batch_size=8, mini_batch_size=8, ppo_epochs=1,
                                         num_generations=1 if name in ("ppo", "reinforce_pp") else 4,
                                         # 6-token completions rarely stop: DAPO's masking of truncated ones
                                         # would leave no token to measure the ratio on (tests/test_shaping.py
                                         # runs the preset with it)
                                         mask_truncated_completions=False)
    if ppo.kl.kl_coef == 0 and ppo.kl.kl_loss_coef == 0:
        ppo = ppo.replace(kl_loss_coef=0.01)  # so that every run has a reference
    lora = jm.LoraConfig(rank=2, alpha=4, targets="all-linear")
    trainer = grpo_trainer(tmp_path, ppo=ppo, lora=lora)
    policy0 = demo.demo_policy(demo.demo_tokenizer(), width=32, layers=1, max_len=38)
    state0 = jax.tree.map(np.asarray, trainer.state.params)
    assert trainer.parts.ref_params is None and trainer.parts.spec.ref_is_policy
    row = trainer.step()
    assert_on_policy(row)
    assert row["ppo/updates_applied"] == 1

    params = trainer.policy_params()
    base0 = state0["policy"]["params"] if "policy" in state0 else state0["params"]
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(params["params"])):
        np.testing.assert_array_equal(a, np.asarray(b))
    lora0 = state0["policy"]["lora"] if "policy" in state0 else state0["lora"]
    assert any(not np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(lora0),
                                                                     jax.tree.leaves(params["lora"])))
    # Adam's moments exist for the adapters (and the critic under PPO), nothing else.
    moment_sizes = sum(x.size for x in jax.tree.leaves(trainer.state.opt_state) if getattr(x, "ndim", 0) > 0)
    trained_size = sum(x.size for x in jax.tree.leaves(trainer.state.trained_params()))
    assert moment_sizes == 2 * trained_size
    assert trained_size - (sum(x.size for x in jax.tree.leaves(trainer.state.params.get("critic", {})))) == \
        sum(x.size for x in jax.tree.leaves(params["lora"]))

    # Reference log-probs (adapters off, trained adapters in place) equal the initial policy's.
    q, qm = trainer.parts.table.ids[:4], trainer.parts.table.mask[:4]
    r = jnp.asarray(np.random.default_rng(0).integers(2, 50, (4, 6)))
    rm = jnp.ones_like(r)
    ref = trainer.parts.spec.ref_apply.response_outputs(params, q, qm, r, rm, 1.0)[0]
    initial = policy0[0].response_outputs(policy0[1], q, qm, r, rm, 1.0)[0]
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(initial))


def test_engine_trains_only_what_freeze_leaves_and_accumulates_equally():
    """`jaxppo.update.Freeze` at the engine level: gradients and optimizer state for the trained
    leaves only, frozen leaves untouched; gradient accumulation 1 and 2 give the same
    adapters; scanned and unrolled layers the same adapters."""
    cfg = jm.ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_position_embeddings=32, eos_token_ids=(2,))
    base = jm.Model(cfg)
    lora_model, variables = jm.add_lora(base, base.init(jax.random.key(0)), jm.LoraConfig(4, 8, "all-linear"),
                                        jax.random.key(1))
    rng = np.random.default_rng(0)
    b = 8
    rollout = jaxppo.RolloutBatch(query_tokens=jnp.asarray(rng.integers(3, 64, (b, 4))), query_mask=jnp.ones((b, 4), jnp.int32),
                                  response_tokens=jnp.asarray(rng.integers(3, 64, (b, 5))),
                                  response_mask=jnp.asarray(np.arange(5)[None] < rng.integers(1, 6, (b, 1)), jnp.int32),
                                  logprobs=jnp.asarray(rng.normal(-3, 0.3, (b, 5)), jnp.float32),
                                  values=jnp.zeros((b, 5)), rewards=jnp.asarray(rng.normal(0, 1, (b, 5)), jnp.float32))
    freeze = jaxppo.update.Freeze(prefixes=(("params",),))

    def run(model, variables, accumulation):
        config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=4, ppo_epochs=2, kl_loss_coef=0.0,
                                                num_generations=4, gradient_accumulation_steps=accumulation)
        state = jaxppo.TrainState.create(apply_fn=model.apply, params=variables, tx=optax.adam(1e-2), freeze=freeze)
        assert jax.tree.structure(state.opt_state[0].mu) == jax.tree.structure(freeze.trained(variables))
        state, _ = jaxppo.train_step(state, rollout, jax.random.key(2), config)
        assert int(state.step) == config.batch.updates_per_step
        return state.params

    one = run(lora_model, variables, 1)
    for a, b_ in zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(one["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))
    moved = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(variables["lora"]),
                                                            jax.tree.leaves(one["lora"])))
    assert moved > 1e-3
    two = run(lora_model, variables, 2)
    # Accumulating 2 micro-batches sums the gradient in another order than 1; Adam (lr 1e-2)
    # divides by sqrt(v), so where a gradient is near zero that rounding difference grows to
    # ~1e-5 after 4 updates. A wrong micro-batch weighting moves adapters by ~1e-3.
    for a, b_ in zip(jax.tree.leaves(one["lora"]), jax.tree.leaves(two["lora"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=2e-5)
    scanned = run(dataclasses.replace(lora_model, scan_layers=True), jm.stack_layers(variables, cfg), 1)
    back = jm.unstack_layers(scanned, cfg)
    for a, b_ in zip(jax.tree.leaves(one["lora"]), jax.tree.leaves(back["lora"])):
        # The scanned forward rounds differently; through Adam as above (seen: 8e-6 at one element).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=2e-5)
    rematted = run(dataclasses.replace(lora_model, scan_layers=True, remat=True), jm.stack_layers(variables, cfg), 1)
    for a, b_ in zip(jax.tree.leaves(scanned["lora"]), jax.tree.leaves(rematted["lora"])):
        # Rounding of the recomputed forward, through 4 Adam steps of 1e-2 (the moves are ~4e-2).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=2e-5)
    with pytest.raises(ValueError, match="freezes every parameter"):
        jaxppo.TrainState.create(apply_fn=base.apply, params={"params": variables["params"]}, tx=optax.adam(1e-2),
                                 freeze=freeze)


def test_lora_resume_checkpoints_adapters_only(tmp_path):
    """A LoRA PPO run with a value head on the policy trunk, interrupted and resumed, gives
    the uninterrupted metrics; its checkpoints hold no base weights."""
    lora = jm.LoraConfig(rank=2, alpha=2, targets=("c_attn",))
    ppo = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1, kl_coef=0.05)
    kw = dict(ppo=ppo, lora=lora, trainer=dict(checkpoint_every=1, shared_trunk=True))
    straight = grpo_trainer(tmp_path / "a", iterations=3, **kw).train()
    grpo_trainer(tmp_path / "b", iterations=2, **kw).train()
    resumed_trainer = grpo_trainer(tmp_path / "b", iterations=3, **kw)
    saved = resumed_trainer.run.checkpoint_tree()["params"]
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(saved)}
    assert names and all("lora" in n or "value_head" in n for n in names), names
    resumed = resumed_trainer.train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]
    # A resume with other LoRA settings is refused before any work.
    with pytest.raises(jaxppo.RunError, match="lora"):
        grpo_trainer(tmp_path / "b", iterations=3, ppo=ppo, lora=jm.LoraConfig(rank=4, alpha=2, targets=("c_attn",)),
                     trainer=dict(checkpoint_every=1, shared_trunk=True)).train()


def test_lora_settings_from_flags_and_config_files_and_trainer_errors(tmp_path):
    from jaxppo.cli import resolve

    config, _ = resolve(["--lora-rank", "16", "--lora-targets", "q_proj, v_proj"])
    assert config.lora.lora == jm.LoraConfig(rank=16, alpha=32.0, targets=("q_proj", "v_proj"))
    (tmp_path / "run.toml").write_text('lora_rank = 4\nlora_targets = ["c_attn"]\nmesh_data = 2\n')
    config, _ = resolve(["--config", str(tmp_path / "run.toml")])  # a config file holds them as the rest
    assert config.lora.lora == jm.LoraConfig(rank=4, alpha=8.0, targets=("c_attn",))
    assert config.layout.device_mesh == jaxppo.sharding.MeshConfig(data=2, tensor=1)
    assert jaxppo.Config().lora.lora is None and jaxppo.Config().layout.device_mesh is None
    with pytest.raises(SystemExit, match="lora_alpha need lora_rank"):
        resolve(["--lora-alpha", "8"])
    with pytest.raises(SystemExit, match="lora_rank=0 is invalid"):
        resolve(["--lora-rank", "0"])
    with pytest.raises(SystemExit, match="drop lora_rank"):
        resolve(["--lora-rank", "4", "--lora-init", str(tmp_path)])
    with pytest.raises(SystemExit, match="'all-linear' alone"):
        resolve(["--lora-rank", "4", "--lora-targets", "all-linear,c_fc"])
    with pytest.raises(SystemExit, match="mesh_fsdp=0 is invalid"):
        resolve(["--mesh-fsdp", "0"])
    with pytest.raises(ValueError, match="not both"):
        jaxppo.Config.from_settings(mesh_fsdp=2, mesh=jaxppo.sharding.MeshConfig(fsdp=2))
    # 0.4's Trainer(lora=, lora_init=) still work, translated into the settings with a warning.
    with pytest.warns(DeprecationWarning, match="Config.lora"):
        old = jaxppo.Trainer(jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4,
                                                         output_dir=str(tmp_path / "old"), query_length=32,
                                                         response_length=6),
                             policy=demo.demo_policy(demo.demo_tokenizer(), width=32, layers=1, max_len=38),
                             tokenizer=demo.demo_tokenizer(), prompts=demo.DEMO_PROMPTS,
                             reward_fns=demo.lowercase_reward, lora=jm.LoraConfig(rank=2, targets=("c_attn",)))
    assert old.config.lora.lora == jm.LoraConfig(rank=2, alpha=16.0, targets=("c_attn",))

    # The trainer: an adapter directory; a policy that already has adapters given with
    # lora settings; a target the policy does not have.
    model, params = demo.demo_policy(demo.demo_tokenizer(), width=32, layers=1, max_len=38)
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(rank=2, targets=("c_attn",)), jax.random.key(0))
    jm.save_peft_adapter(lora_model, variables, str(tmp_path / "adapter"))
    started = grpo_trainer(tmp_path / "b", lora_init=str(tmp_path / "adapter"))
    assert started.policy_model.lora == lora_model.lora
    with pytest.raises(ValueError, match=r"\['q_proj'\] are not linear layers of a gpt2 model"):
        grpo_trainer(tmp_path / "c", lora=jm.LoraConfig(targets=("q_proj",)))
