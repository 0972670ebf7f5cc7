"""The continuous sampler against the static sampler: the same tokens for the same
key whatever the number of slots (sampling, greedy, top-k, left padding, stop tokens,
per-request budgets, every row stopping at once, both layer layouts), one compile per
shape, clear errors."""

import jax
import numpy as np
import pytest

from jaxppo.rollout.engines.static import generate
from jaxppo.rollout.engines.continuous import continuous_jit, generate_continuous

from trainer_setup import tiny_llama

V, N, Q, R = 24, 10, 5, 12


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def tiny(request):
    model = tiny_llama(request.param, V)
    params = model.init(jax.random.key(0))
    return model, params


def _prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, V, (N, Q))
    mask = np.ones_like(ids)
    mask[1::2, :2] = 0
    return ids * mask, mask


def _assert_same(static, engine):
    np.testing.assert_array_equal(np.asarray(engine.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(engine.mask), np.asarray(static.mask))
    # float32 rounding: the prefills and decodes run other row counts.
    np.testing.assert_allclose(np.asarray(engine.logprobs), np.asarray(static.logprobs), rtol=0, atol=4e-6)


@pytest.mark.parametrize("kwargs", [dict(), dict(greedy=True), dict(temperature=0.7, top_k=5)],
                         ids=["sample", "greedy", "top-k"])
@pytest.mark.parametrize("slots", [1, 3, N])
def test_equals_the_static_sampler(tiny, kwargs, slots):
    model, params = tiny
    ids, mask = _prompts()
    stops = (2, 3, 4)  # about one token in eight ends a row
    static = generate(model, params, ids, mask, jax.random.key(1), response_length=R, stop_token_ids=stops, **kwargs)
    engine = generate_continuous(model, params, ids, mask, jax.random.key(1), response_length=R, num_slots=slots,
                                 stop_token_ids=stops, **kwargs)
    _assert_same(static, engine)
    if not kwargs:
        lengths = np.asarray(static.mask).sum(axis=1)
        assert lengths.min() < lengths.max()  # rows end at different steps: slots were refilled


def test_per_request_budgets_and_every_row_stopping_at_once(tiny):
    model, params = tiny
    ids, mask = _prompts()
    budgets = np.array([3, 12, 5, 1, 12, 7, 2, 12, 4, 9])
    static = generate(model, params, ids, mask, jax.random.key(2), response_length=R, stop_token_ids=(),
                         max_lengths=budgets)
    engine = generate_continuous(model, params, ids, mask, jax.random.key(2), response_length=R, num_slots=3,
                                 stop_token_ids=(), max_lengths=budgets)
    _assert_same(static, engine)
    np.testing.assert_array_equal(np.asarray(engine.mask).sum(axis=1), budgets)
    # Every token a stop token: every row ends after its first token, all at once.
    every = tuple(range(V))
    static = generate(model, params, ids, mask, jax.random.key(3), response_length=R, stop_token_ids=every)
    engine = generate_continuous(model, params, ids, mask, jax.random.key(3), response_length=R, num_slots=4,
                                 stop_token_ids=every)
    _assert_same(static, engine)
    assert (np.asarray(engine.mask).sum(axis=1) == 1).all()


def test_one_compile_per_shape_and_clear_errors(tiny):
    model, params = tiny
    ids, mask = _prompts()
    generate_continuous(model, params, ids, mask, jax.random.key(0), response_length=R, num_slots=3)
    before = continuous_jit._cache_size()
    for seed in (5, 6):  # other keys, other refill orders: the same program
        generate_continuous(model, params, ids, mask, jax.random.key(seed), response_length=R, num_slots=3,
                            temperature=0.9)
    assert continuous_jit._cache_size() == before
    with pytest.raises(ValueError, match="num_slots=0 must be a positive int"):
        generate_continuous(model, params, ids, mask, jax.random.key(0), response_length=R, num_slots=0)
    with pytest.raises(ValueError, match=r"max_lengths range over \[0, 3\]"):
        generate_continuous(model, params, ids, mask, jax.random.key(0), response_length=R, num_slots=2,
                            max_lengths=np.array([0, 3] * 5))


def test_the_trainer_samples_with_the_engine(tmp_path):
    """`TrainerConfig.num_slots`: the trainer's rollouts come from the engine, and the run
    equals the static sampler's (scores exactly, losses within rounding)."""
    from trainer_setup import run_small

    static, _ = run_small(tmp_path / "static")
    engine, trainer = run_small(tmp_path / "engine", num_slots=5)
    assert trainer.parts.spec.num_slots == 5
    for a, b in zip(static, engine):
        assert a["objective/scores"] == b["objective/scores"]
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)
