"""The sampler-mismatch correction (`jaxppo.update.correction`) against numpy, and through
`train_step` and the trainer: weights 1 change nothing, a perturbed sampler shows a
mismatch and its weights equal the numpy reference, the float32 built-in sampler matches
the trainer within rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.run import iteration
from jaxppo.testing.toy import make_toy
from jaxppo.update import correction

Q, R, V = 4, 6, 32


def numpy_weights(old, sampler, mask, mode, cap):
    """The correction written out row by row, token by token."""
    out = np.zeros_like(old, dtype=np.float64)
    for i in range(old.shape[0]):
        n = int(mask[i].sum())
        seq = np.exp(sum(float(old[i, t]) - float(sampler[i, t]) for t in range(n)))
        for t in range(n):
            r = np.exp(float(old[i, t]) - float(sampler[i, t])) if mode.startswith("token") else seq
            if mode == "none":
                out[i, t] = 1.0
            elif mode.endswith("truncate"):
                out[i, t] = min(r, cap)
            else:
                out[i, t] = 1.0 if 1.0 / cap <= r <= cap else 0.0
    return out


def random_logprobs(seed=0, b=8, spread=0.8):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 4.0, size=(b, R)).astype(np.float32)
    sampler = (old + rng.normal(scale=spread, size=(b, R))).astype(np.float32)
    mask = (np.arange(R)[None] < rng.integers(1, R + 1, size=(b, 1))).astype(np.int32)
    return old, sampler, mask


@pytest.mark.parametrize("mode", correction.ROLLOUT_CORRECTIONS)
def test_weights_equal_numpy(mode):
    old, sampler, mask = random_logprobs(spread=0.3)
    got = np.asarray(correction.correction_weights(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask), mode,
                                                   cap=1.5))
    want = numpy_weights(old, sampler, mask, mode, 1.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if mode != "none":
        assert (want[mask > 0] != 1.0).any()  # the perturbation is large enough for the correction to act


def test_mismatch_metrics_equal_numpy():
    old, sampler, mask = random_logprobs(seed=1)
    m = correction.mismatch_metrics(jnp.asarray(old), jnp.asarray(sampler), jnp.asarray(mask))
    real = mask > 0
    diff = np.abs(old - sampler)[real]
    ratio = np.exp((old - sampler)[real].astype(np.float64))
    np.testing.assert_allclose(float(m["sampling/sampling_logp_difference/mean"]), diff.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["sampling/sampling_logp_difference/max"]), diff.max(), rtol=1e-6)
    np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/min"]), ratio.min(), rtol=1e-5)
    np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/mean"]), ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(m["sampling/importance_sampling_ratio/max"]), ratio.max(), rtol=1e-5)


def test_unit_weights_leave_the_loss_unchanged():
    rng = np.random.default_rng(2)
    log_ratio = jnp.asarray(rng.normal(scale=0.2, size=(8, R)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=(8,)), jnp.float32)
    _, _, mask = random_logprobs(seed=2)
    for agg in jaxppo.update.losses.LOSS_AGGREGATIONS:
        plain = jaxppo.update.losses.clipped_policy_loss(log_ratio, adv, jnp.asarray(mask), 0.2, 0.28, 3.0, agg, R)[0]
        ones = jaxppo.update.losses.clipped_policy_loss(log_ratio, adv, jnp.asarray(mask), 0.2, 0.28, 3.0, agg, R,
                                               weights=jnp.ones((8, R)))[0]
        assert float(plain) == float(ones), agg


@pytest.fixture(scope="module")
def toy():
    return make_toy(jax.random.key(0), vocab_size=V, width=16, depth=1, heads=2, max_len=Q + R, seq_len=Q + R)


def _rollout(toy, sampler_shift):
    """An on-policy rollout (old log-probs = the model's), with sampler log-probs shifted."""
    apply_fn, params = toy
    rng = np.random.default_rng(3)
    b = 8
    mask = jnp.asarray(np.arange(R)[None] < rng.integers(1, R + 1, size=(b, 1)), jnp.int32)
    batch = dict(query_tokens=jnp.asarray(rng.integers(0, V, (b, Q)), jnp.int32), query_mask=jnp.ones((b, Q), jnp.int32),
                 response_tokens=jnp.asarray(rng.integers(0, V, (b, R)), jnp.int32), response_mask=mask)
    logprobs = jaxppo.update.response_outputs(apply_fn, params, batch, 1.0)[0]
    shift = jnp.asarray(rng.normal(scale=sampler_shift, size=(b, R)), jnp.float32)
    scores = jnp.asarray(rng.normal(size=b), jnp.float32)
    return jaxppo.RolloutBatch(**batch, logprobs=logprobs, values=None, rewards=jnp.zeros((b, R)),
                               scores=scores, sampler_logprobs=logprobs + shift)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_train_step_weights_the_policy_loss(toy, mode):
    """With a perturbed sampler, train_step equals one written with the numpy weights put in
    by hand (the same loss with `weights`), and differs from no correction."""
    apply_fn, params = toy
    rollout = _rollout(toy, 0.3)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                            kl_loss_coef=0.0, rollout_correction=mode, rollout_correction_cap=1.5)
    tx = optax.sgd(0.5)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)
    corrected, metrics = jaxppo.train_step(state, rollout, jax.random.key(1), config)
    plain, _ = jaxppo.train_step(state, rollout, jax.random.key(1), config.replace(rollout_correction="none"))
    # By hand: the loss with the numpy weights, one full-batch SGD step.
    w = jnp.asarray(numpy_weights(np.asarray(rollout.logprobs), np.asarray(rollout.sampler_logprobs),
                                  np.asarray(rollout.response_mask), mode, 1.5), jnp.float32)
    adv, _ = jaxppo.update.compute_advantages(rollout, config)

    def loss(p):
        batch = dict(query_tokens=rollout.query_tokens, query_mask=rollout.query_mask,
                     response_tokens=rollout.response_tokens, response_mask=rollout.response_mask)
        lp = jaxppo.update.response_outputs(apply_fn, p, batch, 1.0)[0]
        return jaxppo.update.losses.clipped_policy_loss(lp - rollout.logprobs, adv, rollout.response_mask, 0.2, 0.2,
                                               aggregation="seq_mean_token_mean", max_length=R, weights=w)[0]

    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.grad(loss)(params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), corrected.params, expected)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-7)), corrected.params,
                                                plain.params)))
    assert float(metrics["sampling/sampling_logp_difference/max"]) > 0.1


