"""The generic engine: update counts, permutations, retracing, memory, and equality with a
plain Python loop written here (the reference lives in the tests only)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxppo import BatchConfig, TrainState
from jaxppo.update import update_epochs, update_epochs_fn
from jaxppo.update.minibatches import loop_config, update_epochs_jit

D = 5


def _batch(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D)).astype(np.float32)
    y = (x @ np.arange(1, D + 1, dtype=np.float32) + 0.1 * rng.normal(size=n)).astype(np.float32)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y), "id": jnp.arange(n, dtype=jnp.int32)}


def _params():
    return {"w": jnp.zeros((D,), jnp.float32), "b": jnp.zeros((), jnp.float32)}


def regression_loss(params, mb):
    pred = mb["x"] @ params["w"] + params["b"]
    loss = jnp.mean(jnp.square(pred - mb["y"]))
    return loss, {"ids": mb["id"], "mse": loss}


def _state(tx=None):
    return TrainState.create(apply_fn=None, params=_params(), tx=tx or optax.adam(0.05))


CONFIGS = [
    BatchConfig(batch_size=8, mini_batch_size=8, ppo_epochs=1),
    BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=3),
    BatchConfig(batch_size=32, mini_batch_size=8, ppo_epochs=2, gradient_accumulation_steps=4),
    BatchConfig(batch_size=12, mini_batch_size=6, ppo_epochs=4, gradient_accumulation_steps=3),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"B{c.batch_size}-mb{c.mini_batch_size}-e{c.ppo_epochs}-k{c.gradient_accumulation_steps}")
def test_update_count_is_epochs_times_minibatches(config):
    state = _state()
    batch = _batch(config.batch_size)
    for call in range(1, 3):
        state, metrics = update_epochs(state, batch, jax.random.key(call), regression_loss, config)
        expected = config.ppo_epochs * config.batch_size // config.mini_batch_size
        assert int(state.step) == call * expected
        chex.assert_tree_shape_prefix(metrics, (config.ppo_epochs, config.num_minibatches))
        assert metrics["loss"].shape == (config.ppo_epochs, config.num_minibatches)
        assert metrics["loss"].size == expected
        assert bool(jnp.all(metrics["applied"]))
        # The optimizer's own counter agrees: adam counts its updates.
        assert int(state.opt_state[0].count) == call * expected


def test_each_row_once_per_epoch_and_epochs_differ():
    config = BatchConfig(batch_size=24, mini_batch_size=6, ppo_epochs=5)
    _, metrics = update_epochs(_state(), _batch(24), jax.random.key(7), regression_loss, config)
    ids = np.asarray(metrics["aux"]["ids"])
    assert ids.shape == (5, 4, 6)
    orders = []
    for epoch in range(5):
        flat = ids[epoch].ravel()
        assert sorted(flat.tolist()) == list(range(24))
        orders.append(tuple(flat.tolist()))
    assert len(set(orders)) == 5, "each epoch must use its own permutation"
    assert orders[0] != tuple(range(24))


def test_no_retrace_on_repeated_calls():
    config = BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2)
    traces = []

    def counting_loss(params, mb):
        traces.append(1)
        return regression_loss(params, mb)

    state = _state()
    batch = _batch(16)
    before = update_epochs_jit._cache_size()
    state, _ = update_epochs(state, batch, jax.random.key(0), counting_loss, config)
    traced_once = len(traces)
    assert traced_once >= 1
    for i in range(1, 4):
        state, _ = update_epochs(state, _batch(16, seed=i), jax.random.key(i), counting_loss, config)
    assert len(traces) == traced_once, "later calls must not retrace"
    assert update_epochs_jit._cache_size() == before + 1

    # chex's own trace guard around the whole compiled program.
    guarded = chex.assert_max_traces(
        lambda s, b, k: update_epochs_fn_for_test(s, b, k, config), n=1
    )
    jitted = jax.jit(guarded)
    for i in range(3):
        jitted(state, _batch(16, seed=i), jax.random.key(i))


def update_epochs_fn_for_test(state, batch, key, config):
    from jaxppo.update import update_epochs_fn

    return update_epochs_fn(state, batch, key, regression_loss, config)


def _reference_loop(params, batch, key, loss_fn, config, tx):
    """Plain Python: per epoch a permutation, per mini-batch one gradient and one update."""
    opt_state = tx.init(params)
    keys = jax.random.split(key, config.ppo_epochs)
    losses = []
    for e in range(config.ppo_epochs):
        perm = np.asarray(jax.random.permutation(keys[e], config.batch_size))
        for m in range(config.num_minibatches):
            rows = perm[m * config.mini_batch_size : (m + 1) * config.mini_batch_size]
            mb = {k: v[rows] for k, v in batch.items()}
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
    return params, np.array(losses)


@pytest.mark.parametrize("config", CONFIGS[1:3], ids=["plain", "accumulating"])
def test_scan_engine_equals_python_loop(config):
    tx = optax.adam(0.05)
    batch = _batch(config.batch_size, seed=3)
    key = jax.random.key(11)
    state, metrics = update_epochs(_state(tx), batch, key, regression_loss, config)
    ref_params, ref_losses = _reference_loop(_params(), batch, key, regression_loss, config, tx)
    chex.assert_trees_all_close(state.params, ref_params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(metrics["loss"]).ravel(), ref_losses, rtol=1e-5, atol=1e-6)


def test_accumulation_equals_one_step_on_whole_minibatch():
    batch = _batch(32, seed=4)
    key = jax.random.key(5)
    whole = BatchConfig(batch_size=32, mini_batch_size=16, ppo_epochs=2)
    results = []
    for k in (1, 2, 4, 16):
        state, metrics = update_epochs(_state(), batch, key, regression_loss, whole.replace(gradient_accumulation_steps=k))
        assert int(state.step) == 4
        results.append((state.params, metrics["loss"]))
    for params, loss in results[1:]:
        chex.assert_trees_all_close(params, results[0][0], rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(loss, results[0][1], rtol=1e-5, atol=1e-6)


def test_weighted_accumulation_equals_masked_mean_of_whole_minibatch():
    # A per-token masked-mean loss: micro-batches hold different numbers of real tokens,
    # so only token-count weighting reproduces the whole mini-batch's loss.
    rng = np.random.default_rng(6)
    n, t = 16, 6
    batch = {
        "x": jnp.asarray(rng.normal(size=(n, t)).astype(np.float32)),
        "mask": jnp.asarray((np.arange(t)[None] < rng.integers(0, t + 1, size=(n, 1))).astype(np.float32)),
    }

    def masked_loss(params, mb):
        err = jnp.square(mb["x"] * params["w"][0] - 1.0)
        loss = jnp.sum(err * mb["mask"]) / jnp.maximum(jnp.sum(mb["mask"]), 1.0)
        return loss, {}

    def weight(mb):
        return jnp.sum(mb["mask"])

    tx = optax.sgd(0.1)
    base = BatchConfig(batch_size=n, mini_batch_size=8, ppo_epochs=1)
    state = TrainState.create(apply_fn=None, params=_params(), tx=tx)
    s1, m1 = update_epochs(state, batch, jax.random.key(0), masked_loss, base, weight_fn=weight)
    s4, m4 = update_epochs(state, batch, jax.random.key(0), masked_loss, base.replace(gradient_accumulation_steps=4), weight_fn=weight)
    chex.assert_trees_all_close(s1.params, s4.params, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(m1["loss"], m4["loss"], rtol=1e-6, atol=1e-7)
    # Unweighted averaging of the micro-batch means is measurably different here.
    s4u, _ = update_epochs(state, batch, jax.random.key(0), masked_loss, base.replace(gradient_accumulation_steps=4))
    assert not np.allclose(np.asarray(s4u.params["w"]), np.asarray(s1.params["w"]), rtol=1e-4)


def test_same_key_bit_identical_and_different_key_differs():
    config = BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2)
    batch = _batch(16)
    a, ma = update_epochs(_state(), batch, jax.random.key(3), regression_loss, config)
    b, mb = update_epochs(_state(), batch, jax.random.key(3), regression_loss, config)
    c, _ = update_epochs(_state(), batch, jax.random.key(4), regression_loss, config)
    for x, y in zip(jax.tree.leaves((a, ma)), jax.tree.leaves((b, mb))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a.params["w"]), np.asarray(c.params["w"]))


def test_batch_with_wrong_leading_dimension_is_rejected():
    config = BatchConfig(batch_size=16, mini_batch_size=4)
    batch = _batch(16)
    batch["y"] = batch["y"][:12]
    with pytest.raises(AssertionError, match="batch_size=16"):
        update_epochs(_state(), batch, jax.random.key(0), regression_loss, config)
    with pytest.raises(AssertionError, match="batch_size=16"):
        update_epochs(_state(), _batch(32), jax.random.key(0), regression_loss, config)


def _kl_loss(params, mb):
    # approxkl = squared distance travelled from the start (w0 = 0): grows as updates apply.
    loss, aux = regression_loss(params, mb)
    return loss, {"approxkl": jnp.sum(jnp.square(params["w"])), "mse": aux["mse"]}


FORMS = ["target", "branch", "select"]


@pytest.fixture
def engine(request, monkeypatch):
    """`update_epochs` as compiled for this host ("target": XLA:CPU's branch), or with the
    withheld update's form forced ("branch", or "select": what GPU and TPU targets compile),
    in a fresh jit so that no program cached by another form is reused."""
    import functools

    from jaxppo.update import minibatches

    form = request.param
    if form == "target":
        return update_epochs
    monkeypatch.setattr(minibatches, "apply_or_keep", functools.partial(minibatches.apply_or_keep, form=form))
    fresh = jax.jit(update_epochs_fn, static_argnames=("loss_fn", "config"))
    return lambda state, batch, key, loss_fn, config: fresh(state, batch, key, loss_fn, config)


@pytest.mark.parametrize("engine", FORMS, indirect=True)
def test_target_kl_stops_inside_compiled_loop(engine):
    config = BatchConfig(batch_size=16, mini_batch_size=2, ppo_epochs=2, target_kl=0.5)
    tx = optax.sgd(0.05)
    batch = _batch(16, seed=8)
    key = jax.random.key(9)
    state, metrics = engine(_state(tx), batch, key, _kl_loss, config)

    # Reference: Python loop that measures KL before each update and stops at the target.
    params = _params()
    opt_state = tx.init(params)
    keys = jax.random.split(key, config.ppo_epochs)
    applied = []
    stopped = False
    for e in range(config.ppo_epochs):
        perm = np.asarray(jax.random.permutation(keys[e], 16))
        for m in range(config.num_minibatches):
            mb = {k: v[perm[2 * m : 2 * m + 2]] for k, v in batch.items()}
            (_, aux), grads = jax.value_and_grad(_kl_loss, has_aux=True)(params, mb)
            if stopped or float(aux["approxkl"]) > config.target_kl:
                stopped = True
                applied.append(False)
                continue
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            applied.append(True)
    n_applied = sum(applied)
    assert 0 < n_applied < config.updates_per_step, "the test must actually trigger the stop"
    assert int(state.step) == n_applied
    np.testing.assert_array_equal(np.asarray(metrics["applied"]).ravel(), np.array(applied))
    assert bool(metrics["early_stopped"].ravel()[n_applied])
    chex.assert_trees_all_close(state.params, params, rtol=1e-5, atol=1e-6)
    # Skipped mini-batches report NaN rather than stale numbers.
    assert np.all(np.isnan(np.asarray(metrics["loss"]).ravel()[n_applied + 1 :]))


def test_without_target_kl_every_update_applies():
    config = BatchConfig(batch_size=16, mini_batch_size=2, ppo_epochs=2)
    state, metrics = update_epochs(_state(optax.sgd(0.05)), _batch(16, seed=8), jax.random.key(9), _kl_loss, config)
    assert int(state.step) == config.updates_per_step
    assert "early_stopped" not in metrics


def test_target_kl_requires_approxkl_in_aux():
    config = BatchConfig(batch_size=8, mini_batch_size=4, target_kl=0.1)
    with pytest.raises(ValueError, match="'approxkl'"):
        update_epochs(_state(), _batch(8), jax.random.key(0), regression_loss, config)


@pytest.mark.parametrize("engine", FORMS, indirect=True)
def test_nonfinite_minibatch_is_skipped_and_counted(engine):
    config = BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2)
    batch = _batch(16)
    batch["y"] = batch["y"].at[5].set(jnp.nan)
    tx = optax.adam(0.05)
    key = jax.random.key(2)
    state, metrics = engine(_state(tx), batch, key, regression_loss, config)
    # Exactly the mini-batch holding row 5, once per epoch, is skipped.
    ids = np.asarray(metrics["aux"]["ids"])
    holds_bad = np.any(ids == 5, axis=-1)
    np.testing.assert_array_equal(np.asarray(metrics["nonfinite"]), holds_bad)
    np.testing.assert_array_equal(np.asarray(metrics["applied"]), ~holds_bad)
    assert int(state.step) == config.updates_per_step - 2
    assert int(state.skipped_nonfinite) == 2
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((state.params, state.opt_state)))

    # Reference: the same loop, skipping the bad mini-batches.
    params, opt_state = _params(), tx.init(_params())
    keys = jax.random.split(key, 2)
    for e in range(2):
        perm = np.asarray(jax.random.permutation(keys[e], 16))
        for m in range(4):
            rows = perm[4 * m : 4 * m + 4]
            if 5 in rows:
                continue
            mb = {k: v[rows] for k, v in batch.items()}
            (_, _), grads = jax.value_and_grad(regression_loss, has_aux=True)(params, mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    chex.assert_trees_all_close(state.params, params, rtol=1e-5, atol=1e-6)


def _mlp_loss(params, mb):
    # Wide activations, few parameters: the activation memory is what the test reads.
    h = jnp.tanh(mb["x"] @ params["w1"])
    h = jnp.tanh(h * params["s"])
    return jnp.mean(jnp.square(h @ params["w3"] - mb["y"][:, None])), {}


def _temp_bytes(batch_size, mini_batch_size, accumulation=1):
    width = 2048
    params = {"w1": jnp.zeros((D, width)), "s": jnp.zeros((width,)), "w3": jnp.zeros((width, 1))}
    state = TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))
    batch = {"x": jax.ShapeDtypeStruct((batch_size, D), jnp.float32), "y": jax.ShapeDtypeStruct((batch_size,), jnp.float32)}
    config = BatchConfig(batch_size=batch_size, mini_batch_size=mini_batch_size, ppo_epochs=2, gradient_accumulation_steps=accumulation)
    compiled = update_epochs_jit.lower(state, batch, jax.random.key(0), _mlp_loss, config).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_follows_minibatch_not_batch():
    small = _temp_bytes(64, 16)
    large = _temp_bytes(4096, 16)
    # Flat in batch_size: only the permutation indices (4 bytes a row) grow with it.
    assert large <= small * 1.05 + 4 * 4096 * 4, (small, large)
    bigger_mb = _temp_bytes(4096, 256)
    assert bigger_mb > 4 * small, (small, bigger_mb)
    # Under accumulation the micro-batch sets the activation memory.
    accumulated = _temp_bytes(4096, 256, accumulation=16)
    assert accumulated < bigger_mb / 4, (accumulated, bigger_mb)


@pytest.mark.parametrize("optimizer,target_kl", [("adam", None), ("trainer", None), ("trainer", 0.1)])
def test_a_withheld_update_costs_no_second_copy_of_the_state(optimizer, target_kl):
    """At a tiny batch, where activations are negligible, the engine's temporaries stay near
    one gradient (the floor), with plain Adam and with the trainer's optimizer (per-part
    clipped Adam), with and without the KL early stop: on XLA:CPU the skip of a withheld
    update is one branch over the state, not a select of the new state against the old one
    (which keeps a second state alive there) nor a branch nested in another; clipping is a
    scalar factor, not a clipped copy of the gradient. (GPU and TPU targets compile the
    select, which their compilers fuse into the update: tests/test_plan_targets.py.)"""
    import functools

    import jaxppo
    from jaxppo.config.optimizer import build_optimizer

    width = 256
    params = {part: {f"w{i}": jnp.zeros((width, width)) for i in range(4)} for part in ("policy", "critic")}

    def loss_fn(p, mb):
        h = mb["x"]
        for part in ("policy", "critic"):
            for i in range(4):
                h = jnp.tanh(h @ p[part][f"w{i}"])
        loss = jnp.mean((h[:, 0] - mb["y"]) ** 2)
        return loss, {"approxkl": loss}

    tx = optax.adam(1e-3) if optimizer == "adam" else build_optimizer(jaxppo.OptimizerConfig(learning_rate=1e-3), 10,
                                                                         critic=True)[1]
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    batch = {"x": jax.ShapeDtypeStruct((8, width), jnp.float32), "y": jax.ShapeDtypeStruct((8,), jnp.float32)}
    config = BatchConfig(batch_size=8, mini_batch_size=4, ppo_epochs=2, target_kl=target_kl)
    step = jax.jit(functools.partial(update_epochs_fn, loss_fn=loss_fn, config=config), donate_argnums=(0,))
    temp = step.lower(state, batch, jax.random.key(0)).compile().memory_analysis().temp_size_in_bytes
    gradient = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert temp <= 1.3 * gradient, temp / gradient


def test_scalar_clipping_matches_optax():
    from jaxppo.update.minibatches import clip_by_global_norm

    rng = np.random.default_rng(0)
    tree = {"a": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.asarray(rng.normal(size=(7,)), jnp.float32)}
    for max_norm in (0.5, 100.0):  # clipped, and left alone
        ours, _ = clip_by_global_norm(max_norm).update(tree, ())
        ref, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            if max_norm == 100.0:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
        assert float(optax.tree.norm(ours)) == pytest.approx(min(max_norm, float(optax.tree.norm(tree))), rel=1e-5)


# --- Inside the caller's transformations: PureJaxRL creates its train state inside its own
# jitted, seed-vmapped `train`; memory planning creates it under `eval_shape`.

def _train_from_seed(seed_key, batch, key, config, learning_rate=0.05):
    """A whole update phase that creates its own state: parameters drawn from `seed_key`."""
    params = {"w": jax.random.normal(seed_key, (D,)), "b": jnp.zeros((), jnp.float32)}
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=learning_rate)
    state = TrainState.create(apply_fn=None, params=params, tx=tx)
    return update_epochs_fn(state, batch, key, regression_loss, config)


TRANSFORM_CONFIG = BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2)


def _eager_runs(seeds, learning_rates):
    batch = _batch(16, seed=1)
    return [_train_from_seed(jax.random.key(s), batch, jax.random.key(100), TRANSFORM_CONFIG, lr)
            for s, lr in zip(seeds, learning_rates)]


def _assert_runs_equal(stacked, runs):
    for i, (state, metrics) in enumerate(runs):
        row = jax.tree.map(lambda x: x[i], stacked)
        chex.assert_trees_all_close(row[0].params, state.params, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(row[1]["loss"], metrics["loss"], rtol=1e-6, atol=1e-7)
        assert int(row[0].step) == TRANSFORM_CONFIG.updates_per_step


def test_train_state_is_created_inside_jit_vmap_and_scan():
    batch, key = _batch(16, seed=1), jax.random.key(100)
    seeds, lrs = [0, 1, 2], [0.05, 0.01, 0.2]
    runs = _eager_runs(seeds, lrs)
    assert int(runs[0][0].step) == TRANSFORM_CONFIG.updates_per_step
    seed_keys = jnp.stack([jax.random.key(s) for s in seeds])

    # jit: the state is created from traced parameters.
    jitted = jax.jit(lambda k: _train_from_seed(k, batch, key, TRANSFORM_CONFIG))(seed_keys[0])
    chex.assert_trees_all_close(jitted[0].params, runs[0][0].params, rtol=1e-6, atol=1e-7)
    # vmap over seeds and over a traced hyper-parameter (the learning rate), inside jit.
    vmapped = jax.jit(jax.vmap(lambda k, lr: _train_from_seed(k, batch, key, TRANSFORM_CONFIG, lr)))(
        seed_keys, jnp.asarray(lrs))
    _assert_runs_equal(vmapped, runs)
    # lax.scan over seeds, one state created per step of the scan.
    _, scanned = jax.lax.scan(
        lambda c, xs: (c, _train_from_seed(xs[0], batch, key, TRANSFORM_CONFIG, xs[1])), None,
        (seed_keys, jnp.asarray(lrs)))
    _assert_runs_equal(scanned, runs)


def test_train_state_and_update_phase_under_eval_shape():
    params = jax.ShapeDtypeStruct((D,), jnp.float32)
    abstract = jax.eval_shape(lambda w: TrainState.create(apply_fn=None, params={"w": w}, tx=optax.adam(0.1)), params)
    assert abstract.params["w"].shape == (D,)
    assert abstract.opt_state[0].mu["w"].shape == (D,) and abstract.step.dtype == jnp.int32
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batch(16))
    state, metrics = jax.eval_shape(lambda k, b: _train_from_seed(k, b, k, TRANSFORM_CONFIG), jax.random.key(0), batch)
    assert metrics["loss"].shape == (TRANSFORM_CONFIG.ppo_epochs, TRANSFORM_CONFIG.num_minibatches)
    assert state.params["w"].shape == (D,)


def test_fields_the_engine_never_reads_do_not_retrace_it():
    """The loop's static argument is the `BatchConfig` of what it reads: configs that differ
    only in settings it never reads (kl_coef, cliprange, the algorithm) share one compiled
    program; a setting it reads (ppo_epochs) compiles another."""
    import jaxppo

    traces = []

    def counting_loss(params, mb):
        traces.append(1)
        return regression_loss(params, mb)

    base = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=4, ppo_epochs=2)
    same_batch = [base, base.replace(kl_coef=0.3), base.replace(cliprange=0.1, vf_coef=0.5),
                  jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=4, ppo_epochs=2, num_generations=4),
                  BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2)]
    assert len({loop_config(c) for c in same_batch}) == 1  # the group size is a batch shape the loop never reads
    state, batch = _state(), _batch(16)
    for config in same_batch:
        state, _ = update_epochs(state, batch, jax.random.key(0), counting_loss, config)
    assert len(traces) == 1
    state, _ = update_epochs(state, batch, jax.random.key(0), counting_loss, base.replace(ppo_epochs=3))
    assert len(traces) == 2


def test_the_batch_config_is_checked_and_engine_config_still_builds_one():
    with pytest.raises(ValueError, match=r"BatchConfig.batch_size=10 is not divisible by "
                                         r"BatchConfig.mini_batch_size=4: .* \[1, 2, 5, 10\]"):
        BatchConfig(batch_size=10, mini_batch_size=4)
    with pytest.raises(ValueError, match=r"BatchConfig.target_kl=0 is invalid"):
        BatchConfig(batch_size=8, mini_batch_size=4, target_kl=0)
    with pytest.raises(ValueError, match=r"BatchConfig.skip_nonfinite_updates='no' is invalid"):
        BatchConfig(batch_size=8, mini_batch_size=4, skip_nonfinite_updates="no")
    with pytest.raises(TypeError, match=r"config must be a jaxppo.BatchConfig or have one as .batch"):
        update_epochs(_state(), _batch(8), jax.random.key(0), regression_loss, {"batch_size": 8})
    from jaxppo import EngineConfig  # 0.4's name: the same fields, ppo_epochs 1 by default

    with pytest.warns(DeprecationWarning, match=r"jaxppo.EngineConfig is deprecated since 0.5 .*jaxppo.BatchConfig"):
        assert EngineConfig(batch_size=8, mini_batch_size=4) == BatchConfig(batch_size=8, mini_batch_size=4,
                                                                             ppo_epochs=1)


def test_without_the_nonfinite_check_every_update_applies():
    """`skip_nonfinite_updates=False`: no check, every update applied (a NaN reaches the parameters,
    as it would in a loop without the check); with the check the same batch skips."""
    batch = _batch(16)
    batch["y"] = batch["y"].at[5].set(jnp.nan)
    config = BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=1, skip_nonfinite_updates=False)
    state, metrics = update_epochs(_state(optax.sgd(0.01)), batch, jax.random.key(2), regression_loss, config)
    assert int(state.step) == 4 and bool(jnp.all(metrics["applied"]))
    assert int(state.skipped_nonfinite) == 0 and bool(jnp.isnan(state.params["w"]).any())
    checked, _ = update_epochs(_state(optax.sgd(0.01)), batch, jax.random.key(2), regression_loss,
                               config.replace(skip_nonfinite_updates=True))
    assert int(checked.step) == 3 and bool(jnp.isfinite(checked.params["w"]).all())


# ---------------------------------------------------------------- any train state, a key, an order


def test_flax_train_state_gets_the_same_updates():
    """flax's own `TrainState` (params, step, apply_gradients(grads=...); no freeze, no
    non-finite counter) through the engine: the same parameters and update count as
    jaxppo's, with the non-finite skip's and the KL stop's branches compiled in."""
    from flax.training import train_state

    batch = _batch(16, seed=2)
    for config in (BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2, gradient_accumulation_steps=2),
                   BatchConfig(batch_size=16, mini_batch_size=4, ppo_epochs=2, target_kl=1e9)):
        flax_state = train_state.TrainState.create(apply_fn=None, params=_params(), tx=optax.adam(0.05))
        loss = regression_loss if config.target_kl is None else (
            lambda p, mb: (regression_loss(p, mb)[0], {"approxkl": jnp.zeros(()), **regression_loss(p, mb)[1]}))
        ours, _ = update_epochs(_state(), batch, jax.random.key(4), loss, config)
        theirs, metrics = update_epochs(flax_state, batch, jax.random.key(4), loss, config)
        assert isinstance(theirs, train_state.TrainState)
        assert int(theirs.step) == int(ours.step) == config.updates_per_step == int(jnp.sum(metrics["applied"]))
        chex.assert_trees_all_close(theirs.params, ours.params, rtol=1e-6, atol=1e-7)
        assert float(jnp.max(jnp.abs(theirs.params["w"]))) > 0.1  # it trained


