"""Each group's prompt once (`PPOConfig.share_prompts`, `Model.grouped_outputs`): the same
log-probs, values, entropies and gradients as running every row, for every architecture,
both layer layouts, the chunked head, the critic, LoRA, gradient accumulation, left padding
and multi-turn rows; the group-wise mini-batch order; the forward pass; bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.update.kl import fixed_kl_controller
from jaxppo.update.stats import RunningMoments
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.update.batch import response_outputs
from jaxppo.update.minibatches import GroupOrder, minibatch_indices
from jaxppo.update.ppo import minibatch_group, prompt_group
from trainer_setup import perturbed

V, G, Q, R = 64, 4, 7, 6


def _config(model_type, **changes):
    base = dict(model_type=model_type, vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                num_kv_heads=4 if model_type == "gpt2" else 2, intermediate_size=64, max_position_embeddings=32)
    if model_type == "qwen2":
        base.update(model_type="llama", qkv_bias=True)
    if model_type == "gemma3":  # local and global layers, a window shorter than the prompt
        base.update(model_type="gemma3_text", sliding_window=5, layer_types=("sliding_attention", "full_attention"),
                    head_dim=8, query_pre_attn_scalar=8, local_rope_theta=100.0, qk_norm=True,
                    activation="gelu_pytorch_tanh", final_logit_softcapping=30.0)
    base.update(changes)
    return jm.ModelConfig(**base)


def _rows(seed, prompts, gaps=False):
    """`prompts` prompts (left padding of 0-3 tokens), each with G responses of 1..R tokens:
    rows grouped consecutively. With `gaps`, multi-turn rows (environment tokens inside
    the response region, left out of the policy's mask)."""
    rng = np.random.default_rng(seed)
    b = prompts * G
    pads = np.repeat(rng.integers(0, 4, size=(prompts, 1)), G, 0)
    lengths = rng.integers(1, R + 1, size=(b, 1))
    lengths[0] = R
    attention = (np.arange(R)[None] < lengths).astype(np.int32)
    batch = {"query_tokens": jnp.asarray(np.repeat(rng.integers(3, V, (prompts, Q)), G, 0), jnp.int32),
             "query_mask": jnp.asarray(np.arange(Q)[None] >= pads, jnp.int32),
             "response_tokens": jnp.asarray(rng.integers(3, V, (b, R)) * attention, jnp.int32),
             "response_mask": jnp.asarray(attention)}
    if gaps:
        batch["response_mask"] = jnp.asarray(attention * (np.arange(R)[None] % 3 != 1))
        batch["response_attention_mask"] = jnp.asarray(attention)
    return batch


LAYOUTS = [("gpt2", False, None), ("qwen2", True, None), ("llama", False, 4), ("gemma3", False, None),
           ("gemma3", True, None)]


@pytest.mark.parametrize("arch,scan,chunk", LAYOUTS, ids=[f"{a}-{'scan' if s else 'loop'}{'-chunk' if c else ''}"
                                                           for a, s, c in LAYOUTS])
def test_grouped_outputs_and_gradients_equal_every_row(arch, scan, chunk):
    """One forward per group's prompt gives each row's log-probs, values and entropies, and
    (summed over the G rows) the same gradients as running every row."""
    model = jm.Model(_config(arch), kind="causal_lm_value", scan_layers=scan, logits_chunk_size=chunk)
    params = perturbed(model.init(jax.random.key(0)), 1)
    batch = _rows(2, prompts=2, gaps=arch == "qwen2")
    mask = batch["response_mask"]
    weights = jnp.asarray(np.random.default_rng(3).normal(size=(3,) + mask.shape), jnp.float32)

    def objective(p, group):
        logp, values, entropy = response_outputs(model.apply, p, batch, 0.7, group)
        return jnp.sum((weights[0] * logp + weights[1] * values + weights[2] * entropy) * mask), (logp, values, entropy)

    (_, rows), grads_rows = jax.value_and_grad(objective, has_aux=True)(params, 1)
    (_, grouped), grads_grouped = jax.value_and_grad(objective, has_aux=True)(params, G)
    for name, a, b in zip(("logprobs", "values", "entropy"), grouped, rows):
        np.testing.assert_allclose(np.asarray(a * mask), np.asarray(b * mask), rtol=1e-5, atol=2e-5, err_msg=name)
    chex.assert_trees_all_close(grads_grouped, grads_rows, rtol=1e-4, atol=2e-5)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(grads_rows)) > 1e-2  # gradients that show


