"""The context axis (each row's positions split over a mesh axis) on 8 host devices: ring
and Ulysses attention against plain softmax attention computed in numpy, model forwards and
the update against one device, compiled memory falling with the axis, a trainer run equal
to one device and resumed exactly, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo import sharding as sh
from jaxppo.models.transformer import attend
from trainer_setup import require_devices, run_small

require_devices(8)


def _mesh(data=1, fsdp=1, context=1, tensor=1):
    n = data * fsdp * context * tensor
    return sh.make_mesh(sh.MeshConfig(data=data, fsdp=fsdp, context=context, tensor=tensor), jax.devices()[:n])


def _numpy_attention(q, k, v, mask):
    """Softmax attention by loops over rows and heads (a query that sees no key: all-masked
    scores of equal value, an average of every value, as one softmax gives)."""
    b, l, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros((b, l, h, d))
    for i in range(b):
        for j in range(h):
            scores = q[i, :, j].astype(np.float64) @ k[i, :, j // group].T.astype(np.float64) / np.sqrt(d)
            scores = np.where(mask[i], scores, -1e30)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[i, :, j] = (weights / weights.sum(axis=1, keepdims=True)) @ v[i, :, j // group]
    return out.reshape(b, l, h * d)


def _masks(b, l, rng):
    """Masks the models build: causal with left padding (some rows' past a block); a sliding window of 5; two packed
    segments; an image's block of tokens seeing each other both ways."""
    slots = np.arange(l)
    causal = slots[None, :] <= slots[:, None]
    starts = rng.integers(0, l // 2, b)
    real = slots[None, :] >= starts[:, None]
    padded = causal[None] & real[:, None, :]
    window = padded & (slots[None, None, :] > slots[None, :, None] - 5)
    segment = (slots >= l // 3).astype(int)
    packed = causal[None] & (segment[:, None] == segment[None, :])[None]
    image = (slots >= 4) & (slots < 12)
    bidirectional = (causal | (image[:, None] & image[None, :]))[None] & real[:, None, :]
    # Every row padded past the first blocks: queries there see no key in any block.
    long_padding = causal[None] & (slots[None, :] >= rng.integers(l // 4, l // 2, b)[:, None])[:, None, :]
    return {"padded": padded, "long padding": long_padding, "window": np.broadcast_to(window, (b, l, l)),
            "packed": np.broadcast_to(packed, (b, l, l)), "image": bidirectional}


@pytest.mark.parametrize("heads", [(4, 2), (8, 8), (4, 1)], ids=lambda h: f"{h[0]}q-{h[1]}kv")
def test_ring_and_ulysses_attention_equal_plain_attention_and_their_gradients_one_device(heads):
    """Every mask with grouped heads (4 query heads to 2 key/value heads); with one query
    head per key/value head, and with all on one, the masks that test the edges (rows that
    see nothing in whole blocks; an image's block)."""
    h, kv = heads
    b, l, d = 2, 32, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in [(b, l, h, d), (b, l, kv, d), (b, l, kv, d)])
    meshes = [_mesh(context=8), _mesh(data=2, context=4), _mesh(fsdp=2, context=2, tensor=2)]
    masks = _masks(b, l, rng)
    if heads != (4, 2):
        masks = {name: masks[name] for name in ("long padding", "image")}
    for name, mask in masks.items():
        real = mask.any(axis=-1)  # queries that see some key (padding's outputs are never read)
        want = _numpy_attention(q, k, v, mask)
        loss = lambda q, k, v, method: (attend(q, k, v, jnp.asarray(mask), jnp.float32, context=method)  # noqa: E731
                                        * jnp.asarray(real[..., None], jnp.float32)).sum()
        grads = jax.grad(loss, (0, 1, 2))(q, k, v, "ring")  # one device: plain attention, context ignored
        for mesh in meshes:
            for method in ("ring", "ulysses"):
                if method == "ulysses" and h % mesh.shape["context"]:
                    continue
                with jax.set_mesh(mesh):
                    out = jax.jit(attend, static_argnums=(4, 5, 6, 7))(q, k, v, jnp.asarray(mask), jnp.float32, None,
                                                                        "einsum", method)
                    got = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(q, k, v, method)
                label = f"{name} {method} {dict(mesh.shape)}"
                assert np.isfinite(np.asarray(out)).all() and all(np.isfinite(np.asarray(g)).all() for g in got), label
                np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=2e-5, err_msg=label)
                for g, r in zip(got, grads):
                    np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, err_msg=label)


FAMILIES = {
    "llama": dict(model_type="llama", num_heads=4, num_kv_heads=2),
    "qwen3": dict(model_type="qwen3", num_heads=4, num_kv_heads=2, qk_norm=True, head_dim=8),
    "gemma3": dict(model_type="gemma3_text", num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=6,
                   layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=8),
    "qwen3_moe": dict(model_type="qwen3_moe", num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16),
}


def _family(name, max_len=4096):
    cfg = jm.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, intermediate_size=64,
                         max_position_embeddings=max_len, tie_word_embeddings=False, eos_token_ids=(2,),
                         **FAMILIES[name])
    return cfg


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_forward_with_its_rows_split_over_the_context_axis_equals_one_device(name):
    cfg = _family(name)
    rng = np.random.default_rng(1)
    b, l = 4, 64
    ids = jnp.asarray(rng.integers(3, 64, (b, l)))
    mask = (np.arange(l)[None] >= rng.integers(0, l // 2, (b, 1))).astype(np.int32)
    model = jm.Model(cfg, scan_layers=True)
    params = model.init(jax.random.key(0))
    want = np.asarray(model.apply(params, ids, jnp.asarray(mask)))
    real = mask.astype(bool)
    for mesh, method in ((_mesh(context=8), "ring"), (_mesh(data=2, context=4), "ulysses"),
                         (_mesh(fsdp=2, context=2, tensor=2), "ring")):
        m = jm.Model(cfg, scan_layers=True, context_attention=method)
        with jax.set_mesh(mesh):
            got = jax.jit(m.apply)(sh.shard_state(params, mesh), sh.shard_batch(ids, mesh),
                                   sh.shard_batch(jnp.asarray(mask), mesh))
        np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=5e-5, err_msg=f"{method} {mesh.shape}")


def test_rows_of_several_thousand_tokens_split_eight_ways_equal_one_device():
    """2048-token rows (a prompt of 512 left-padded to different lengths, a response of
    1536 with its own padding): the response log-probs of the scoring pass, ring and Ulysses."""
    cfg = _family("llama")
    rng = np.random.default_rng(2)
    b, q, r = 2, 512, 1536
    query = jnp.asarray(rng.integers(3, 64, (b, q)))
    qmask = jnp.asarray(np.arange(q)[None] >= np.array([[0], [300]]), jnp.int32)
    response = jnp.asarray(rng.integers(3, 64, (b, r)))
    rmask = jnp.asarray(np.arange(r)[None] < np.array([[r], [900]]), jnp.int32)
    model = jm.Model(cfg)
    params = model.init(jax.random.key(0))
    want, _, _ = model.response_outputs(params, query, qmask, response, rmask)
    for method in ("ring", "ulysses"):
        mesh = _mesh(context=4) if method == "ulysses" else _mesh(context=8)
        m = jm.Model(cfg, context_attention=method)
        with jax.set_mesh(mesh):
            got, _, _ = jax.jit(m.response_outputs)(sh.shard_state(params, mesh), query, qmask, response, rmask)
        keep = np.asarray(rmask, bool)
        np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(want)[keep], atol=5e-5, err_msg=method)


Q, R = 4, 12  # rows of 16 positions; 12 response positions: the log-prob head splits them over context 4 and 2


@pytest.fixture(scope="module")
def update_setup():
    cfg = _family("llama", max_len=32)
    policy, critic = jm.Model(cfg, logits_chunk_size=4), jm.Model(cfg, kind="value")
    params = {"policy": policy.init(jax.random.key(0)), "critic": critic.init(jax.random.key(1))}
    params["critic"] = jax.tree.map(lambda x: x + 0.02, params["critic"])  # a head that is not zero
    rng = np.random.default_rng(3)
    b = 16
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(3, 64, (b, Q))),
        query_mask=jnp.asarray(np.arange(Q)[None] >= rng.integers(0, 3, (b, 1)), jnp.int32),
        response_tokens=jnp.asarray(rng.integers(3, 64, (b, R))),
        response_mask=jnp.asarray(np.arange(R)[None] < rng.integers(1, R + 1, (b, 1)), jnp.int32),
        logprobs=jnp.full((b, R), -np.log(64), jnp.float32), values=jnp.zeros((b, R)),
        rewards=jnp.asarray(rng.normal(size=(b, R)), jnp.float32))
    state = jaxppo.TrainState.create(apply_fn=jm.PolicyAndCritic(policy, critic), params=params, tx=optax.adam(1e-2))
    return state, rollout


