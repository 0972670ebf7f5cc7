"""DAPO's overlong handling and the high-entropy token selection (`jaxppo.update.shaping`)
against plain loops and numpy, through `train_step`, the rollout layer and the trainer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
from jaxppo.update.kl import fixed_kl_controller
from jaxppo.update.losses import clipped_policy_loss
from jaxppo.update.shaping import adaptive_entropy_coef, high_entropy_mask, overlong_penalty
from jaxppo.update.stats import RunningMoments, masked_quantile
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.testing.toy import make_toy

Q, R, V = 4, 8, 32


def dapo_penalty(length, budget, buffer, factor):
    """DAPO's equation 13, case by case."""
    if length <= budget - buffer:
        return 0.0
    if length <= budget:
        return ((budget - buffer) - length) / buffer * factor
    return -factor


@pytest.mark.parametrize("buffer,factor", [(4, 1.0), (1, 0.5), (16, 2.0)])
def test_overlong_penalty_equals_the_paper_case_by_case(buffer, factor):
    lengths = np.arange(0, 20)
    got = np.asarray(overlong_penalty(jnp.asarray(lengths), 16, buffer, factor))
    want = [dapo_penalty(int(n), 16, buffer, factor) for n in lengths]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert got[16] == -factor and got[16 - buffer] == 0.0


def test_masked_quantile_and_high_entropy_mask_equal_numpy():
    rng = np.random.default_rng(0)
    x = rng.gamma(2.0, size=(6, R)).astype(np.float32)
    x[0, 1] = x[2, 3]  # a tie
    mask = (np.arange(R)[None] < rng.integers(1, R + 1, size=(6, 1))).astype(np.int32)
    x_masked_out = np.where(mask > 0, x, 1e6).astype(np.float32)  # values outside the mask must not count
    for q in (0.0, 0.2, 0.5, 0.8, 1.0):
        want = np.quantile(x[mask > 0].astype(np.float64), q)
        assert float(masked_quantile(jnp.asarray(x_masked_out), jnp.asarray(mask), q)) == pytest.approx(want, rel=1e-6)
    for top in (0.2, 0.5, 1.0):
        threshold = np.quantile(x[mask > 0].astype(np.float64), 1 - top)
        want = ((x >= np.float32(threshold)) & (mask > 0)).astype(np.float32)
        got = np.asarray(high_entropy_mask(jnp.asarray(x_masked_out), jnp.asarray(mask), top))
        np.testing.assert_array_equal(got, want)
    assert float(masked_quantile(jnp.asarray(x), jnp.zeros_like(jnp.asarray(mask)), 0.5)) == 0.0


@pytest.fixture(scope="module")
def toy():
    return make_toy(jax.random.key(0), vocab_size=V, width=16, depth=1, heads=2, max_len=Q + R, seq_len=Q + R)


def _rollout(toy, b=8):
    apply_fn, params = toy
    rng = np.random.default_rng(3)
    mask = jnp.asarray(np.arange(R)[None] < rng.integers(2, R + 1, size=(b, 1)), jnp.int32)
    batch = dict(query_tokens=jnp.asarray(rng.integers(0, V, (b, Q)), jnp.int32), query_mask=jnp.ones((b, Q), jnp.int32),
                 response_tokens=jnp.asarray(rng.integers(0, V, (b, R)), jnp.int32), response_mask=mask)
    logprobs = jaxppo.update.response_outputs(apply_fn, params, batch, 1.0)[0]
    return jaxppo.RolloutBatch(**batch, logprobs=logprobs, values=None, rewards=jnp.zeros((b, R)),
                               scores=jnp.asarray(rng.normal(size=b), jnp.float32))