def test_grouped_outputs_run_the_prompt_once():
    """The grouped program attends over B / G prompt rows: its compiled FLOPs at G = 4 are
    well below the per-row program's (prompt 3x the response here)."""
    model = jm.Model(_config("llama", hidden_size=64, intermediate_size=128), kind="causal_lm_value")
    params = jax.eval_shape(model.init, jax.random.key(0))
    b, q, r = 16, 48, 16
    qt, rt = jax.ShapeDtypeStruct((b, q), jnp.int32), jax.ShapeDtypeStruct((b, r), jnp.int32)
    rows = jax.jit(lambda p, qt, qm, rt, rm: model.response_outputs(p, qt, qm, rt, rm, 1.0))
    grouped = jax.jit(lambda p, qt, qm, rt, rm: model.grouped_outputs(p, qt[::G], qm[::G], rt, rm, 1.0))
    flops = [fn.lower(params, qt, qt, rt, rt).compile().cost_analysis()["flops"] for fn in (rows, grouped)]
    # Tokens: per row 16 * (48 + 16) = 1024; grouped 4 * 48 + 16 * 16 = 448 (0.44x);
    # attention over the shared prompt and the LM head are the same in both.
    assert flops[1] < 0.6 * flops[0], flops


# ---------------------------------------------------------------- train_step


def _rollout(apply_fn, params, batch, seed, uses_critic):
    rng = np.random.default_rng(seed)
    b = batch["response_tokens"].shape[0]
    logprobs, values, _ = jax.jit(lambda p: response_outputs(apply_fn, p, batch, 1.0))(params)
    mask = np.asarray(batch["response_mask"])
    last = R - 1 - np.argmax(mask[:, ::-1], axis=1)
    rewards = np.zeros((b, R), np.float32)
    rewards[np.arange(b), last] = rng.integers(0, 3, size=b)
    return jaxppo.RolloutBatch(query_tokens=batch["query_tokens"], query_mask=batch["query_mask"],
                               response_tokens=batch["response_tokens"], response_mask=batch["response_mask"],
                               response_attention_mask=batch.get("response_attention_mask"),
                               logprobs=logprobs, values=values if uses_critic else None, rewards=jnp.asarray(rewards),
                               ref_logprobs=logprobs + 0.1 * jnp.asarray(rng.normal(size=(b, R)), jnp.float32))


def _both(apply_fn, params, config, rollout, freeze=None):
    """train_step with each group's prompt once and with every row: (states, metrics)."""
    out = []
    for share in (True, False):
        state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5), freeze=freeze)
        out.append(jaxppo.train_step(state, rollout, jax.random.key(5), config.replace(share_prompts=share)))
    return out


def _assert_same(out, params):
    (shared, m_shared), (rows, m_rows) = out
    moved = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(rows.params), jax.tree.leaves(params)))
    assert moved > 1e-2  # updates large against the tolerance
    chex.assert_trees_all_close(shared.params, rows.params, rtol=2e-4, atol=2e-5)
    assert int(shared.step) == int(rows.step) == int(m_rows["ppo/updates_planned"])
    for key in ("per_minibatch/loss/total", "per_minibatch/policy/approxkl", "per_minibatch/policy/entropy"):
        np.testing.assert_allclose(m_shared[key], m_rows[key], rtol=2e-4, atol=1e-5, err_msg=key)


CASES = {
    # GRPO with the KL term, left padding, accumulation: micro-batches of one group each.
    "grpo-accumulate": dict(algorithm="grpo", arch="llama", changes=dict(gradient_accumulation_steps=2,
                                                                          kl_loss_coef=0.1)),
    # PPO's critic (a separate value model) with G samples per prompt, scanned layers.
    "ppo-critic-scan": dict(algorithm="ppo", arch="llama", scan=True, critic=True, changes={}),
    # Multi-turn rows: environment tokens inside the response region; Gemma 3's windows.
    "gspo-multiturn": dict(algorithm="gspo", arch="gemma3", gaps=True, changes={}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_with_shared_prompts_equals_every_row(case):
    spec = CASES[case]
    cfg = _config(spec["arch"])
    policy = jm.Model(cfg, scan_layers=spec.get("scan", False))
    params = perturbed(policy.init(jax.random.key(0)), 1)
    apply_fn = policy.apply
    if spec.get("critic"):
        critic = jm.Model(cfg, kind="value", scan_layers=spec.get("scan", False))
        params = {"policy": params, "critic": perturbed(critic.init(jax.random.key(2)), 3)}
        apply_fn = jm.PolicyAndCritic(policy, critic)
    config = jaxppo.Config.for_algorithm(spec["algorithm"], batch_size=16, mini_batch_size=8, ppo_epochs=2,
                                            num_generations=G, share_prompts=True, **spec["changes"])
    assert prompt_group(config) == G
    rollout = _rollout(apply_fn, params, _rows(4, prompts=4, gaps=spec.get("gaps", False)), 6, config.uses_critic)
    jaxppo.update.check_rollout(rollout, config)
    _assert_same(_both(apply_fn, params, config, rollout), params)


def test_train_step_with_shared_prompts_under_lora():
    """LoRA adapters trained, the base frozen: the same adapters either way."""
    model = jm.Model(_config("qwen2"))
    params = perturbed(model.init(jax.random.key(0)), 1)
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj")),
                                        jax.random.key(1))
    variables["lora"] = perturbed(variables["lora"], 2)  # B nonzero: the adapters act
    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=1,
                                            num_generations=G)
    rollout = _rollout(lora_model.apply, variables, _rows(7, prompts=4), 8, False)
    freeze = jaxppo.update.Freeze(prefixes=(("params",),))
    out = _both(lora_model.apply, variables, config, rollout, freeze)
    chex.assert_trees_all_equal(out[0][0].params["params"], variables["params"])  # the base stays
    _assert_same(out, variables)