@pytest.mark.parametrize("axes", [dict(data=2, context=4), dict(fsdp=2, context=2, tensor=2)],
                         ids=lambda a: "-".join(f"{k}{v}" for k, v in a.items()))
def test_the_update_with_a_context_axis_equals_one_device(update_setup, axes):
    state, rollout = update_setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2)
    want, want_metrics = jaxppo.train_step(state, rollout, jax.random.key(3), config)
    mesh = _mesh(**axes)
    sharded = sh.shard_state(state, mesh)
    got, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(3))
    assert int(got.step) == int(want.step) == config.batch.updates_per_step
    for name in ("loss/total_avg", "loss/policy_avg", "loss/value_avg", "policy/entropy_avg"):
        np.testing.assert_allclose(float(metrics[name]), float(want_metrics[name]), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), got.params, state.params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # the update moved the weights, so equal weights say something
    diffs = jax.tree.map(lambda a, b: float(jnp.abs(np.asarray(a) - np.asarray(b)).max()), got.params, want.params)
    assert max(jax.tree.leaves(diffs)) < 2e-4, diffs
    # The state is stored over fsdp x context, not copied to each context device.
    kernel = got.params["policy"]["params"]["model"]["layers_0"]["up_proj"]["kernel"]
    assert "context" in str(kernel.sharding.spec), kernel.sharding.spec