def test_built_in_float32_sampler_matches_the_trainer_within_rounding(tmp_path):
    """Through the trainer (its rollouts carry the sampler's log-probs): the float32
    sampler's log-probs equal the forward pass's within rounding, so the ratios are 1 within
    a few ulps; a sampler at another temperature than the scoring shows a clear mismatch."""
    tokenizer = demo.demo_tokenizer()
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4)
    # The forward pass recomputes the log-probs here (the default takes the sampler's own).
    tc = dict(iterations=1, query_length=32, response_length=6, output_dir=str(tmp_path),
              progress=False, sample_every=0, export_final=False, plot=False, report_to="jsonl",
              old_logprobs="recompute")
    trainer = jaxppo.Trainer(config.replace(**tc), policy=demo.demo_policy(tokenizer, width=32, layers=1, max_len=38),
                             tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
    row = trainer.step()
    assert row["sampling/sampling_logp_difference/max"] < 1e-5
    assert 1 - 1e-5 < row["sampling/importance_sampling_ratio/min"] <= row["sampling/importance_sampling_ratio/max"] < 1 + 1e-5
    # A perturbed sampler: sampling at temperature 1.5, scoring at 1.0.
    run = trainer.run
    batch = iteration.select_prompts(trainer.parts.table, run.key, 0, config)
    hot = RolloutSpec(**{**trainer.parts.spec.__dict__, "temperature": 1.5})
    gen = iteration.sample(hot, run.train.params, batch, jax.random.key(9))
    built = iteration.build(trainer.parts.spec, run.train.params, trainer.parts.ref_params, None, batch, gen,
                                 iteration.reward(trainer.parts.host_rewards, tokenizer, trainer.parts.table, batch, gen, 0), run)
    r = built.rollout
    _, metrics = jaxppo.train_step(run.train, r, jax.random.key(1), config)
    assert float(metrics["sampling/sampling_logp_difference/mean"]) > 0.05
    w = correction.correction_weights(r.logprobs, r.sampler_logprobs, r.response_mask, "token_truncate", 2.0)
    np.testing.assert_allclose(np.asarray(w), numpy_weights(np.asarray(r.logprobs), np.asarray(r.sampler_logprobs),
                                                            np.asarray(r.response_mask), "token_truncate", 2.0),
                               rtol=1e-5, atol=1e-6)


def test_vespo_folds_the_correction_into_each_completions_weight(toy):
    """VESPO adds the log of each token's correction weight to its completion's importance
    weight instead of multiplying the token's loss: a train_step with the sampler's
    log-probs equals one without them whose old log-probs are lowered by the log-weights
    (the same completion weights), and differs from no correction."""
    apply_fn, params = toy
    rollout = _rollout(toy, 0.3)
    config = jaxppo.Config.for_algorithm("vespo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                         rollout_correction="token_truncate", rollout_correction_cap=1.5)
    weights = correction.correction_weights(rollout.logprobs, rollout.sampler_logprobs, rollout.response_mask,
                                            "token_truncate", 1.5)
    folded = rollout.replace(logprobs=rollout.logprobs - jnp.log(weights) * rollout.response_mask,
                             sampler_logprobs=None)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
    key = jax.random.key(1)
    corrected, _ = jaxppo.train_step(state, rollout, key, config)
    by_hand, _ = jaxppo.train_step(state, folded, key, config)
    plain, _ = jaxppo.train_step(state, rollout.replace(sampler_logprobs=None), key, config)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), corrected.params,
                 by_hand.params)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-7)), corrected.params,
                                                plain.params)))