def numpy_entropies(apply_fn, params, rollout):
    """Per-token entropies of the response positions, from the full logits in numpy."""
    tokens = np.concatenate([rollout.query_tokens, rollout.response_tokens], 1)
    mask = np.concatenate([rollout.query_mask, rollout.response_mask], 1)
    logits = np.asarray(apply_fn(params, jnp.asarray(tokens), jnp.asarray(mask))[0], np.float64)[:, Q - 1:Q - 1 + R]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    return -(np.exp(logp) * logp).sum(-1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_top_entropy_quantile_trains_the_policy_term_on_the_selected_tokens(toy, aggregation):
    """One full-batch SGD step with q = 0.25 equals the step written by hand with the numpy
    selection of the highest-entropy quarter as weights, and differs from q = 1."""
    apply_fn, params = toy
    rollout = _rollout(toy)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                            kl_loss_coef=0.0, loss_aggregation=aggregation, top_entropy_quantile=0.25)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
    selected_step, metrics = jaxppo.train_step(state, rollout, jax.random.key(1), config)
    every_step, _ = jaxppo.train_step(state, rollout, jax.random.key(1), config.replace(top_entropy_quantile=1.0))

    m = np.asarray(rollout.response_mask) > 0
    entropy = numpy_entropies(apply_fn, params, rollout)
    keep = (entropy >= np.quantile(entropy[m], 0.75)) & m
    assert 0.2 < keep.sum() / m.sum() < 0.35
    assert float(metrics["policy/entropy_mask_fraction"]) == pytest.approx(keep.sum() / m.sum())
    adv, _ = jaxppo.update.compute_advantages(rollout, config)

    def loss(p):
        batch = dict(query_tokens=rollout.query_tokens, query_mask=rollout.query_mask,
                     response_tokens=rollout.response_tokens, response_mask=rollout.response_mask)
        lp = jaxppo.update.response_outputs(apply_fn, p, batch, 1.0)[0]
        return clipped_policy_loss(lp - rollout.logprobs, adv, rollout.response_mask, 0.2, 0.2,
                                      aggregation=aggregation, max_length=R,
                                      weights=jnp.asarray(keep, jnp.float32))[0]

    expected = jax.tree.map(lambda p, g: p - 0.5 * g, params, jax.grad(loss)(params))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), selected_step.params, expected)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-7)),
                                                selected_step.params, every_step.params)))


@pytest.fixture(scope="module")
def tiny_policy():
    import jaxppo.models as jm

    config = jm.ModelConfig(model_type="gpt2", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=2, intermediate_size=32, max_position_embeddings=32, eos_token_ids=(2,),
                            pad_token_id=0)
    model = jm.Model(config)
    return model, model.init(jax.random.key(0))


def test_rollout_layer_punishes_overlong_and_masks_truncated(tiny_policy):
    """Scores = host scores + the paper's penalty of each completion's length; completions
    without a stop token get a zero response mask (and only they); the statistics count them."""
    model, params = tiny_policy
    spec = RolloutSpec(policy=model, apply_fn=model.apply, ref_apply=None, response_length=R, stop_token_ids=(2,),
                       uses_critic=False, overlong_penalty_factor=0.7, overlong_buffer=3, mask_truncated=True)
    rng = np.random.default_rng(4)
    ids = jnp.asarray(rng.integers(3, V, size=(16, Q)))
    mask = jnp.ones_like(ids)
    gen = sample_responses(spec, params, ids, mask, jax.random.key(5))
    host = jnp.asarray(rng.normal(size=16), jnp.float32)
    rollout, stats, _ = finish_rollout(spec, params, None, None, (ids, mask), gen, host,
                                       Shaping(fixed_kl_controller(0.0), RunningMoments.zeros()))
    toks, m = np.asarray(gen.tokens), np.asarray(gen.mask)
    lengths = m.sum(1)
    stopped = np.array([(toks[i, :lengths[i]] == 2).any() for i in range(16)])
    assert stopped.any() and (~stopped).any(), lengths
    want = np.asarray(host) + [dapo_penalty(int(n), R, 3, 0.7) for n in lengths]
    np.testing.assert_allclose(np.asarray(rollout.scores), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(rollout.response_mask), m * stopped[:, None])
    assert int(stats["val/num_truncated_masked"]) == int((~stopped).sum())
    assert float(stats["objective/overlong_penalty"]) == pytest.approx(np.mean(want - np.asarray(host)), abs=1e-6)
    assert float(stats["val/response_length"]) == pytest.approx(lengths.mean())


def test_bad_settings_are_refused_with_the_field_and_valid_range(tiny_policy):
    for field, value, words in [("top_entropy_quantile", 0.0, "(0, 1]"), ("top_entropy_quantile", 1.5, "(0, 1]"),
                                ("overlong_penalty_factor", -1.0, ">= 0"), ("mask_truncated_completions", 1, "bool")]:
        owner = "LossConfig" if field == "top_entropy_quantile" else "RewardConfig"
        with pytest.raises(ValueError, match=rf"{owner}\.{field}=.*{words}".replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[").replace("]", r"\]")):
            jaxppo.Config.from_settings(**{field: value})
    with pytest.raises(ValueError, match=r"overlong_buffer=0 .*positive int"):
        jaxppo.Config.from_settings(overlong_penalty_factor=1.0, overlong_buffer=0)
    with pytest.raises(ValueError, match=r"overlong_buffer=8 .*overlong_penalty_factor is 0"):
        jaxppo.Config.from_settings(overlong_buffer=8)
    model, _ = tiny_policy
    with pytest.raises(ValueError, match=r"overlong_buffer=9 is longer than the response budget \(SamplingConfig."
                                         r"response_length=8\)"):
        jaxppo.Config.from_settings(response_length=R, overlong_penalty_factor=1.0, overlong_buffer=9)
    with pytest.raises(ValueError, match="mask_truncated_completions=True needs a stop token"):
        RolloutSpec(policy=model, apply_fn=model.apply, ref_apply=None, response_length=R, mask_truncated=True)


