"""Mixtures of experts (`jaxppo.models.moe`): the grouped products and the experts against
plain loops, the router's load-balancing loss against transformers', a CPU program that
does not multiply every expert, routing replay and the mismatch metric in `train_step`, a
GRPO run that learns, and bad input refused. (Logits, generation, export and PEFT against
transformers: tests/test_models.py and tests/test_lora.py; sharded: tests/test_sharding.py.)"""

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
from jaxppo.models.moe import blocked_matmul, experts_forward, load_balancing_loss, route

V = 64


def _config(**kw):
    settings = dict(model_type="qwen3_moe", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=False,
                    qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, eos_token_ids=(2,))
    return jm.ModelConfig(**{**settings, **kw})


def _left_padded_prompts(rows: int, every: int, seed: int):
    """Prompts of 5 tokens (numpy), every `every`-th row from the second left-padded by 2:
    (ids with 0 at the padding, mask)."""
    ids = np.random.default_rng(seed).integers(3, V, (rows, 5))
    mask = np.ones_like(ids)
    mask[1::every, :2] = 0
    return ids * mask, mask


@pytest.mark.parametrize("sizes,extra", [([3, 0, 9, 1], 0), ([0, 0, 13, 0], 0), ([1], 0),
                                         ([40, 2, 0, 7, 7, 0, 1, 5], 0), ([3, 0, 2], 4)])
def test_blocked_matmul_equals_a_loop_over_the_groups(sizes, extra):
    """Rows past the groups (`extra`: how the expert-parallel path leaves other devices'
    pairs) give 0 and receive no gradient, as `jax.lax.ragged_dot`'s do."""
    rng = np.random.default_rng(len(sizes))
    e, d, f, m = len(sizes), 5, 7, sum(sizes) + extra
    rows, kernels = rng.normal(size=(m, d)).astype(np.float32), rng.normal(size=(e, d, f)).astype(np.float32)
    group = np.repeat(np.arange(e), sizes)
    want = np.stack([rows[i] @ kernels[group[i]] if i < len(group) else np.zeros(f, np.float32) for i in range(m)])
    s = jnp.asarray(sizes, jnp.int32)
    got = jax.jit(blocked_matmul)(rows, kernels, s)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    def loss(product, x, w):
        return jnp.sum(jnp.sin(product(x, w)))

    def loop(x, w):  # the same product as a Python loop over the groups: the reference gradients
        starts = np.concatenate([[0], np.cumsum(sizes)])
        return jnp.concatenate([x[starts[g]:starts[g + 1]] @ w[g] for g in range(e)]
                               + [jnp.zeros((extra, f), x.dtype)], axis=0)

    ref = jax.grad(lambda x, w: loss(loop, x, w), argnums=(0, 1))(rows, kernels)
    ours = jax.jit(jax.grad(lambda x, w: loss(lambda a, b: blocked_matmul(a, b, s), x, w), argnums=(0, 1)))(rows,
                                                                                                            kernels)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dense", [False, True], ids=["grouped", "every-expert"])
