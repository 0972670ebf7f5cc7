"""The same train_step on 8 host devices (conftest sets
--xla_force_host_platform_device_count=8): equal results to 1 device, real sharding,
per-device memory falling with fsdp, sampling under the mesh, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate
from jaxppo import sharding as sh
from jaxppo import demo
from jaxppo.version import release
from trainer_setup import require_devices, run_small

require_devices(8)

Q, R, V = 4, 6, 64
MESHES = [sh.MeshConfig(data=8, fsdp=1), sh.MeshConfig(data=2, fsdp=4), sh.MeshConfig(data=1, fsdp=8),
          sh.MeshConfig(data=2, fsdp=2, tensor=2)]


def _ids(m):
    return f"data{m.data}-fsdp{m.fsdp}-tensor{m.tensor}"


@pytest.fixture(scope="module")
def setup():
    cfg = jm.ModelConfig(model_type="llama", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=False, eos_token_ids=(2,))
    # The log-prob head in chunks of 4 response positions (not dividing R = 6): every mesh
    # below runs the chunked head (the scanned test runs the unchunked one).
    policy, critic = jm.Model(cfg, logits_chunk_size=4), jm.Model(cfg, kind="value")
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    rng = np.random.default_rng(0)
    b = 16
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(3, V, (b, Q))), query_mask=jnp.ones((b, Q), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(3, V, (b, R))),
        response_mask=jnp.asarray(np.arange(R)[None] < rng.integers(1, R + 1, (b, 1)), jnp.int32),
        logprobs=jnp.full((b, R), -np.log(V), jnp.float32), values=jnp.zeros((b, R)),
        rewards=jnp.asarray(rng.normal(size=(b, R)), jnp.float32))
    return policy, critic, params, rollout


@pytest.mark.parametrize("mesh_config", MESHES, ids=_ids)
def test_sharded_train_step_equals_single_device(setup, mesh_config):
    policy, critic, params, rollout = setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, gradient_accumulation_steps=1)
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.sgd(0.1))
    ref_state, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config)

    mesh = sh.make_mesh(mesh_config)
    sharded = sh.shard_state(state, mesh)
    step = sh.sharded_train_step(sharded, config, mesh)
    out, metrics = step(sharded, sh.shard_batch(rollout, mesh), jax.random.key(3))
    assert int(out.step) == int(ref_state.step) == config.batch.updates_per_step
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    for name in ("loss/total_avg", "policy/approxkl_avg", "loss/value_avg", "policy/entropy_avg"):
        assert float(metrics[name]) == pytest.approx(float(ref_metrics[name]), rel=1e-4, abs=1e-6), name

    # Parameters and optimizer states really are split over the mesh.
    kernel = out.params["policy"]["params"]["model"]["layers_0"]["up_proj"]["kernel"]
    if mesh_config.fsdp > 1 or mesh_config.tensor > 1:
        assert len({str(s.index) for s in kernel.addressable_shards}) > 1
        assert kernel.addressable_shards[0].data.shape != kernel.shape
    spec = kernel.sharding.spec
    if mesh_config.fsdp > 1:
        assert "fsdp" in tuple(spec)
    if mesh_config.tensor > 1:
        assert spec[1] == "tensor"  # column-parallel: output features


@pytest.mark.parametrize("mesh_config", [MESHES[1], MESHES[2], MESHES[3]], ids=_ids)
def test_shared_prompts_sharded_equal_every_row_on_one_device(setup, mesh_config):
    """GRPO with `share_prompts` on a mesh equals every row run on one device. (Under a
    mesh the loss runs every row: JAX's partitioner got the grouped gradient wrong on 1x8
    and 2x2x2, by up to 0.6 in a parameter after this step, on jax 0.10.2, 0.11.2 and
    0.12.0.1 alike; the forward pass, a forward, groups; the trainer tests above cover it.)"""
    policy, _, params, rollout = setup
    g = 4
    rollout = rollout.replace(query_tokens=jnp.repeat(rollout.query_tokens[::g], g, 0),
                              query_mask=jnp.repeat(rollout.query_mask[::g], g, 0), values=None)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=2,
                                            num_generations=g, kl_loss_coef=0.0, share_prompts=True)
    jaxppo.update.check_rollout(rollout, config)
    state = jaxppo.TrainState.create(apply_fn=policy.apply, params=params["policy"], tx=optax.sgd(0.5))
    ref, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config.replace(share_prompts=False))
    mesh = sh.make_mesh(mesh_config)
    sharded = sh.shard_state(state, mesh)
    out, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(3))
    assert int(out.step) == int(ref.step) == config.batch.updates_per_step
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(metrics["per_minibatch/loss/total"], ref_metrics["per_minibatch/loss/total"],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh_config", [MESHES[2], MESHES[3]], ids=_ids)
def test_top_k_distillation_sharded_equals_one_device(setup, mesh_config):
    """On-policy distillation with the teacher's top k: the teacher's top-k pass (a frozen
    model's, the head's vocabulary split over "tensor" on the 2x2x2 mesh) and the update
    whose loss gathers the student's log-probs of those ids, sharded, equal one device."""
    policy, _, params, rollout = setup
    teacher = jm.Model(policy.config, logits_chunk_size=4)
    teacher_params = teacher.init(jax.random.key(7))
    k = 5
    args = (rollout.query_tokens, rollout.query_mask, rollout.response_tokens, rollout.response_mask, k)
    want = teacher.response_top_logprobs(teacher_params, *args)
    mesh = sh.make_mesh(mesh_config)
    placed = jax.device_put(teacher_params, sh.tree_shardings(teacher_params, mesh))
    with jax.set_mesh(mesh):
        got = jax.jit(teacher.response_top_logprobs, static_argnums=(5,))(placed, *args)
    live = np.asarray(rollout.response_mask, bool)
    np.testing.assert_array_equal(np.asarray(got[2])[live], np.asarray(want[2])[live])
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_allclose(np.asarray(a)[live], np.asarray(b)[live], atol=1e-5)
    rollout = rollout.replace(values=None, ref_logprobs=want[0], teacher_top_logprobs=want[1],
                              teacher_top_ids=want[2])
    config = jaxppo.Config.for_algorithm("distill", batch_size=16, mini_batch_size=8, ppo_epochs=2, distill_top_k=k)
    state = jaxppo.TrainState.create(apply_fn=policy.apply, params=params["policy"], tx=optax.sgd(0.5))
    ref, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config)
    sharded = sh.shard_state(state, mesh)
    out, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(3))
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    assert float(ref_metrics["loss/distill_avg"]) > 0.1
    np.testing.assert_allclose(metrics["per_minibatch/loss/distill"], ref_metrics["per_minibatch/loss/distill"],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh_config", [MESHES[2], MESHES[3]], ids=_ids)
def test_scanned_layers_sharded_equal_unrolled_single_device(setup, mesh_config):
    """Stacked layers (`scan_layers`) with the unchunked log-prob head under a mesh: same
    update as the unrolled model (chunked head) on one device, stacked kernels split on
    the per-layer kernel's dimensions, layer axis whole."""
    policy, critic, params, rollout = setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=1)
    # Adam (its moments are checked below) with eps large enough that float rounding in
    # near-zero gradients is not blown up to a full-size step.
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.adam(1e-2, eps=1e-3))
    ref, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config)

    scanned = jm.PolicyAndCritic(jm.Model(policy.config, scan_layers=True),
                                 jm.Model(critic.config, kind="value", scan_layers=True))
    stacked = {k: jm.stack_layers(v, policy.config) for k, v in params.items()}
    mesh = sh.make_mesh(mesh_config)
    s_state = sh.shard_state(jaxppo.TrainState.create(apply_fn=scanned, params=stacked, tx=optax.adam(1e-2, eps=1e-3)), mesh)
    out, metrics = sh.sharded_train_step(s_state, config, mesh)(s_state, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(3))
    assert float(metrics["loss/total_avg"]) == pytest.approx(float(ref_metrics["loss/total_avg"]), rel=1e-4)
    want = {k: jm.stack_layers(v, policy.config) for k, v in ref.params.items()}
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    layers = out.params["policy"]["params"]["model"]["layers"]
    per_layer = sh.param_spec(("layers_0", "up_proj", "kernel"), layers["up_proj"]["kernel"].shape[1:], mesh)
    assert layers["up_proj"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(None, *per_layer)
    assert "fsdp" in tuple(layers["up_proj"]["kernel"].sharding.spec)
    if mesh_config.tensor > 1:
        assert layers["up_proj"]["kernel"].sharding.spec[2] == "tensor"  # column-parallel: output features
        assert layers["down_proj"]["kernel"].sharding.spec[1] == "tensor"  # row-parallel: input features
    mu = out.opt_state[0].mu["policy"]["params"]["model"]["layers"]["down_proj"]["kernel"]
    assert mu.sharding.spec == layers["down_proj"]["kernel"].sharding.spec


def _slice_then_matmul_gradient(pin_rows_after_slice):
    """Reduced from the log-prob head: rows constrained over (data, fsdp), a slice of the
    sequence axis, a matmul with an (fsdp, tensor)-sharded weight. Returns the largest
    gradient error against one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=2, tensor=2))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, 10, 32)), jnp.float32)
    w1 = jnp.asarray(rng.normal(size=(32, 32)) * 0.2, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(32, 64)) * 0.2, jnp.float32)
    t = jnp.asarray(rng.integers(0, 64, (8, 4)))
    rows = NamedSharding(mesh, P(("data", "fsdp")))

    def loss(params, x, t, sharded):
        w1, w2 = params
        if sharded:
            x = jax.lax.with_sharding_constraint(x, rows)
        h = jnp.tanh(x @ w1)[:, 3:7]
        if sharded and pin_rows_after_slice:
            h = jax.lax.with_sharding_constraint(h, rows)
        return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(h @ w2), t[..., None], -1))

    ref = jax.grad(loss)((w1, w2), x, t, False)
    weights = NamedSharding(mesh, P("fsdp", "tensor"))
    got = jax.jit(jax.grad(loss), static_argnums=3)(jax.device_put((w1, w2), weights), jax.device_put(x, rows),
                                                     jax.device_put(t, rows), True)
    return max(float(jnp.abs(a - b).max()) for a, b in zip(got, ref))


@pytest.mark.xfail(release(jax.__version__) <= release("0.12.0.1"), strict=True,
                   reason="JAX SPMD miscompile (seen on jax 0.10.2, 0.11.2 and 0.12.0.1): wrong gradient for "
                          "slice-then-matmul with an (fsdp, tensor)-sharded weight on a data x fsdp x tensor mesh; "
                          "jaxppo pins the rows after the slice (see the next test). An XPASS means jax fixed it; "
                          "on newer versions the test must pass (or the pin's note and this mark be extended)")
def test_known_jax_miscompile_slice_then_sharded_matmul():
    assert _slice_then_matmul_gradient(pin_rows_after_slice=False) < 1e-4


def test_pinning_rows_after_the_slice_avoids_the_miscompile():
    assert _slice_then_matmul_gradient(pin_rows_after_slice=True) < 1e-4


def test_adam_states_sharded_like_params_and_accumulation(setup):
    policy, critic, params, rollout = setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=16, ppo_epochs=1, gradient_accumulation_steps=2)
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.adam(1e-3))
    ref, _ = jaxppo.train_step(state, rollout, jax.random.key(4), config)
    mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=8))
    sharded = sh.shard_state(state, mesh)
    out, _ = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh), jax.random.key(4))
    assert int(out.step) == 1
    mu = out.opt_state[0].mu["policy"]["params"]["model"]["layers_1"]["down_proj"]["kernel"]
    assert "fsdp" in tuple(mu.sharding.spec)
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def _per_device_bytes(setup, fsdp):
    policy, critic, params, rollout = setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=1)
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.adam(1e-3))
    mesh = sh.make_mesh(sh.MeshConfig(data=8 // fsdp, fsdp=fsdp))
    sharded = sh.shard_state(state, mesh)
    compiled = sh.sharded_train_step(sharded, config, mesh).lower(
        sharded, sh.shard_batch(rollout, mesh), jax.random.key(0)).compile()
    mem = compiled.memory_analysis()
    return mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes


def test_per_device_memory_falls_as_fsdp_grows(setup):
    sizes = [_per_device_bytes(setup, f) for f in (1, 2, 4, 8)]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3], sizes
    assert sizes[3] < 0.5 * sizes[0], sizes


def test_sampling_under_mesh_equals_single_device(setup):
    policy, _, params, _ = setup
    rng = np.random.default_rng(5)
    prompts = jnp.asarray(rng.integers(3, V, (16, Q)))
    mask = jnp.ones_like(prompts).at[::2, 0].set(0)
    single = generate(policy, params["policy"], prompts, mask, jax.random.key(9), response_length=R)
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=4))
    p = sh.shard_state(params["policy"], mesh)
    out = generate(policy, p, sh.shard_batch(prompts, mesh), sh.shard_batch(mask, mesh), jax.random.key(9),
                      response_length=R)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(single.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(single.logprobs), atol=1e-5)


def test_trainer_under_mesh_matches_single_device(tmp_path):
    single, _ = run_small(tmp_path / "single")
    sharded, trainer = run_small(tmp_path / "mesh", mesh=sh.MeshConfig(data=2, fsdp=4))
    assert [h["ppo/updates_applied"] for h in sharded] == [4, 4]
    for a, b in zip(single, sharded):
        assert a["objective/scores"] == b["objective/scores"]
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)
    kernel = trainer.state.params["policy"]["params"]["transformer"]["h_0"]["c_fc"]["kernel"]
    assert "fsdp" in tuple(kernel.sharding.spec)
    # The update was compiled ahead of time on the mesh too, and that program ran every
    # update (a rollout unlike the abstract one would have dropped it).
    from jaxppo.run import compiled

    assert isinstance(trainer.train_step, compiled.Precompiled) and trainer.train_step.compiled is not None
    # A sharded checkpoint restores with its shardings.
    again, resumed = run_small(tmp_path / "mesh", mesh=sh.MeshConfig(data=2, fsdp=4))
    assert resumed.iteration == 2 and len(again) == 2
    # The continuous sampler (5 slots for 16 rows) under the same mesh: the same run.
    slots, _ = run_small(tmp_path / "slots", mesh=sh.MeshConfig(data=2, fsdp=4), num_slots=5)
    for a, b in zip(single, slots):
        assert a["objective/scores"] == b["objective/scores"]
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)


def test_grpo_trainer_under_mesh_matches_single_device(tmp_path):
    """A critic-free run (GRPO with the KL loss term: policy and reference, no critic) on a
    2x2x2 mesh gives the single-device metrics."""
    from trainer_setup import small_trainer

    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=2, num_generations=4)
    single = small_trainer(tmp_path / "single", ppo=ppo).train()
    trainer = small_trainer(tmp_path / "mesh", ppo=ppo, mesh=sh.MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = trainer.train()
    assert [h["ppo/updates_applied"] for h in sharded] == [4, 4]
    for a, b in zip(single, sharded):
        assert a["reward"] == b["reward"]
        for name in ("loss/total_avg", "kl", "policy/approxkl_avg"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    assert "critic" not in trainer.state.params and trainer.parts.ref_params is not None


def test_invalid_meshes_and_batches_are_clear_errors():
    with pytest.raises(ValueError, match="= 12 devices, but 8 are available"):
        sh.make_mesh(sh.MeshConfig(data=3, fsdp=4, tensor=1))
    with pytest.raises(ValueError, match="do not divide the 8 devices"):
        sh.make_mesh(sh.MeshConfig(data=3))
    with pytest.raises(ValueError, match="mesh axis fsdp=0"):
        sh.make_mesh(sh.MeshConfig(fsdp=0))
    mesh = sh.make_mesh(sh.MeshConfig(data=2, fsdp=4))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert dict(sh.make_mesh().shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    with pytest.raises(ValueError, match="must all be multiples of 8"):
        sh.check_batch_divides(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=4), mesh)
    with pytest.raises(ValueError, match="micro-batch size 4"):
        sh.check_batch_divides(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=16, gradient_accumulation_steps=4), mesh)


@pytest.mark.parametrize("mesh", [sh.MeshConfig(data=1, fsdp=8), sh.MeshConfig(data=2, fsdp=2, tensor=2)], ids=_ids)
def test_lora_trainer_under_mesh_matches_single_device(tmp_path, mesh):
    """GRPO with LoRA adapters (base frozen, reference = adapters off) on a mesh gives the
    single-device metrics and adapters; the adapters are split on their non-rank
    dimension as their base kernel is."""
    from trainer_setup import small_trainer

    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4)
    lora = jm.LoraConfig(rank=4, alpha=8, targets="all-linear")
    single_trainer = small_trainer(tmp_path / "single", ppo=ppo, lora=lora, export_final=False)
    single = single_trainer.train()
    trainer = small_trainer(tmp_path / "mesh", ppo=ppo, lora=lora, mesh=mesh, export_final=False)
    sharded = trainer.train()
    for a, b in zip(single, sharded):
        assert a["reward"] == b["reward"]
        for name in ("loss/total_avg", "kl", "policy/approxkl_avg"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    for a, b in zip(jax.tree.leaves(single_trainer.state.params["lora"]), jax.tree.leaves(trainer.state.params["lora"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    block = trainer.state.params["lora"]["transformer"]["h_0"]
    a_spec, b_spec = tuple(block["c_fc"]["lora_a"].sharding.spec), tuple(block["c_fc"]["lora_b"].sharding.spec)
    if mesh.tensor == 2:  # c_fc is column-parallel: B's output dimension on "tensor"; A's input over fsdp
        assert b_spec == (None, "tensor") and a_spec == ("fsdp", None)
        assert tuple(block["mlp_c_proj"]["lora_a"].sharding.spec) == ("tensor", None)  # row-parallel: A's input
    else:
        assert a_spec == ("fsdp", None) and b_spec == (None, "fsdp")


def test_dapo_shaping_and_adaptive_entropy_under_mesh_match_single_device(tmp_path):
    """Issue 20's options that live in the run state and the rollout (the adaptive entropy
    coefficient, the per-completion coefficient column; DAPO's overlong punishment and
    truncation mask; the high-entropy token selection over the global batch) give the
    single-device metrics on a 2x4 mesh."""
    ppo = jaxppo.Config.for_algorithm("dapo", batch_size=16, mini_batch_size=8, ppo_epochs=2, num_generations=4,
                                         ent_coef=0.01, entropy_target=5.9, entropy_coef_step=0.004,
                                         top_entropy_quantile=0.5)
    single, _ = run_small(tmp_path / "single", ppo=ppo, export_final=False)
    sharded, _ = run_small(tmp_path / "mesh", ppo=ppo, export_final=False, mesh=sh.MeshConfig(data=2, fsdp=4))
    assert [r["objective/entropy_coef"] for r in sharded] == [r["objective/entropy_coef"] for r in single]
    for a, b in zip(single, sharded):
        for name in ("objective/scores", "objective/overlong_penalty", "val/num_truncated_masked"):
            assert a[name] == b[name], name
        for name in ("loss/total_avg", "policy/entropy_avg", "policy/entropy_mask_fraction"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name


def test_multiturn_lora_trainer_under_mesh_matches_single_device(tmp_path):
    """Multi-turn episodes (the demo's environment: observations inside the sequence, the
    policy's tokens only in the loss) with a LoRA policy on a 2x4 mesh give the
    single-device metrics."""
    from trainer_setup import small_trainer

    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4)
    lora = jm.LoraConfig(rank=4, alpha=8, targets="all-linear")
    settings = dict(ppo=ppo, lora=lora, export_final=False, environment=demo.GuessTheDigit, reward_fns=None,
                    prompts=demo.multiturn_prompts(), response_length=16, turn_length=3, max_len=48)
    single = small_trainer(tmp_path / "single", **settings).train()
    sharded = small_trainer(tmp_path / "mesh", mesh=sh.MeshConfig(data=2, fsdp=4), **settings).train()
    for a, b in zip(single, sharded):
        for name in ("reward", "env/turns_mean", "env/observation_tokens", "env/truncated_episodes"):
            assert a[name] == b[name], name
        for name in ("loss/total_avg", "kl", "policy/approxkl_avg"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name


def test_packed_multiturn_lora_trainer_under_mesh_matches_single_device_padded(tmp_path):
    """Packed sequences (streams chosen per iteration, scoring and update) for multi-turn
    episodes with a LoRA policy on a 2x4 mesh give the padded single-device run."""
    from trainer_setup import small_trainer

    base = dict(batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4, kl_loss_coef=0.05)
    packed = jaxppo.Config.for_algorithm("grpo", pack_sequences=True, pack_length=96, **base)
    lora = jm.LoraConfig(rank=4, alpha=8, targets="all-linear")
    settings = dict(lora=lora, export_final=False, environment=demo.GuessTheDigit, reward_fns=None,
                    prompts=demo.multiturn_prompts(), response_length=16, turn_length=3, max_len=48)
    single = small_trainer(tmp_path / "single", ppo=jaxppo.Config.for_algorithm("grpo", **base), **settings).train()
    sharded = small_trainer(tmp_path / "mesh", ppo=packed, mesh=sh.MeshConfig(data=2, fsdp=4), **settings).train()
    for a, b in zip(single, sharded):
        for name in ("reward", "env/turns_mean", "env/observation_tokens"):
            assert a[name] == b[name], name
        for name in ("loss/total_avg", "kl", "policy/approxkl_avg"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
        assert b["packing/overflow"] == 0.0 and b["packing/streams"] < 8


def test_dynamic_sampling_under_mesh_matches_single_device(tmp_path):
    """Dynamic sampling's rounds, picks and masked fill on a 2x4 mesh give the
    single-device run."""
    import test_dynamic as td

    single_trainer, single = td.run(tmp_path / "single", td.scripted, dynamic_sampling=True,
                                    dynamic_sampling_rounds=1)
    mesh_trainer, sharded = td.run(tmp_path / "mesh", td.scripted, dynamic_sampling=True, dynamic_sampling_rounds=1,
                                   mesh=sh.MeshConfig(data=2, fsdp=4))
    for a, b in zip(single, sharded):
        for name in ("reward", "dynamic/rounds", "dynamic/groups_dropped", "dynamic/masked_groups"):
            assert a[name] == b[name], name
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)
    assert mesh_trainer.run.prompts_consumed == single_trainer.run.prompts_consumed


@pytest.mark.parametrize("mesh_config,scan,grouped", [(MESHES[2], True, False), (MESHES[2], True, True),
                                                      (MESHES[3], False, False)],
                         ids=["fsdp8-scanned", "fsdp8-scanned-grouped", "2x2x2"])
def test_mixture_of_experts_sharded_equals_single_device(setup, mesh_config, scan, grouped, monkeypatch):
    """A Qwen3-MoE-layout policy and critic (8 experts, 2 per token): the update on the mesh
    equals one device, the experts' kernels split on the expert axis over "fsdp" and on
    their intermediate features over "tensor". A micro-batch's 80 tokens take the few-token
    path (`moe.every_expert`); "grouped" forces the grouped products, as long rows run."""
    from jaxppo.models import moe

    if grouped:
        monkeypatch.setattr(moe, "DENSE_TOKENS", 0)
    jax.clear_caches()  # the path is chosen when the program is traced
    _, _, _, rollout = setup
    cfg = jm.ModelConfig(model_type="qwen3_moe", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=32,
                         tie_word_embeddings=False, eos_token_ids=(2,), qk_norm=True, num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=16)
    policy, critic = jm.Model(cfg, scan_layers=scan), jm.Model(cfg, kind="value", scan_layers=scan)
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2)
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.sgd(0.1))
    ref, ref_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config)
    mesh = sh.make_mesh(mesh_config)
    sharded = sh.shard_state(state, mesh)
    out, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(3))
    assert float(metrics["loss/total_avg"]) == pytest.approx(float(ref_metrics["loss/total_avg"]), rel=1e-4)
    for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)
    trunk = out.params["policy"]["params"]["model"]
    experts = (trunk["layers"] if scan else trunk["layers_0"])["moe"]["experts"]
    lead = (None,) if scan else ()
    assert experts["gate_proj"].sharding.spec[len(lead)] == "fsdp"
    if mesh_config.tensor > 1:
        assert tuple(experts["gate_proj"].sharding.spec) == lead + ("fsdp", None, "tensor")
        assert tuple(experts["down_proj"].sharding.spec) == lead + ("fsdp", "tensor", None)
    assert experts["up_proj"].addressable_shards[0].data.shape[len(lead)] == 8 // mesh_config.fsdp
    # Expert parallel: under the mesh each device computes its own experts (a shard_map over
    # fsdp), which one device without a mesh does not need.
    ids, mask = rollout.query_tokens, rollout.query_mask
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(policy.apply)(sharded.params["policy"], ids, mask))
    assert "shard_map" not in str(jax.make_jaxpr(policy.apply)(params["policy"], ids, mask))
    jax.clear_caches()
