"""Critic-free RL math (jaxppo.update) against plain Python loops written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.update.advantages import GRPO_SCALES, discounted_returns, group_baseline, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from jaxppo.update.kl import KL_LOSS_ESTIMATORS, kl_loss_per_token
from jaxppo.update.losses import (LOSS_AGGREGATIONS, aggregate_loss, cispo_policy_loss, clipped_policy_loss,
                                  sapo_policy_loss, sequence_log_ratio, vespo_policy_loss)

G = 4


def _scores(seed=0, groups=3):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=groups * G).astype(np.float32)
    s[G:2 * G] = 0.5  # one group with equal scores
    return s


def _ref_grpo(scores, scale, eps=1e-4):
    out = np.zeros_like(scores, dtype=np.float64)
    batch_std = np.std(scores.astype(np.float64), ddof=1)
    zero = []
    for start in range(0, len(scores), G):
        group = scores[start:start + G].astype(np.float64)
        zero.append(all(x == group[0] for x in group))
        for i in range(G):
            centred = group[i] - sum(group) / G
            if scale == "group":
                std = (sum((x - sum(group) / G) ** 2 for x in group) / (G - 1)) ** 0.5
                out[start + i] = centred / (std + eps)
            elif scale == "batch":
                out[start + i] = centred / (batch_std + eps)
            else:
                out[start + i] = centred
    return out, np.array(zero)


@pytest.mark.parametrize("scale", GRPO_SCALES)
def test_grpo_advantages_match_a_loop(scale):
    scores = _scores()
    adv, zero = grpo_advantages(scores, G, scale=scale)
    want, want_zero = _ref_grpo(scores, scale)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(zero), want_zero)
    assert want_zero.tolist() == [False, True, False]
    np.testing.assert_array_equal(np.asarray(adv)[G:2 * G], 0.0)  # equal scores: advantage 0


def test_rloo_and_group_baseline_match_loops():
    scores = _scores(1)
    rloo = np.asarray(rloo_advantages(scores, G))
    base = np.asarray(group_baseline(scores, G))
    for i, s in enumerate(scores):
        start = i - i % G
        others = [scores[j] for j in range(start, start + G) if j != i]
        assert rloo[i] == pytest.approx(s - sum(others) / (G - 1), abs=1e-6)
        assert base[i] == pytest.approx(s - sum(scores[start:start + G]) / G, abs=1e-6)


def test_reinforce_pp_returns_and_whitening_match_a_loop():
    rng = np.random.default_rng(2)
    rewards = rng.normal(size=(3, 5)).astype(np.float32)
    lengths = [5, 2, 4]
    mask = (np.arange(5)[None] < np.array(lengths)[:, None]).astype(np.float32)
    gamma = 0.9
    ret = np.zeros((3, 5))
    for b in range(3):
        for t in range(lengths[b]):
            ret[b, t] = sum(gamma ** (s - t) * rewards[b, s] for s in range(t, lengths[b]))
    np.testing.assert_allclose(np.asarray(discounted_returns(rewards, mask, gamma)), ret, rtol=1e-5, atol=1e-6)
    real = ret[mask > 0]
    white = (ret - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8) * mask
    np.testing.assert_allclose(np.asarray(reinforce_pp_advantages(rewards, mask, gamma)), white, rtol=1e-4,
                               atol=1e-5)


def _per_token_case(seed=7):
    rng = np.random.default_rng(seed)
    b, t = 4, 6
    logp = rng.normal(scale=0.3, size=(b, t)).astype(np.float32) - 2
    old = logp + rng.normal(scale=0.4, size=(b, t)).astype(np.float32) + rng.normal(scale=0.5, size=(b, 1)).astype(
        np.float32)
    adv = rng.normal(size=(b,)).astype(np.float32)
    mask = (np.arange(t)[None] < np.array([[6], [2], [4], [1]])).astype(np.float32)
    return logp, old, adv, mask


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clipped_policy_loss_matches_a_loop(aggregation, dual_clip, level):
    logp, old, adv, mask = _per_token_case()
    low, high, max_length = 0.2, 0.28, 6
    b, t = logp.shape
    per_token = np.zeros((b, t))
    lows = highs = 0
    for i in range(b):
        n = int(mask[i].sum())
        seq = sum(logp[i, s] - old[i, s] for s in range(n)) / n
        for s in range(n):
            r = np.exp(seq if level == "sequence" else logp[i, s] - old[i, s])
            a = adv[i]
            loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if dual_clip is not None and a < 0:
                loss = min(loss, -a * dual_clip)
            per_token[i, s] = loss
            lows += r < 1 - low and a < 0
            highs += r > 1 + high and a > 0
    sums = [per_token[i, : int(mask[i].sum())].sum() for i in range(b)]
    counts = [mask[i].sum() for i in range(b)]
    want = {"token_mean": sum(sums) / sum(counts),
            "seq_mean_token_mean": sum(s / c for s, c in zip(sums, counts)) / b,
            "seq_mean_token_sum": sum(sums) / b,
            "seq_mean_token_sum_norm": sum(s / max_length for s in sums) / b,
            "token_sum_batch_norm": sum(sums) / max_length}[aggregation]  # here: the token count given
    log_ratio = sequence_log_ratio(logp, old, mask) if level == "sequence" else jnp.asarray(logp - old)
    loss, metrics = clipped_policy_loss(log_ratio, jnp.asarray(adv), mask, low, high, dual_clip, aggregation,
                                           max_length)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(lows / mask.sum(), abs=1e-6)
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(highs / mask.sum(), abs=1e-6)
    assert 0 < lows + highs  # the case exercises the clip


def test_sequence_ratio_gradient_is_shared_by_the_rows_tokens():
    logp, old, _, mask = _per_token_case()
    grad = jax.grad(lambda lp: jnp.sum(sequence_log_ratio(lp, old, mask)[:, 0]))(jnp.asarray(logp))
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        np.testing.assert_allclose(np.asarray(grad[i, :n]), 1.0 / n, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(grad[i, n:]), 0.0)


def test_kl_loss_estimators_match_formulas():
    logp, ref, _, _ = _per_token_case(4)
    d = logp.astype(np.float64) - ref
    want = {"k1": d, "k2": 0.5 * d ** 2, "k3": np.exp(-d) + d - 1}
    for name in KL_LOSS_ESTIMATORS:
        np.testing.assert_allclose(np.asarray(kl_loss_per_token(logp, ref, name)), want[name], rtol=1e-4,
                                   atol=1e-6)
    assert (np.asarray(kl_loss_per_token(logp, ref, "k3")) >= 0).all()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_generations=3 must be a positive int dividing the batch of 8"):
        grpo_advantages(np.zeros(8), 3)
    with pytest.raises(ValueError, match="scale='std' is invalid; valid: group, batch, none"):
        grpo_advantages(np.zeros(8), 4, scale="std")
    with pytest.raises(ValueError, match="RLOO needs num_generations >= 2"):
        rloo_advantages(np.zeros(8), 1)
    with pytest.raises(ValueError, match="needs max_length, a positive int"):
        aggregate_loss(jnp.zeros((2, 3)), jnp.ones((2, 3)), "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss aggregation 'mean' is invalid"):
        aggregate_loss(jnp.zeros((2, 3)), jnp.ones((2, 3)), "mean")
    with pytest.raises(ValueError, match="dual_clip=0.5 must be None or a constant > 1"):
        clipped_policy_loss(jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)), 0.2, 0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="KL loss estimator 'k4' is invalid"):
        kl_loss_per_token(jnp.zeros(2), jnp.zeros(2), "k4")


def test_dual_clip_caps_negative_advantages_only():
    log_ratio = jnp.log(jnp.array([[5.0], [5.0]]))
    adv = jnp.array([-1.0, 1.0])
    loss, metrics = clipped_policy_loss(log_ratio, adv, jnp.ones((2, 1)), 0.2, 0.2, dual_clip=3.0,
                                           aggregation="seq_mean_token_mean")
    # Row 0 (A < 0): max(5, 1.2) = 5, capped at 3. Row 1 (A > 0): max(-5, -1.2) = -1.2.
    assert float(loss) == pytest.approx((3.0 - 1.2) / 2)
    assert float(metrics["dual_clip_fraction"]) == pytest.approx(0.5)
    assert float(metrics["clip_ratio/high_mean"]) == pytest.approx(0.5)


def _surrogate_loop(kind, logp, old, adv, mask, cap=1.3, temperatures=(1.0, 1.05), shape=(2.0, 3.0, 3.0, 2.0)):
    """Per-token losses and the metric of each surrogate, token by token (float64)."""
    b, t = logp.shape
    per_token, metric = np.zeros((b, t)), []
    for i in range(b):
        n = int(mask[i].sum())
        log_w = min(max(sum(min(max(logp[i, s] - old[i, s], -20.0), 20.0) for s in range(n)), np.log(1e-8)), 20.0)
        for s in range(n):
            r, a = float(np.exp(logp[i, s] - old[i, s])), float(adv[i])
            if kind == "cispo":
                per_token[i, s] = -min(r, cap) * a * logp[i, s]
                metric.append(r > cap and a > 0)
            elif kind == "sapo":
                tau = temperatures[0] if a > 0 else temperatures[1]
                gate = 1 / (1 + np.exp(-tau * (r - 1)))
                per_token[i, s] = -4 / tau * gate * a
                metric.append(4 * gate * (1 - gate))
            else:
                k, lam = shape[:2] if a >= 0 else shape[2:]
                phi = np.exp(lam + k * log_w - lam * np.exp(log_w))
                per_token[i, s] = -phi * a * logp[i, s]
                metric.append(phi)
    return per_token, float(np.mean(metric))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("kind", ["cispo", "sapo", "vespo"])
def test_surrogates_match_loops(kind, aggregation):
    logp, old, adv, mask = _per_token_case(1)
    old = old * 0.5 + logp * 0.5  # ratios in [0.5, 2] mostly: the cap, the gate and the weight all vary
    per_token, want_metric = _surrogate_loop(kind, logp.astype(np.float64), old.astype(np.float64), adv, mask)
    b = logp.shape[0]
    sums = [per_token[i].sum() for i in range(b)]
    counts = [mask[i].sum() for i in range(b)]
    want = {"token_mean": sum(sums) / sum(counts), "seq_mean_token_mean": sum(s / c for s, c in zip(sums, counts)) / b,
            "seq_mean_token_sum": sum(sums) / b}[aggregation]
    lp, lr, a = jnp.asarray(logp), jnp.asarray(logp - old), jnp.asarray(adv)
    if kind == "cispo":
        loss, metrics = cispo_policy_loss(lp, lr, a, mask, 1.3, aggregation)
        got_metric = metrics["clip_ratio/high_mean"]
    elif kind == "sapo":
        loss, metrics = sapo_policy_loss(lr, a, mask, (1.0, 1.05), aggregation)
        got_metric = metrics["sapo_gate"]
    else:
        loss, metrics = vespo_policy_loss(lp, lr, a, mask, (2.0, 3.0, 3.0, 2.0), aggregation)
        got_metric = metrics["vespo_phi"]
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(got_metric) == pytest.approx(want_metric, rel=1e-5, abs=1e-6)


def test_cispo_keeps_the_gradient_the_clip_removes():
    """A token whose ratio is past the clip with A > 0: the clipped surrogate gives it no
    gradient; CISPO gives it the capped weight times A (d/dlogp of -sg(w) A logp)."""
    logp, old, adv, mask = jnp.array([[0.0]]), jnp.array([[-1.0]]), jnp.array([2.0]), jnp.ones((1, 1))
    clip_grad = jax.grad(lambda lp: clipped_policy_loss(lp - old, adv, mask, 0.2, 0.2)[0])(logp)
    cispo_grad = jax.grad(lambda lp: cispo_policy_loss(lp, lp - old, adv, mask, 1.5)[0])(logp)
    assert float(clip_grad[0, 0]) == 0.0
    assert float(cispo_grad[0, 0]) == pytest.approx(-1.5 * 2.0)  # the cap, not the ratio e = 2.72


def test_soft_surrogates_equal_the_policy_gradient_on_policy():
    """At ratio 1 (the first update of an iteration), SAPO's gate has slope 1 and VESPO's
    weight is phi(1) = 1: both gradients equal the unclipped surrogate's, -A grad log pi."""
    logp, _, adv, mask = _per_token_case(2)
    lp, a = jnp.asarray(logp), jnp.asarray(adv)
    plain = jax.grad(lambda x: aggregate_loss(-jnp.exp(x - jax.lax.stop_gradient(x)) * a[:, None], mask,
                                              "token_mean"))(lp)
    sapo = jax.grad(lambda x: sapo_policy_loss(x - jax.lax.stop_gradient(x), a, mask, (1.0, 1.05), "token_mean")[0])(lp)
    vespo = jax.grad(lambda x: vespo_policy_loss(x, x - jax.lax.stop_gradient(x), a, mask, (2.0, 3.0, 3.0, 2.0),
                                                 "token_mean")[0])(lp)
    np.testing.assert_allclose(np.asarray(sapo), np.asarray(plain), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(vespo), np.asarray(plain), rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(plain)).max() > 1e-3