@pytest.mark.parametrize("normalise", [False, True])
def test_routing_and_experts_equal_a_loop_over_tokens(normalise, dense):
    rng = np.random.default_rng(0)
    n, d, i, e, k = 11, 6, 5, 4, 2
    x, logits = rng.normal(size=(n, d)).astype(np.float32), rng.normal(size=(n, e)).astype(np.float32)
    wg, wu = rng.normal(size=(e, d, i)).astype(np.float32), rng.normal(size=(e, d, i)).astype(np.float32)
    wd = rng.normal(size=(e, i, d)).astype(np.float32)
    weights, experts, probs = route(jnp.asarray(logits), k, normalise)
    # The router as transformers computes it (softmax in float32, top k, renormalised or not).
    p = torch.softmax(torch.tensor(logits), dim=-1)
    top, idx = torch.topk(p, k, dim=-1)
    if normalise:
        top = top / top.sum(-1, keepdim=True)
    np.testing.assert_array_equal(np.asarray(experts), idx.numpy())
    np.testing.assert_allclose(np.asarray(weights), top.numpy(), rtol=1e-6)
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    want = np.zeros((n, d), np.float32)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j])
            want[t] += float(top[t, j]) * ((silu(x[t] @ wg[ex]) * (x[t] @ wu[ex])) @ wd[ex])
    got = experts_forward(jnp.asarray(x), experts, weights, (wg, wu, wd), "silu", dense=dense)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_every_expert_equals_the_grouped_path_with_adapters_and_gradients():
    """The few-token path (`every_expert`: one product with every expert, then each token's
    k outputs picked) against the grouped one (`grouped_matmul`), with LoRA on two of the
    projections and pairs routed to an expert past E (the expert-parallel path's pairs of
    other devices, weight 0): the outputs and the gradients of x, the kernels and the
    adapters agree to float32 rounding (the two sum the same terms in other orders)."""
    rng = np.random.default_rng(3)
    n, d, i, e, k, r = 12, 16, 8, 6, 2, 3
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1),  # noqa: E731
                                        jnp.float32)
    x, wg, wu, wd = normal(n, d), normal(e, d, i), normal(e, d, i), normal(e, i, d)
    weights, experts, _ = route(normal(n, e), k, True)
    experts = experts.at[::5, 1].set(e)  # not this device's: contributes nothing
    weights = weights.at[::5, 1].set(0.0)
    lora = {"gate_proj": (normal(e, d, r), normal(e, r, i)), "down_proj": (normal(e, i, r), normal(e, r, d))}

    def loss(dense, x, wg, wu, wd, lora):
        adapters = {name: (a, b, 0.5) for name, (a, b) in lora.items()}
        return jnp.sum(jnp.sin(experts_forward(x, experts, weights, (wg, wu, wd), "silu", adapters, dense=dense)))

    grads = {dense: jax.jit(jax.value_and_grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2, 3, 4)))(
        x, wg, wu, wd, lora) for dense in (False, True)}
    assert float(grads[True][0]) == pytest.approx(float(grads[False][0]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads[True][1]), jax.tree.leaves(grads[False][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(jnp.max(jnp.abs(grads[True][1][1]))) > 1e-2  # the kernels do receive a gradient


@pytest.mark.parametrize("fsdp", [1, 8], ids=["one-device", "expert-parallel-1x8"])
def test_decoding_through_every_expert_samples_the_grouped_tokens(fsdp, monkeypatch):
    """The samplers' decode steps (16 rows: under `DENSE_TOKENS`) run every expert at once:
    the same tokens as the grouped path, the log-probs within float32 rounding, on one
    device and expert parallel over a 1x8 mesh (one expert a device)."""
    from jaxppo import sharding as sh
    from jaxppo.models import moe
    from jaxppo.rollout.engines.static import generate

    model = jm.Model(_config(), scan_layers=True)
    params = model.init(jax.random.key(0))
    ids, mask = (jnp.asarray(a) for a in _left_padded_prompts(16, every=3, seed=1))
    mesh = sh.make_mesh(sh.MeshConfig(data=8 // fsdp, fsdp=fsdp))
    placed = (sh.shard_state(params, mesh), sh.shard_batch(ids, mesh), sh.shard_batch(mask, mesh))

    run = lambda: generate(model, *placed, jax.random.key(2), response_length=10, temperature=1.0)  # noqa: E731

    def sample(dense_tokens):
        monkeypatch.setattr(moe, "DENSE_TOKENS", dense_tokens)
        jax.clear_caches()  # the threshold is read when the program is traced
        with jax.set_mesh(mesh):  # as the trainer samples (`jaxppo.run.iteration`)
            return run(), str(jax.make_jaxpr(run)())

    (grouped, _), (dense, program) = sample(0), sample(moe.DENSE_TOKENS)
    jax.clear_caches()
    # Over fsdp 8 the 16 rows' decode steps go through the expert-parallel path.
    assert ("shard_map" in program) == (fsdp > 1)
    np.testing.assert_array_equal(np.asarray(dense.tokens), np.asarray(grouped.tokens))
    np.testing.assert_allclose(np.asarray(dense.logprobs), np.asarray(grouped.logprobs), rtol=0, atol=1e-5)
    assert len(np.unique(np.asarray(dense.tokens))) > 10  # sampled, not one repeated token


def test_the_load_balancing_loss_equals_transformers(hf_checkpoints):
    path, torch_model = hf_checkpoints["qwen3_moe"]
    model, params = jm.from_pretrained(path)
    ids, mask = hf_models.left_padded_batch(np.random.default_rng(7), 4, 9)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True,
                          position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)))
    q = 4  # the first 4 slots as the "query", the rest as the "response": the same joined rows
    _, routing = model.routed_outputs(params, jnp.asarray(ids[:, :q]), jnp.asarray(mask[:, :q]),
                                      jnp.asarray(ids[:, q:]), jnp.asarray(mask[:, q:]), aux_loss=True)
    c = model.config
    # transformers adds router_aux_loss_coef * aux_loss to its loss; its aux_loss is the term itself.
    assert float(ref.aux_loss) > 0.5
    np.testing.assert_allclose(float(routing["aux_loss"]), float(ref.aux_loss), rtol=1e-5)
    assert routing["chosen"].shape == (4, 9, c.num_layers, c.num_experts_per_tok)
    # Its definition, once more by hand: E * sum_e (share of pairs routed to e) * (mean probability of e).
    probs = jax.nn.softmax(jnp.asarray(np.stack([r.numpy() for r in ref.router_logits])), -1)  # (layers, B*L, E)
    real = np.tile(mask.reshape(-1), c.num_layers).astype(bool)
    flat_probs, chosen = np.asarray(probs).reshape(-1, c.num_experts)[real], np.asarray(
        jnp.moveaxis(routing["chosen"], 2, 0)).reshape(-1, c.num_experts_per_tok)[real]
    share = np.stack([(chosen[:, j, None] == np.arange(c.num_experts)).mean(0) for j in range(chosen.shape[1])])
    by_hand = c.num_experts * float(np.sum(share * flat_probs.mean(0)[None]))
    assert float(load_balancing_loss(jnp.asarray(flat_probs), jnp.asarray(chosen))) == pytest.approx(by_hand, rel=1e-5)


def test_the_cpu_program_does_not_multiply_every_expert():
    """Structural: the compiled gradient of the experts on this CPU keeps temporaries that do
    not grow with the number of experts (XLA:CPU's own `ragged_dot` makes an (E, rows, D)
    one: 8 times more at 64 experts than at 8)."""
    def temporaries(e):
        n, d, i, k = 512, 64, 32, 2
        x = jax.ShapeDtypeStruct((n, d), jnp.float32)
        w = jax.ShapeDtypeStruct((e, d, i), jnp.float32)
        wd = jax.ShapeDtypeStruct((e, i, d), jnp.float32)
        experts = (jnp.arange(n * k).reshape(n, k) % e).astype(jnp.int32)
        weights = jnp.full((n, k), 0.5, jnp.float32)
        loss = lambda x, wg, wu, wd: jnp.sum(experts_forward(x, experts, weights, (wg, wu, wd), "silu"))  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, w, w, wd).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temporaries(8), temporaries(64)
    weights_growth = 3 * 64 * 32 * 4 * (64 - 8)  # the kernels' gradients themselves grow with E
    assert large - small < 2 * weights_growth + (1 << 20), (small, large)


def _rollout(model, params, routing, b=16, q=4, r=6, seed=0):
    rng = np.random.default_rng(seed)
    queries, responses = jnp.asarray(rng.integers(3, V, (b, q))), jnp.asarray(rng.integers(3, V, (b, r)))
    ones_q, ones_r = jnp.ones((b, q), jnp.int32), jnp.ones((b, r), jnp.int32)
    (logprobs, _, _), own = model.routed_outputs(params, queries, ones_q, responses, ones_r, replay=routing)
    routing = own["chosen"] if routing is None else routing
    return jaxppo.RolloutBatch(query_tokens=queries, query_mask=ones_q, response_tokens=responses, response_mask=ones_r,
                               logprobs=logprobs, values=None, rewards=jnp.asarray(rng.normal(size=(b, r)), jnp.float32),
                               routing=routing), own["chosen"]


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_routing_replay_keeps_the_first_ratio_at_one(scan):
    """A rollout scored with other experts than the router picks now (as a sampler with other
    numerics would route): replaying them, the first mini-batch's ratio is 1 within rounding;
    without replay it is not, and the mismatch metric is the share of (token, layer) pairs
    whose experts differ, as counted here by hand."""
    model = jm.Model(_config(), scan_layers=scan)
    params = model.init(jax.random.key(0))
    _, own = _rollout(model, params, None)
    other = np.asarray(own).copy()
    other[::3, :, :, 0] = (other[::3, :, :, 0] + 3) % 8  # a third of the rows' first experts moved ...
    other = np.where(other[..., :1] == other[..., 1:], (other + 1) % 8, other)  # ... never onto the second
    rollout, own = _rollout(model, params, jnp.asarray(other))
    # The router's own choice in each forward: under replay the later layers see other inputs.
    differs = {True: np.any(np.sort(np.asarray(own), -1) != np.sort(other, -1), -1)}
    _, plain = _rollout(model, params, None)
    differs[False] = np.any(np.sort(np.asarray(plain), -1) != np.sort(other, -1), -1)
    first = {}
    for replay in (True, False):
        config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=16, ppo_epochs=1,
                                             num_generations=4, kl_loss_coef=0.0, routing_replay=replay)
        state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0))
        _, metrics = jaxppo.train_step(state, rollout, jax.random.key(1), config)
        first[replay] = {k: float(metrics[f"per_minibatch/{k}"][0, 0]) for k in ("val/ratio", "moe/routing_mismatch",
                                                                                   "policy/approxkl")}
    assert first[True]["val/ratio"] == pytest.approx(1.0, abs=1e-6)
    assert first[True]["policy/approxkl"] < 1e-10
    assert abs(first[False]["val/ratio"] - 1.0) > 1e-3
    # The router's own choice against the rollout's, replayed or not (sgd at 0: the params never move).
    for replay in (True, False):
        assert first[replay]["moe/routing_mismatch"] == pytest.approx(differs[replay].mean(), rel=1e-6)
        assert 0.05 < differs[replay].mean() < 0.6