def test_dapo_preset_through_the_trainer(tmp_path):
    """The DAPO preset masks truncated completions and punishes overlong ones; the trainer
    logs both, and a preset field the run changed is recorded so that resuming keeps it."""
    from trainer_setup import run_small

    config = jaxppo.Config.for_algorithm("dapo", batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4,
                                            top_entropy_quantile=0.5)
    assert config.rewards.mask_truncated_completions and config.rewards.overlong_penalty_factor == 1.0
    history, trainer = run_small(tmp_path, iterations=1, ppo=config, export_final=False)
    row = history[0]
    assert trainer.parts.spec.mask_truncated and trainer.parts.spec.buffer == 1  # a fifth of the 6-token budget
    assert 0 <= row["val/num_truncated_masked"] <= 16 and row["objective/overlong_penalty"] <= 0.0
    assert 0.0 < row["policy/entropy_mask_fraction"] <= 1.0
    import json

    saved = json.loads((tmp_path / "run_settings.json").read_text())
    assert saved["rewards"]["mask_truncated_completions"] is True and saved["loss"]["top_entropy_quantile"] == 0.5


def test_the_settings_are_flags():
    from jaxppo.cli import resolve

    ppo, _ = resolve(["--algorithm", "dapo", "--overlong-buffer", "4", "--top-entropy-quantile", "0.2",
                         "--no-mask-truncated-completions"])
    assert (ppo.rewards.overlong_buffer, ppo.loss.top_entropy_quantile, ppo.rewards.mask_truncated_completions,
            ppo.rewards.overlong_penalty_factor) == (4, 0.2, False, 1.0)


def test_adaptive_entropy_coef_follows_the_rule():
    coef, target, step = 0.01, 2.0, 0.004
    # up, up, down x 4 (the last one floored at 0), unchanged (no update), up, down (at the target)
    for entropy in [1.0, 1.5, 2.5, 3.0, 3.0, 3.0, 3.0, float("nan"), 1.9, 2.0]:
        want = coef if entropy != entropy else max(coef + step if entropy < target else coef - step, 0.0)
        got = float(adaptive_entropy_coef(coef, entropy, target, step))
        assert got == pytest.approx(want, abs=1e-7), (entropy, coef)
        coef = got
    assert coef == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_entropy_coef_column_equals_the_fixed_coefficient(toy, aggregation):
    """A rollout's per-completion entropy coefficients, all c, give the update of
    `ent_coef=c` (whose entropy term the reference loops test); other values differ."""
    apply_fn, params = toy
    rollout = _rollout(toy)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4,
                                            kl_loss_coef=0.0, loss_aggregation=aggregation)
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
    fixed, _ = jaxppo.train_step(state, rollout, jax.random.key(1), config.replace(ent_coef=0.3))
    column, _ = jaxppo.train_step(state, rollout.replace(entropy_coef=jnp.full((8,), 0.3)), jax.random.key(1), config)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), column.params, fixed.params)
    other, _ = jaxppo.train_step(state, rollout.replace(entropy_coef=jnp.full((8,), 0.0)), jax.random.key(1), config)
    assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-7)), other.params,
                                                column.params)))
    with pytest.raises(ValueError, match=r"rollout.entropy_coef has shape \(4,\); expected \(batch,\) = \(8,\)"):
        jaxppo.train_step(state, rollout.replace(entropy_coef=jnp.zeros((4,))), jax.random.key(1), config)


def test_adaptive_entropy_coefficient_through_the_trainer_and_resume(tmp_path):
    """The logged coefficients follow the rule from the start value and the logged
    entropies; the coefficient is run state: a resumed run equals the uninterrupted one."""
    from trainer_setup import run_small

    ppo = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1, ent_coef=0.01,
                           entropy_target=5.9, entropy_coef_step=0.004)
    straight, _ = run_small(tmp_path / "a", iterations=4, ppo=ppo, export_final=False)
    coef = 0.01
    for row in straight:
        assert row["objective/entropy_coef"] == pytest.approx(coef, abs=1e-7)
        coef = max(coef + 0.004 if row["policy/entropy_avg"] < 5.9 else coef - 0.004, 0.0)
    assert len({round(r["objective/entropy_coef"], 6) for r in straight}) > 1
    run_small(tmp_path / "b", iterations=2, ppo=ppo, export_final=False)
    resumed, _ = run_small(tmp_path / "b", iterations=4, ppo=ppo, export_final=False)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]
    for field, value in (("entropy_target", 0.0), ("entropy_coef_step", 0.0)):
        with pytest.raises(ValueError, match=rf"LossConfig\.{field}={value!r} is invalid"):
            jaxppo.Config.from_settings(**{field: value})