def _key_loss(params, mb, key):
    """A loss that reads its key: aux holds a uniform draw from it (and the rows)."""
    loss, aux = regression_loss(params, mb)
    return loss, {**aux, "draw": jax.random.uniform(key)}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_loss_key_is_one_per_minibatch_and_leaves_the_permutations(accumulate):
    config = BatchConfig(batch_size=16, mini_batch_size=8, ppo_epochs=3, gradient_accumulation_steps=accumulate)
    key = jax.random.key(9)
    _, plain = update_epochs(_state(), _batch(16), key, regression_loss, config)
    _, keyed = update_epochs(_state(), _batch(16), key, _key_loss, config, loss_key=True)
    np.testing.assert_array_equal(keyed["aux"]["ids"], plain["aux"]["ids"])  # the same rows, the same order
    # The documented derivation, written out: fold_in(key, 1), one key per (epoch,
    # mini-batch), split again over the micro-batches (whose draws the aux averages).
    keys = jax.random.split(jax.random.fold_in(key, 1), (3, 2))
    want = np.zeros((3, 2))
    for e in range(3):
        for m in range(2):
            subkeys = [keys[e, m]] if accumulate == 1 else list(jax.random.split(keys[e, m], accumulate))
            want[e, m] = np.mean([float(jax.random.uniform(k)) for k in subkeys])
    np.testing.assert_allclose(np.asarray(keyed["aux"]["draw"]), want, rtol=1e-6)
    assert len(set(np.round(want.ravel(), 6))) == 6  # every mini-batch its own key