def test_the_load_balancing_term_is_added_to_the_loss():
    model = jm.Model(_config())
    params = model.init(jax.random.key(0))
    rollout, _ = _rollout(model, params, None)
    rows = {}
    for coef in (0.0, 0.5):
        config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=16, ppo_epochs=1,
                                             num_generations=4, kl_loss_coef=0.0, router_aux_loss_coef=coef)
        state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.0))
        rows[coef] = jaxppo.train_step(state, rollout, jax.random.key(1), config)[1]
    aux = model.routed_outputs(params, rollout.query_tokens, rollout.query_mask, rollout.response_tokens,
                               rollout.response_mask, aux_loss=True)[1]["aux_loss"]
    assert float(rows[0.5]["loss/router_aux_avg"]) == pytest.approx(float(aux), rel=1e-5)
    assert float(rows[0.5]["loss/total_avg"]) - float(rows[0.0]["loss/total_avg"]) == pytest.approx(
        0.5 * float(aux), rel=1e-4)
    assert "loss/router_aux_avg" not in rows[0.0]


def test_grpo_on_a_tiny_mixture_of_experts_learns_with_routing_replay(tmp_path):
    """The demo task (lowercase letters) with a Qwen3-MoE-layout policy over the demo's byte
    vocabulary: GRPO with routing replay raises the reward; the update count is pinned."""
    tokenizer = demo.demo_tokenizer()
    config = _config(vocab_size=len(tokenizer), hidden_size=32, max_position_embeddings=64,
                     eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    model = jm.Model(config)
    iterations = 20
    settings = jaxppo.Config.for_algorithm(
        "grpo", batch_size=32, mini_batch_size=16, ppo_epochs=1, num_generations=8, routing_replay=True,
        router_aux_loss_coef=0.001, iterations=iterations, query_length=32, response_length=12, learning_rate=1e-2,
        output_dir=str(tmp_path), progress=False, sample_every=0, checkpoint_every=0, export_final=False,
        plot=False, report_to="jsonl")
    trainer = jaxppo.Trainer(settings, policy=(model, model.init(jax.random.key(1))), tokenizer=tokenizer,
                             prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
    rows = [trainer.step() for _ in range(iterations)]
    assert trainer.state.step == iterations * 2  # ppo_epochs * batch_size / mini_batch_size per iteration
    assert all("moe/routing_mismatch" in r and "loss/router_aux_avg" in r for r in rows)
    rewards = [r["objective/scores"] for r in rows]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 2.0, rewards  # letters of 12 tokens; about 1 at the start


def test_bad_mixture_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and num_experts=8"):
        _config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="needs num_experts > 0"):
        _config(num_experts=0, num_experts_per_tok=0)
    import transformers

    hf = transformers.Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                     num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, mlp_only_layers=[1])
    with pytest.raises(ValueError, match=r"dense layers among the sparse ones .*mlp_only_layers=\[1\]"):
        jm.ModelConfig.from_hf(hf)
    with pytest.raises(ValueError, match=r"\['gate'\] are not linear layers of a qwen3_moe model; valid: q_proj"):
        jm.LoraConfig(targets=("gate",)).modules(_config())  # the router is not adapted
    with pytest.raises(ValueError, match="share_prompts must be False or None with LossConfig.routing_replay=True"):
        jaxppo.Config.for_algorithm("grpo", routing_replay=True, share_prompts=True)
    with pytest.raises(ValueError, match="old_logprobs must be 'recompute' or 'auto' with LossConfig.router_aux"):
        jaxppo.Config.for_algorithm("grpo", router_aux_loss_coef=0.01, old_logprobs="sampler")
    tokenizer = demo.demo_tokenizer()
    settings = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, num_generations=4,
                                           routing_replay=True, iterations=1, output_dir=str(tmp_path),
                                           progress=False, report_to="jsonl")
    with pytest.raises(ValueError, match="routing_replay=True needs a mixture-of-experts policy .* dense gpt2"):
        jaxppo.Trainer(settings, policy=demo.demo_policy(tokenizer, width=32, layers=1), tokenizer=tokenizer,
                       prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
    # train_step with replay on a rollout that carries no routing: refused while tracing.
    model = jm.Model(_config())
    params = model.init(jax.random.key(0))
    rollout, _ = _rollout(model, params, None)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=16, num_generations=4,
                                         kl_loss_coef=0.0, routing_replay=True)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"need a rollout that carries the forward pass's routing"):
        jaxppo.train_step(state, rollout.replace(routing=None), jax.random.key(1), config)


