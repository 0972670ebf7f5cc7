"""The PPO math against straightforward reference loops written here in plain numpy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.update.advantages import gae, gae_time_major
from jaxppo.update.losses import approx_kl, entropy_from_logits, logprobs_from_logits, policy_loss, value_loss
from jaxppo.update.stats import masked_mean, masked_var, masked_whiten


def _rng(seed=0):
    return np.random.default_rng(seed)


def _prefix_mask(rng, b, t):
    lengths = rng.integers(1, t + 1, size=b)
    return (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)


def _ref_masked_stats(x, mask):
    vals = [float(v) for v, m in zip(x.ravel(), mask.ravel()) if m]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / n
    return mean, var, var * n / (n - 1)


def test_masked_mean_var_whiten_match_reference():
    rng = _rng(1)
    x = rng.normal(size=(5, 7)).astype(np.float32) * 3 + 1
    mask = _prefix_mask(rng, 5, 7)
    mean, var_biased, var_unbiased = _ref_masked_stats(x, mask)
    assert float(masked_mean(jnp.asarray(x), jnp.asarray(mask))) == pytest.approx(mean, rel=1e-5)
    assert float(masked_var(jnp.asarray(x), jnp.asarray(mask))) == pytest.approx(var_unbiased, rel=1e-5)
    assert float(masked_var(jnp.asarray(x), jnp.asarray(mask), unbiased=False)) == pytest.approx(var_biased, rel=1e-5)

    white = np.asarray(masked_whiten(jnp.asarray(x), jnp.asarray(mask)))
    for i in range(5):
        for j in range(7):
            expected = (x[i, j] - mean) / math.sqrt(var_unbiased + 1e-8) if mask[i, j] else 0.0
            assert white[i, j] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    scaled = np.asarray(masked_whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean=False))
    for i in range(5):
        for j in range(7):
            expected = (x[i, j] - mean) / math.sqrt(var_unbiased + 1e-8) + mean if mask[i, j] else 0.0
            assert scaled[i, j] == pytest.approx(expected, rel=1e-4, abs=1e-5)


def test_masked_mean_of_empty_mask_is_zero_not_nan():
    assert float(masked_mean(jnp.ones((2, 3)), jnp.zeros((2, 3)))) == 0.0


def _ref_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros((b, t))
    for i in range(b):
        n = int(mask[i].sum())  # real tokens form a prefix
        last = 0.0
        for s in reversed(range(n)):
            next_value = values[i, s + 1] if s + 1 < n else 0.0
            delta = rewards[i, s] + gamma * next_value - values[i, s]
            last = delta + gamma * lam * last
            adv[i, s] = last
    ret = (adv + values) * mask
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0), (0.0, 0.5)])
def test_gae_matches_reference_loop(gamma, lam):
    rng = _rng(2)
    rewards = rng.normal(size=(6, 9)).astype(np.float32)
    values = rng.normal(size=(6, 9)).astype(np.float32)
    mask = _prefix_mask(rng, 6, 9)
    # Garbage beyond the mask must not leak into the result.
    rewards_dirty = np.where(mask > 0, rewards, 1e3).astype(np.float32)
    values_dirty = np.where(mask > 0, values, -1e3).astype(np.float32)
    adv, ret = gae(jnp.asarray(rewards_dirty), jnp.asarray(values_dirty), jnp.asarray(mask), gamma, lam)
    ref_adv, ref_ret = _ref_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-5, atol=1e-5)


def test_logprobs_and_entropy_with_temperature():
    rng = _rng(3)
    logits = rng.normal(size=(2, 3, 5)).astype(np.float32) * 2
    tokens = rng.integers(0, 5, size=(2, 3))
    temp = 0.7
    lp = np.asarray(logprobs_from_logits(jnp.asarray(logits), jnp.asarray(tokens), temp))
    ent = np.asarray(entropy_from_logits(jnp.asarray(logits), temp))
    for i in range(2):
        for j in range(3):
            z = [v / temp for v in logits[i, j]]
            norm = math.log(sum(math.exp(v) for v in z))
            probs = [math.exp(v - norm) for v in z]
            assert lp[i, j] == pytest.approx(z[tokens[i, j]] - norm, abs=1e-5)
            assert ent[i, j] == pytest.approx(-sum(p * math.log(p) for p in probs), abs=1e-5)


def test_policy_loss_hand_computed():
    # Three tokens, the third masked out. cliprange 0.2.
    logprobs = jnp.array([[math.log(1.5), math.log(0.5), 5.0]])
    old = jnp.zeros((1, 3))
    adv = jnp.array([[2.0, -1.0, 100.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss, clipfrac = policy_loss(logprobs, old, adv, mask, 0.2)
    # token 0: ratio 1.5, A=2: unclipped -3.0, clipped -2.4 -> max -2.4 (clipped)
    # token 1: ratio 0.5, A=-1: unclipped 0.5, clipped 0.8 -> max 0.8 (clipped)
    assert float(loss) == pytest.approx((-2.4 + 0.8) / 2, abs=1e-6)
    assert float(clipfrac) == pytest.approx(1.0)
    loss, clipfrac = policy_loss(jnp.array([[math.log(1.1), math.log(0.5)]]), jnp.zeros((1, 2)), jnp.array([[2.0, 1.0]]), jnp.ones((1, 2)), 0.2)
    # token 0 inside the range: -2.2; token 1: ratio 0.5, A=1: unclipped -0.5, clipped -0.8 -> -0.5
    assert float(loss) == pytest.approx((-2.2 - 0.5) / 2, abs=1e-6)
    assert float(clipfrac) == 0.0


def test_value_loss_hand_computed():
    values = jnp.array([[1.0, 0.0, 9.0]])
    old = jnp.array([[0.0, 0.0, 0.0]])
    returns = jnp.array([[0.5, 2.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    loss, clipfrac = value_loss(values, old, returns, mask, 0.2)
    # token 0: v=1 -> err 0.25; clipped v=0.2 -> err 0.09; max 0.25 (unclipped)
    # token 1: v=0 -> err 4; clipped v=0 -> err 4; max 4 (not clipped)
    assert float(loss) == pytest.approx(0.5 * (0.25 + 4.0) / 2, abs=1e-6)
    assert float(clipfrac) == 0.0
    loss, clipfrac = value_loss(jnp.array([[1.0]]), jnp.array([[0.0]]), jnp.array([[2.0]]), jnp.ones((1, 1)), 0.2)
    # v=1 -> err 1; clipped v=0.2 -> err 3.24 -> 3.24, clipped
    assert float(loss) == pytest.approx(0.5 * 3.24, abs=1e-6)
    assert float(clipfrac) == 1.0


def test_approx_kl():
    lp = jnp.array([[0.1, -0.3, 7.0]])
    old = jnp.array([[0.0, 0.0, 0.0]])
    mask = jnp.array([[1, 1, 0]])
    assert float(approx_kl(lp, old, mask)) == pytest.approx(0.5 * (0.01 + 0.09) / 2, abs=1e-7)


def _gae_loop(rewards, values, dones, last_value, gamma, lam, truncations=None, final_values=None):
    """Time-major GAE, one environment and one step at a time, last step first."""
    t_len, n = rewards.shape
    adv = np.zeros((t_len, n))
    for i in range(n):
        running = 0.0
        for t in reversed(range(t_len)):
            next_v = last_value[i] if t == t_len - 1 else values[t + 1, i]
            cont = 0.0 if dones[t, i] else 1.0
            if truncations is not None and truncations[t, i]:
                delta = 0.0 if final_values is None else rewards[t, i] + gamma * final_values[t, i] - values[t, i]
            else:
                delta = rewards[t, i] + gamma * cont * next_v - values[t, i]
            running = delta + gamma * lam * cont * running
            adv[t, i] = running
    return adv, adv + values


@pytest.mark.parametrize("mode", ["terminations", "truncations-dropped", "truncations-bootstrapped"])
def test_gae_time_major_equals_a_loop(mode):
    """Vectorised environments that reset themselves (PureJaxRL's layout; Brax's truncation
    convention, or a bootstrap from the final state's value)."""
    rng = np.random.default_rng(0)
    t_len, n = 12, 5
    rewards, values = rng.normal(size=(t_len, n)), rng.normal(size=(t_len, n))
    dones = rng.random((t_len, n)) < 0.2
    last_value = rng.normal(size=n)
    truncations = final_values = None
    if mode != "terminations":
        truncations = dones & (rng.random((t_len, n)) < 0.5)
        assert truncations.any() and (dones & ~truncations).any()
    if mode == "truncations-bootstrapped":
        final_values = rng.normal(size=(t_len, n))
    want = _gae_loop(rewards, values, dones, last_value, 0.97, 0.9, truncations, final_values)
    as_jnp = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    got = jax.jit(lambda *a: gae_time_major(*a[:4], 0.97, 0.9, truncations=a[4], final_values=a[5]))(
        *map(as_jnp, (rewards, values, dones, last_value, truncations, final_values)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5)
    if mode == "terminations":  # no dones at all: the response-token GAE over a full mask, transposed
        no_dones = np.zeros_like(dones)
        full = gae(jnp.asarray(rewards.T), jnp.asarray(np.concatenate([values, last_value[None]]).T[:, :t_len]),
                      jnp.ones((n, t_len)), 0.97, 0.9)
        loop = _gae_loop(rewards, values, no_dones, np.zeros(n), 0.97, 0.9)
        np.testing.assert_allclose(np.asarray(full[0]).T, loop[0], rtol=1e-5, atol=1e-5)