def test_packed_rows_with_a_context_axis_equal_one_device(update_setup):
    """The update with each micro-batch's rows packed into streams (segment ids), each
    stream's positions split over the context axis, gives one device's packed update."""
    state, rollout = update_setup
    config = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=1, pack_sequences=True,
                                         pack_streams=4, pack_length=32)
    want, want_metrics = jaxppo.train_step(state, rollout, jax.random.key(4), config)
    mesh = _mesh(data=2, context=4)
    sharded = sh.shard_state(state, mesh)
    got, metrics = sh.sharded_train_step(sharded, config, mesh)(sharded, sh.shard_batch(rollout, mesh),
                                                                jax.random.key(4))
    assert float(metrics["packing/overflow"]) == float(want_metrics["packing/overflow"]) == 0.0  # every row packed
    np.testing.assert_allclose(float(metrics["loss/total_avg"]), float(want_metrics["loss/total_avg"]), rtol=1e-4)
    diffs = jax.tree.map(lambda a, b: float(jnp.abs(np.asarray(a) - np.asarray(b)).max()), got.params, want.params)
    assert max(jax.tree.leaves(diffs)) < 2e-4, diffs


def _temporaries(context, method):
    cfg = _family("llama", max_len=1024)
    policy = jm.Model(cfg, context_attention=method)
    state = jaxppo.TrainState.create(apply_fn=policy, params=policy.init(jax.random.key(0)), tx=optax.sgd(0.1))
    b, q, r = 2, 128, 384
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.ones((b, q), jnp.int32), query_mask=jnp.ones((b, q), jnp.int32),
        response_tokens=jnp.ones((b, r), jnp.int32), response_mask=jnp.ones((b, r), jnp.int32),
        logprobs=jnp.zeros((b, r)), values=jnp.zeros((b, r)), rewards=jnp.zeros((b, r)))
    config = jaxppo.Config.for_algorithm("grpo", batch_size=2, mini_batch_size=2, ppo_epochs=1, num_generations=2,
                                         kl_loss_coef=0.0)
    mesh = _mesh(context=context)
    sharded = sh.shard_state(state, mesh)
    compiled = sh.sharded_train_step(sharded, config, mesh).lower(
        sharded, sh.shard_batch(rollout, mesh), jax.random.key(0)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_update_s_temporaries_per_device_fall_with_the_context_axis():
    """Compiled for 512-token rows: each device's temporaries (activations, scores) fall as
    the axis grows, for both methods."""
    for method in ("ring", "ulysses"):
        sizes = [_temporaries(n, method) for n in (1, 2, 4)]
        assert sizes[0] > 1.5 * sizes[1] and sizes[1] > 1.5 * sizes[2], (method, sizes)


def test_a_trainer_with_a_context_axis_matches_one_device_and_resumes_exactly(tmp_path):
    single, _ = run_small(tmp_path / "single", response_length=8)  # rows of 32 + 8 positions
    mesh = sh.MeshConfig(data=2, fsdp=1, context=4)
    split, trainer = run_small(tmp_path / "context", response_length=8, mesh=mesh)
    assert [h["ppo/updates_applied"] for h in split] == [4, 4]
    # The sampler's rows are split over the context axis's devices too (folded into fsdp).
    assert dict(trainer.parts.collector.mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert dict(trainer.parts.mesh.shape) == {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    for a, b in zip(single, split):
        assert a["objective/scores"] == b["objective/scores"]
        for name in ("loss/total_avg", "loss/value_avg", "objective/kl"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    # Stopped after one iteration and resumed: the second iteration as the straight run's.
    run_small(tmp_path / "resumed", iterations=1, response_length=8, mesh=mesh)
    resumed, trainer = run_small(tmp_path / "resumed", iterations=2, response_length=8, mesh=mesh)
    assert trainer.iteration == 2
    last = resumed[-1]
    for name in ("objective/scores", "loss/total_avg", "objective/kl"):
        assert last[name] == split[-1][name], name


def test_what_the_context_axis_cannot_take_is_refused_before_any_compile():
    with pytest.raises(ValueError, match=r"mesh_context=4 is invalid.*32 \+ 6 = 38"):
        jaxppo.Config.from_settings(mesh_context=4, query_length=32, response_length=6)
    with pytest.raises(ValueError, match="share_prompts=True is invalid.*context axis"):
        jaxppo.Config.from_settings(mesh_context=2, query_length=32, response_length=8, share_prompts=True)
    with pytest.raises(ValueError, match="context_attention='sideways' is invalid"):
        jaxppo.Config.from_settings(context_attention="sideways")
    with pytest.raises(ValueError, match="Model.context_attention='ring2' is invalid"):
        jm.Model(_family("llama"), context_attention="ring2")
    # Ulysses needs heads that divide; a row whose length the axis does not divide.
    cfg = _family("llama")
    params = jm.Model(cfg).init(jax.random.key(0))
    with jax.set_mesh(_mesh(context=8)):
        with pytest.raises(ValueError, match="splits the 4 attention heads over the context axis's 8 devices"):
            jax.jit(jm.Model(cfg, context_attention="ulysses").apply)(params, jnp.ones((1, 16), jnp.int32),
                                                                      jnp.ones((1, 16), jnp.int32))
        with pytest.raises(ValueError, match="rows of 12 positions, which it does not divide"):
            jax.jit(jm.Model(cfg).apply)(params, jnp.ones((1, 12), jnp.int32), jnp.ones((1, 12), jnp.int32))


def test_the_balanced_order_gives_every_device_the_same_share_of_causal_attention():
    """Under a context axis of n, a dense model's whole forward pass lays each row out in
    2n chunks, device i holding chunks i and 2n - 1 - i: with ring attention's tiles of half
    a block, every device computes 2 tiles a step of a causal mask (3 on the first), where
    contiguous blocks give the last device 4 a step and the first 1 tile in all."""
    from jaxppo.models.context import balanced_order

    n, length = 4, 32
    with jax.set_mesh(_mesh(context=n)):
        order, inverse = balanced_order(length)
        assert balanced_order(length + n) is None  # 2n does not divide it: the blocks stay contiguous
    np.testing.assert_array_equal(order[inverse], np.arange(length))
    assert sorted(order.tolist()) == list(range(length))

    def tiles(order):  # [device][step]: the tiles a causal mask leaves to compute
        lc, t = length // n, length // (2 * n)
        causal = order[None, :] <= order[:, None]  # query slot >= key slot, in this layout
        out = []
        for me in range(n):
            steps = []
            for step in range(n):
                j = (me - step) % n
                block = causal[me * lc:(me + 1) * lc, j * lc:(j + 1) * lc]
                steps.append(sum(block[r:r + t, c:c + t].any() for r in (0, t) for c in (0, t)))
            out.append(steps)
        return out

    assert tiles(order) == [[3] + [2] * (n - 1)] * n
    contiguous = tiles(np.arange(length))
    assert contiguous[n - 1] == [3, 4, 4, 4] and sum(contiguous[0]) == 3


def _padded(ids, mask, width=16):
    pad = ((0, 0), (width - ids.shape[1], 0))
    return np.pad(ids, pad), np.pad(mask, pad)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_a_vision_language_model_with_images_under_a_context_axis_matches_transformers(tmp_path, family):
    """Rows with two images, one and none (Qwen's M-RoPE positions, Qwen3-VL's DeepStack
    features added in the early layers; Gemma 3's image blocks attending both ways, within a
    sliding window narrower than an image): the logits with each row split over context
    axes of 4 (ring) and 2 (Ulysses) equal transformers'."""
    import dataclasses

    import torch
    import vision_models as vm
    from test_vision import _rows_with_images
    from test_vision_gemma import _reference, _rows

    if family == "gemma3":
        from jaxppo.models.vision.gemma_images import gemma_prompt

        hf = vm.tiny_gemma3_vl(tmp_path / "hf")
        model, params = jm.from_pretrained(str(tmp_path / "hf"))
        ids, mask, pixel_rows = _rows()
        ids, mask = _padded(ids, mask, 24)
        want = _reference(hf, ids, mask, pixel_rows)
        prompt = gemma_prompt(ids, mask, pixel_rows, model.config)
        images, positions = prompt.images, prompt.positions
    else:
        from jaxppo.models.vision import image_input, mrope_positions

        hf = (vm.tiny_qwen_vl if family == "qwen2_5_vl" else vm.tiny_qwen3_vl)(tmp_path / "hf")
        model, params = jm.from_pretrained(str(tmp_path / "hf"))
        ids, mask, pixel_rows, grid_rows = _rows_with_images(model.config.vision)
        ids, mask = _padded(ids, mask)
        grids = [g for row in grid_rows for g in row]
        with torch.no_grad():
            want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                      pixel_values=torch.tensor(np.concatenate(pixel_rows)), image_grid_thw=torch.tensor(grids),
                      mm_token_type_ids=torch.tensor((ids == vm.IMAGE).astype(np.int64))).logits.numpy()
        positions = np.moveaxis(mrope_positions(ids, mask, grids, vm.IMAGE, model.config.vision.spatial_merge_size)[0],
                                0, -1)
        images = image_input(pixel_rows, grid_rows, model.config.vision)
    real = mask.astype(bool)
    for context, method in ((4, "ring"), (2, "ulysses")):
        split = dataclasses.replace(model, context_attention=method)
        mesh = _mesh(context=context)
        with jax.set_mesh(mesh):
            got = jax.jit(lambda p, i: split.apply(p, ids, mask, images=i, positions=positions))(
                sh.shard_state(params, mesh), images)
        np.testing.assert_allclose(np.asarray(got)[real], want[real], atol=1e-4, rtol=1e-4, err_msg=method)


@pytest.mark.parametrize("names", [sh.AXES, ("context", "tensor", "fsdp", "data")], ids=["usual", "reordered"])
def test_the_samplers_mesh_folds_context_into_fsdp_without_moving_a_parameter_shard(names):
    """On a mesh of fsdp 2 x context 4 (its axes in jaxppo's order or another), the
    samplers' mesh puts every device on fsdp, and a parameter split over ("fsdp",
    "context") on the run's mesh holds on each device the shard that a split over "fsdp"
    on the samplers' mesh holds there; 12 rows, which 8 devices do not divide, keep the
    run's mesh."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    sizes = {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape([sizes[n] for n in names]), names)
    folded = sh.sampling_mesh(mesh, 16)
    assert dict(folded.shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    assert sh.sampling_mesh(mesh, 12) is mesh
    stored = NamedSharding(mesh, P(("fsdp", "context"))).devices_indices_map((16,))
    sampled = NamedSharding(folded, P("fsdp")).devices_indices_map((16,))
    assert stored == sampled