def test_group_order_keeps_groups_whole_and_walks_every_row():
    config = jaxppo.Config.for_algorithm("grpo", batch_size=32, mini_batch_size=8, ppo_epochs=3, num_generations=4,
                                            share_prompts=True)
    idx = np.asarray(GroupOrder(4)(jax.random.key(0), config))
    assert idx.shape == (3, 4, 8)
    for epoch in idx:
        assert sorted(epoch.ravel()) == list(range(32))
        rows = epoch.reshape(-1, 4)  # consecutive runs of 4 in each mini-batch
        assert np.all(rows % 4 == np.arange(4)) and np.all(rows // 4 == rows[:, :1] // 4)
    assert len({tuple(e.ravel()) for e in idx}) == 3
    assert GroupOrder(4) == GroupOrder(4) and hash(GroupOrder(4)) == hash(GroupOrder(4))  # one compile
    # G dividing the mini-batch but not the micro-batch: groups kept whole (accumulation
    # changes no mini-batch), every row run; G not dividing the mini-batch: rows one by one.
    accumulating = config.replace(num_generations=8, mini_batch_size=8, gradient_accumulation_steps=2)
    assert minibatch_group(accumulating) == 8 and prompt_group(accumulating) == 1
    odd = config.replace(num_generations=16, mini_batch_size=8)
    assert minibatch_group(odd) == 1 == prompt_group(odd)
    assert prompt_group(config) == 4 and prompt_group(config.replace(share_prompts=None)) == 1  # train_step's default
    assert prompt_group(config.replace(pack_sequences=True)) == 1 and prompt_group(config.replace(share_prompts=False)) == 1
    with pytest.raises(ValueError, match="group=3 must be a positive int dividing BatchConfig.mini_batch_size=8"):
        minibatch_indices(jax.random.key(0), config, 3)


def test_check_rollout_refuses_groups_without_one_prompt():
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                            kl_loss_coef=0.0, share_prompts=True)
    batch = _rows(0, prompts=2)
    b = 8
    rollout = jaxppo.RolloutBatch(**batch, logprobs=jnp.zeros((b, R)), values=None, rewards=jnp.zeros((b, R)))
    jaxppo.update.check_rollout(rollout, config)
    changed = rollout.replace(query_tokens=rollout.query_tokens.at[6, Q - 1].add(1))
    with pytest.raises(ValueError, match=r"row 6 has another prompt than row 4, the first of its group \(rows 4-7\).*"
                                         r"share_prompts=False"):
        jaxppo.update.check_rollout(changed, config)
    jaxppo.update.check_rollout(changed, config.replace(share_prompts=False))
    # Tokens under the padding do not count.
    padded = rollout.replace(query_mask=rollout.query_mask.at[:, 0].set(0))
    jaxppo.update.check_rollout(padded.replace(query_tokens=padded.query_tokens.at[5, 0].add(1)), config)


def test_scoring_pass_with_shared_prompts_equals_every_row():
    """The trainer's forward pass (policy, critic and reference): the same rollout either way."""
    cfg = _config("llama", eos_token_ids=(2,))
    policy, critic = jm.Model(cfg), jm.Model(cfg, kind="value")
    params = {"policy": perturbed(policy.init(jax.random.key(0)), 1),
              "critic": perturbed(critic.init(jax.random.key(1)), 2)}
    ref_params = perturbed(params["policy"], 3)
    ids = jnp.asarray(np.repeat(np.random.default_rng(1).integers(3, V, size=(2, Q)), G, 0), jnp.int32)
    mask = jnp.asarray(np.arange(Q)[None] >= np.repeat([[0], [2]], G, 0), jnp.int32)
    rollouts = []
    for share in (True, False):
        spec = RolloutSpec(policy=policy, apply_fn=jm.PolicyAndCritic(policy, critic), ref_apply=policy.apply,
                           response_length=R, policy_params_key="policy", stop_token_ids=(2,), kl_estimator="k3",
                           num_generations=G, share_prompts=share, keep_ref_logprobs=True,
                           token_reward_fn=lambda pi, pm_, ri, rm: jnp.sum((ri == 7) * rm, axis=1).astype(jnp.float32))
        gen = sample_responses(spec, params, ids, mask, jax.random.key(2))
        rollouts.append(finish_rollout(spec, params, ref_params, None, (ids, mask), gen, None,
                                       Shaping(fixed_kl_controller(0.2), RunningMoments.zeros()))[0])
    shared, rows = rollouts
    np.testing.assert_array_equal(np.asarray(shared.response_tokens), np.asarray(rows.response_tokens))
    m = np.asarray(rows.response_mask)
    for name in ("logprobs", "values", "ref_logprobs", "rewards"):
        np.testing.assert_allclose(np.asarray(getattr(shared, name)) * m, np.asarray(getattr(rows, name)) * m,
                                   rtol=1e-5, atol=1e-5, err_msg=name)