def test_lora_on_the_experts_trains_only_the_adapters_and_merges():
    """Adapters on attention and on every expert's projections: `train_step` moves the
    adapters alone (the experts' ones too); the merged kernels give the adapted model's
    logits. (Their PEFT files against PEFT and transformers: tests/test_lora.py.)"""
    model = jm.Model(_config(), scan_layers=True)
    params = model.init(jax.random.key(0))
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(rank=4, alpha=8, targets="all-linear"),
                                        jax.random.key(1))
    experts = variables["lora"]["model"]["layers"]["moe"]["experts"]
    assert experts["gate_proj_lora_a"].shape == (2, 8, 32, 4) and experts["down_proj_lora_b"].shape == (2, 8, 4, 32)
    rollout, _ = _rollout(model, params, None)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                         kl_loss_coef=0.0)
    state = jaxppo.TrainState.create(apply_fn=lora_model.apply, params=variables, tx=optax.adam(1e-2),
                                     freeze=jaxppo.update.Freeze((("params",),)))
    out, _ = jaxppo.train_step(state, rollout, jax.random.key(1), config)
    assert int(out.step) == 2
    for a, b in zip(jax.tree.leaves(out.params["params"]), jax.tree.leaves(params["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = out.params["lora"]["model"]["layers"]["moe"]["experts"]
    assert float(jnp.abs(moved["up_proj_lora_b"]).max()) > 0  # B starts at zero
    # Expert parallel with the adapters (fsdp = 8: one expert per device) equals one device.
    from jaxppo import sharding as sh

    mesh = sh.make_mesh(sh.MeshConfig(fsdp=8))
    sharded = sh.shard_state(state, mesh)
    on_mesh, _ = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                              jax.random.key(1))
    for a, b in zip(jax.tree.leaves(on_mesh.params), jax.tree.leaves(out.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    merged_model, merged = jm.merge_lora(lora_model, out.params)
    ids, mask = rollout.query_tokens, rollout.query_mask
    np.testing.assert_allclose(np.asarray(merged_model.apply(merged, ids, mask)),
                               np.asarray(lora_model.apply(out.params, ids, mask)), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_the_continuous_sampler_equals_the_static_one_on_a_mixture(scan):
    """The KV-cache samplers run a mixture of experts like any block: the continuous engine
    (3 slots, rows refilled as they stop) gives the static sampler's tokens."""
    from jaxppo.rollout.engines.continuous import generate_continuous
    from jaxppo.rollout.engines.static import generate

    model = jm.Model(_config(), scan_layers=scan)
    params = model.init(jax.random.key(0))
    ids, mask = _left_padded_prompts(10, every=2, seed=0)
    kw = dict(response_length=12, stop_token_ids=(2, 3, 4, 5, 6))
    static = generate(model, params, ids, mask, jax.random.key(1), **kw)
    engine = generate_continuous(model, params, ids, mask, jax.random.key(1), num_slots=3, **kw)
    np.testing.assert_array_equal(np.asarray(engine.tokens), np.asarray(static.tokens))
    np.testing.assert_allclose(np.asarray(engine.logprobs), np.asarray(static.logprobs), rtol=0, atol=4e-6)
    lengths = np.asarray(static.mask).sum(axis=1)
    assert lengths.min() < lengths.max()  # rows ended at different steps: slots were refilled


def test_expert_parallel_compiles_and_agrees_in_bfloat16():
    """bf16 compute with remat on a 1x8 mesh (the layout real runs use): the expert-parallel
    update compiles (its token exchange runs in float32: XLA:CPU fails on a bf16
    reduce-scatter), its loss and forward within bf16 rounding of one device."""
    from jaxppo import sharding as sh

    model = jm.Model(_config(), scan_layers=True, dtype="bfloat16", remat=True)
    params = model.init(jax.random.key(0))
    rollout, _ = _rollout(jm.Model(_config(), scan_layers=True), params, None)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4,
                                         kl_loss_coef=0.0)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    ref, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(1), config)
    mesh = sh.make_mesh(sh.MeshConfig(fsdp=8))
    sharded = sh.shard_state(state, mesh)
    out, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(1))
    assert float(metrics["loss/total_avg"]) == pytest.approx(float(ref_metrics["loss/total_avg"]), abs=2e-2)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out.params))
    # The forward on the mesh: the same routing, log-probs within bf16 rounding. (After an
    # update the parameters are compared in float32 by the tests above: in bf16 a tiny
    # random model's updates differ by more than rounding between any two layouts.)
    batch = (rollout.query_tokens, rollout.query_mask, rollout.response_tokens, rollout.response_mask)
    (lp, _, _), own = model.routed_outputs(params, *batch)
    with jax.set_mesh(mesh):
        (lp_mesh, _, _), own_mesh = jax.jit(model.routed_outputs)(sh.shard_state(params, mesh),
                                                                  *(sh.shard_batch(a, mesh) for a in batch))
    np.testing.assert_array_equal(np.sort(np.asarray(own_mesh["chosen"]), -1), np.sort(np.asarray(own["chosen"]), -1))
    np.testing.assert_allclose(np.asarray(lp_mesh), np.asarray(lp), atol=5e-2)
