"""train_step on a small hand-written Flax policy/value model, against a reference written
here: GAE by a Python loop, the PPO loss from its formulas, and a Python loop of updates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo import Config, RolloutBatch, TrainState, train_step
from jaxppo.testing.toy import make_toy

Q, R, V = 4, 6, 32


@pytest.fixture(scope="module")
def model():
    return make_toy(jax.random.key(0), vocab_size=V, width=16, depth=1, heads=2, max_len=Q + R, seq_len=Q + R)


def on_policy(model, rollout, temperature=1.0):
    """The rollout with log-probs and values recomputed by the model (ratio 1 at the start)."""
    apply_fn, params = model
    batch = {"query_tokens": rollout.query_tokens, "query_mask": rollout.query_mask,
             "response_tokens": rollout.response_tokens, "response_mask": rollout.response_mask}
    logprobs, values, _ = jaxppo.update.response_outputs(apply_fn, params, batch, temperature)
    return rollout.replace(logprobs=logprobs, values=values)


def make_rollout(b, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, R + 1, size=(b, 1))
    pads = rng.integers(0, Q, size=(b, 1))
    return RolloutBatch(
        query_tokens=jnp.asarray(rng.integers(0, V, size=(b, Q)), jnp.int32),
        query_mask=jnp.asarray(np.arange(Q)[None] >= pads, jnp.int32),
        response_tokens=jnp.asarray(rng.integers(0, V, size=(b, R)), jnp.int32),
        response_mask=jnp.asarray(np.arange(R)[None] < lengths, jnp.int32),
        logprobs=jnp.asarray(-np.log(V) + 0.3 * rng.normal(size=(b, R)), jnp.float32),
        values=jnp.asarray(0.5 * rng.normal(size=(b, R)), jnp.float32),
        rewards=jnp.asarray(rng.normal(size=(b, R)), jnp.float32),
    )


def _state(model, tx=None):
    apply_fn, params = model
    return TrainState.create(apply_fn=apply_fn, params=params, tx=tx or optax.adam(3e-3))


# ---------------------------------------------------------------- reference, tests only


def _ref_advantages(rollout, config):
    rewards = np.asarray(rollout.rewards, np.float64)
    values = np.asarray(rollout.values, np.float64)
    mask = np.asarray(rollout.response_mask, np.float64)
    b = rewards.shape[0]
    if config.advantages.whiten_rewards:
        real = rewards[mask > 0]
        rewards = (rewards - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) + real.mean()
    adv = np.zeros_like(rewards)
    for i in range(b):
        n = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(n)):
            nv = values[i, t + 1] if t + 1 < n else 0.0
            last = rewards[i, t] + config.advantages.gamma * nv - values[i, t] + config.advantages.gamma * config.advantages.lam * last
            adv[i, t] = last
    returns = (adv + values) * mask
    if config.advantages.whiten_advantages:
        real = adv[mask > 0]
        adv = (adv - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * mask
    return jnp.asarray(adv, jnp.float32), jnp.asarray(returns, jnp.float32)


def _ref_loss(params, apply_fn, mb, config):
    tokens = jnp.concatenate([mb["qt"], mb["rt"]], axis=1)
    mask = jnp.concatenate([mb["qm"], mb["rm"]], axis=1)
    logits, values = apply_fn(params, tokens, mask)
    logits = logits[:, Q - 1 : Q - 1 + R] / config.sampling.temperature
    values = values[:, Q - 1 : Q - 1 + R]
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, mb["rt"][..., None], axis=-1)[..., 0]
    m = mb["rm"].astype(jnp.float32)
    n = jnp.sum(m)
    rows = m.shape[0]

    def agg(x):  # each aggregation mode written out over rows
        if config.loss.loss_aggregation == "token_mean":
            return jnp.sum(x * m) / n
        if config.loss.loss_aggregation == "seq_mean_token_mean":
            return sum(jnp.sum(x[i] * m[i]) / jnp.sum(m[i]) for i in range(rows)) / rows
        return sum(jnp.sum(x[i] * m[i]) / R for i in range(rows)) / rows

    ratio = jnp.exp(logp - mb["lp"])
    pg = agg(jnp.maximum(-mb["adv"] * ratio, -mb["adv"] * jnp.clip(ratio, 1 - config.loss.cliprange, 1 + config.loss.cliprange)))
    vclip = mb["v"] + jnp.clip(values - mb["v"], -config.loss.cliprange_value, config.loss.cliprange_value)
    vf = 0.5 * agg(jnp.maximum((values - mb["ret"]) ** 2, (vclip - mb["ret"]) ** 2))
    ent = agg(-jnp.sum(jnp.exp(logp_all) * logp_all, -1))
    return pg + config.loss.vf_coef * vf - config.loss.ent_coef * ent


def _reference_train_step(model, rollout, key, config, tx):
    apply_fn, params = model
    adv, ret = _ref_advantages(rollout, config)
    data = dict(
        qt=rollout.query_tokens, qm=rollout.query_mask, rt=rollout.response_tokens, rm=rollout.response_mask,
        lp=rollout.logprobs, v=rollout.values, adv=adv, ret=ret,
    )
    opt_state = tx.init(params)
    keys = jax.random.split(key, config.batch.ppo_epochs)
    losses = []
    ref_grad = jax.jit(jax.value_and_grad(lambda p, mb: _ref_loss(p, apply_fn, mb, config)))
    for e in range(config.batch.ppo_epochs):
        perm = np.asarray(jax.random.permutation(keys[e], config.batch.batch_size))
        for m in range(config.batch.num_minibatches):
            rows = perm[m * config.batch.mini_batch_size : (m + 1) * config.batch.mini_batch_size]
            mb = {k: v[rows] for k, v in data.items()}
            loss, grads = ref_grad(params, mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
    return params, np.array(losses)


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "config",
    [
        Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2),
        Config.from_settings(batch_size=16, mini_batch_size=4, ppo_epochs=1, gradient_accumulation_steps=2, whiten_rewards=True),
        Config.from_settings(batch_size=12, mini_batch_size=12, ppo_epochs=3, gradient_accumulation_steps=3, whiten_advantages=False),
    ],
    ids=["plain", "accumulate2", "accumulate3"],
)
def test_update_count_and_metric_shapes(model, config):
    state = _state(model)
    rollout = make_rollout(config.batch.batch_size)
    state, metrics = train_step(state, rollout, jax.random.key(1), config)
    assert int(state.step) == config.batch.ppo_epochs * config.batch.batch_size // config.batch.mini_batch_size
    assert int(metrics["ppo/updates_applied"]) == int(state.step) == int(metrics["ppo/updates_planned"])
    per_mb = {k: v for k, v in metrics.items() if k.startswith("per_minibatch/")}
    chex.assert_tree_shape_prefix(per_mb, (config.batch.ppo_epochs, config.batch.num_minibatches))
    for name in ["policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                 "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var"]:
        assert metrics[name].shape == () and bool(jnp.isfinite(metrics[name])), name
    state, _ = train_step(state, make_rollout(config.batch.batch_size, seed=1), jax.random.key(2), config)
    assert int(state.step) == 2 * config.batch.updates_per_step


@pytest.mark.parametrize(
    "config",
    [
        Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, ent_coef=0.01, temperature=0.7),
        Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, gamma=0.9, whiten_rewards=True, whiten_advantages=False),
        # PPO's value loss (and entropy) under the per-completion aggregations.
        Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, ent_coef=0.01, loss_aggregation="seq_mean_token_mean"),
        Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, vf_coef=0.5, loss_aggregation="seq_mean_token_sum_norm"),
    ],
    ids=["whiten-adv", "whiten-rewards", "seq-mean-token-mean", "seq-mean-token-sum-norm"],
)
def test_train_step_equals_reference_python_loop(model, config):
    tx = optax.adam(3e-3)
    rollout = make_rollout(config.batch.batch_size, seed=3)
    key = jax.random.key(4)
    state, metrics = train_step(_state(model, tx), rollout, key, config)
    ref_params, ref_losses = _reference_train_step(model, rollout, key, config, tx)
    chex.assert_trees_all_close(state.params, ref_params, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(metrics["per_minibatch/loss/total"]).ravel(), ref_losses, rtol=1e-4, atol=1e-5)


def test_advantages_match_reference(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=4, gamma=0.95, lam=0.9, whiten_rewards=True)
    rollout = make_rollout(8, seed=5)
    adv, ret = jaxppo.update.compute_advantages(rollout, config)
    ref_adv, ref_ret = _ref_advantages(rollout, config)
    np.testing.assert_allclose(np.asarray(adv), np.asarray(ref_adv), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), np.asarray(ref_ret), rtol=1e-4, atol=1e-5)


def test_token_weighted_accumulation_equals_whole_minibatch(model):
    # Rows have different response lengths, so micro-batches hold different token counts.
    rollout = make_rollout(16, seed=6)
    base = Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2)
    s1, m1 = train_step(_state(model), rollout, jax.random.key(7), base)
    s4, m4 = train_step(_state(model), rollout, jax.random.key(7), base.replace(gradient_accumulation_steps=4))
    assert int(s1.step) == int(s4.step) == 4
    chex.assert_trees_all_close(s1.params, s4.params, rtol=2e-4, atol=2e-6)
    np.testing.assert_allclose(np.asarray(m1["per_minibatch/loss/total"]), np.asarray(m4["per_minibatch/loss/total"]), rtol=1e-5, atol=1e-6)


def test_same_key_bit_identical(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=2, ppo_epochs=2)
    rollout = make_rollout(8, seed=8)
    a = train_step(_state(model), rollout, jax.random.key(9), config)
    b = train_step(_state(model), rollout, jax.random.key(9), config)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_no_retrace(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1, cliprange=0.15)
    traces = []
    apply_fn, params = model

    def counting_apply(p, tokens, mask):
        traces.append(1)
        return apply_fn(p, tokens, mask)

    state = TrainState.create(apply_fn=counting_apply, params=params, tx=optax.sgd(1e-3))
    before = train_step._cache_size()
    state, _ = train_step(state, make_rollout(8), jax.random.key(0), config)
    n = len(traces)
    for i in range(3):
        state, _ = train_step(state, make_rollout(8, seed=i + 1), jax.random.key(i + 1), config)
    assert len(traces) == n
    assert train_step._cache_size() == before + 1
    assert int(state.step) == 4 * config.batch.updates_per_step


def test_target_kl_early_stop_counts_only_applied(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=2, ppo_epochs=4, target_kl=1e-3)
    state, metrics = train_step(_state(model, optax.adam(3e-2)), on_policy(model, make_rollout(8, seed=10)), jax.random.key(1), config)
    applied = int(metrics["ppo/updates_applied"])
    assert int(state.step) == applied == int(np.asarray(metrics["per_minibatch/applied"]).sum())
    assert 0 < applied < config.batch.updates_per_step
    assert bool(metrics["ppo/early_stopped"])
    flat = np.asarray(metrics["per_minibatch/applied"]).ravel()
    assert flat[:applied].all() and not flat[applied:].any(), "updates stop for good once the KL target is hit"
    kl = np.asarray(metrics["per_minibatch/policy/approxkl"]).ravel()
    assert kl[applied] > config.batch.target_kl and (kl[:applied] <= config.batch.target_kl).all()


def test_nonfinite_row_skips_its_minibatches_without_corrupting_params(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=2, ppo_epochs=2)
    rollout = on_policy(model, make_rollout(8, seed=11))
    rollout = rollout.replace(logprobs=rollout.logprobs.at[3, 0].set(jnp.nan))
    state, metrics = train_step(_state(model), rollout, jax.random.key(2), config)
    assert int(metrics["ppo/updates_nonfinite"]) == 2  # the row's mini-batch, once per epoch
    assert int(state.step) == config.batch.updates_per_step - 2
    assert int(state.skipped_nonfinite) == 2
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((state.params, state.opt_state)))
    assert np.isfinite(float(metrics["loss/total_avg"]))


def test_bad_rollouts_are_rejected(model):
    config = Config.from_settings(batch_size=8, mini_batch_size=4)
    with pytest.raises(ValueError, match="batch_size=8"):
        train_step(_state(model), make_rollout(6), jax.random.key(0), config)
    rollout = make_rollout(8)
    with pytest.raises(ValueError, match="rollout.values"):
        train_step(_state(model), rollout.replace(values=rollout.values[:, :-1]), jax.random.key(0), config)
    with pytest.raises(TypeError, match="RolloutBatch"):
        train_step(_state(model), {"a": 1}, jax.random.key(0), config)


def test_rollout_is_the_deprecated_name_of_rollout_batch():
    """0.5 renamed `Rollout` to `RolloutBatch`: the old name, wherever it was exported, is
    the same class with a DeprecationWarning naming the new one; other names still fail."""
    import importlib

    for module in ("jaxppo", "jaxppo.update", "jaxppo.update.batch", "jaxppo.update.ppo"):
        mod = importlib.import_module(module)
        with pytest.warns(DeprecationWarning, match=rf"{module}\.Rollout is deprecated.*{module}\.RolloutBatch"):
            assert mod.Rollout is jaxppo.RolloutBatch
        with pytest.raises(AttributeError, match="no attribute 'Rolout'"):
            getattr(mod, "Rolout")