def test_own_order_is_walked_and_checked():
    """`order(key, config)` replaces the permutation: here each epoch walks the rows in
    reverse; a wrong shape is an error naming what is expected."""
    config = BatchConfig(batch_size=12, mini_batch_size=4, ppo_epochs=2)

    def reverse(key, config):
        rows = jnp.arange(config.batch_size - 1, -1, -1, dtype=jnp.int32)
        return jnp.broadcast_to(rows, (config.ppo_epochs, config.batch_size)).reshape(
            config.ppo_epochs, config.num_minibatches, config.mini_batch_size)

    _, metrics = update_epochs(_state(), _batch(12), jax.random.key(0), regression_loss, config, order=reverse)
    np.testing.assert_array_equal(np.asarray(metrics["aux"]["ids"]).reshape(2, 12), [list(range(11, -1, -1))] * 2)
    wrong = lambda key, config: jnp.zeros((config.ppo_epochs, config.batch_size), jnp.int32)
    with pytest.raises(AssertionError, match=r"order\(key, config\) must give \(ppo_epochs, num_minibatches, "
                                             r"mini_batch_size\) rows"):
        update_epochs(_state(), _batch(12), jax.random.key(0), regression_loss, config, order=wrong)


@pytest.mark.parametrize("apply", [True, False])
def test_both_forms_of_a_withheld_update_give_the_same_state(apply):
    """`apply_or_keep`'s two forms (XLA:CPU's branch, GPU and TPU's select) against
    `apply_gradients` itself, for the trainer's optimizer (per-part Adam with clipping and a
    schedule: counts, moments, parameters) and a frozen part."""
    import jaxppo
    from jaxppo.config.optimizer import build_optimizer
    from jaxppo.update.minibatches import Freeze, apply_or_keep

    rng = np.random.default_rng(3)
    params = {part: {name: jnp.asarray(rng.normal(size=(4, 3)), jnp.float32) for name in ("w", "b", "base")}
              for part in ("policy", "critic")}
    tx = build_optimizer(jaxppo.OptimizerConfig(learning_rate=1e-2, max_grad_norm=0.5), 10, critic=True)[1]
    state = TrainState.create(apply_fn=None, params=params, tx=tx, freeze=Freeze(prefixes=(("policy", "base"),)))
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), state.trained_params())
    state = state.apply_gradients(grads=grads)  # moments and counts away from their initial values
    expected = state.apply_gradients(grads=grads) if apply else state
    for form in ("branch", "select"):
        got = jax.jit(lambda s, g, a: apply_or_keep(s, g, a, form=form))(state, grads, jnp.asarray(apply))
        chex.assert_trees_all_equal(got, expected)
    with pytest.raises(ValueError, match="form='copy' is invalid"):
        apply_or_keep(state, grads, jnp.asarray(apply), form="copy")
