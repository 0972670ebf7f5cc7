"""Turns without re-prefill (`jaxppo.rollout.engines.static`, `TrainerConfig.turn_cache`): each row's
KV cache kept between turns gives the tokens that prefilling the whole context again gives
(`generate` on the left-padded context, today's other path), log-probs equal up to
rounding, for every architecture, both layer layouts, hoisted layers, shared prompts, a
mesh; new tokens longer than a turn; one compile per piece width; bad input; the episodes
of the trainer with and without it."""


import jax
import numpy as np
import pytest

import jaxppo.models as jm
from jaxppo import sharding
from jaxppo.rollout.engines import static as turns
from jaxppo.rollout.engines.static import generate

from test_shared_prompts import _config
from trainer_setup import perturbed

V, Q, R, L, STOP = 64, 6, 24, 5, 2


def _prompts(rng, b, g):
    """b left-padded prompts, groups of g equal consecutive rows."""
    n = b // g
    pads = np.repeat(rng.integers(0, 3, size=(n, 1)), g, 0)
    ids = np.repeat(rng.integers(3, V, (n, Q)), g, 0)
    mask = (np.arange(Q)[None] >= pads).astype(np.int32)
    return ids * mask, mask


def _reference_turn(model, params, ids, mask, tokens, used, key, budgets, g, **common):
    """Today's other path: the whole context (prompt and response so far) left-padded to
    Q + R and prefilled; the first turn from the prompts alone."""
    if tokens is None:
        return generate(model, params, ids, mask, key, num_generations=g, max_lengths=budgets, response_length=L,
                        **common)
    b = ids.shape[0]
    ctx, ctx_mask = np.zeros((b, Q + R), np.int32), np.zeros((b, Q + R), np.int32)
    for i in range(b):
        seq = np.concatenate([ids[i][mask[i] > 0], tokens[i, :used[i]]])
        ctx[i, Q + R - seq.size:], ctx_mask[i, Q + R - seq.size:] = seq, 1
    return generate(model, params, ctx, ctx_mask, key, max_lengths=budgets, response_length=L, **common)


def _play(model, params, g=1, mesh=None, turns_played=4, long_observation=False, seed=0):
    """Plays `turns_played` turns both ways on 8 rows: after each turn every live row gets an
    observation of 0-3 tokens (row 1 one longer than a turn when asked), row 5 ends after
    the first turn. Returns the per-turn (kept-cache, reference) outputs."""
    rng = np.random.default_rng(seed)
    b = 8
    ids, mask = _prompts(rng, b, g)
    place = lambda x: sharding.place_rows(x, mesh)
    common = dict(temperature=0.9, stop_token_ids=(STOP,), pad_token_id=0)
    tokens, used = np.zeros((b, R), np.int32), np.zeros(b, np.int64)
    cached, live = np.zeros(b, np.int64), np.ones(b, bool)
    key = jax.random.key(seed + 1)
    results = []
    state = None
    for turn in range(turns_played):
        budgets = np.where(live, np.minimum(L, R - used), 1).astype(np.int32)
        k = key if turn == 0 else jax.random.fold_in(key, turn)
        ref = _reference_turn(model, params, ids, mask, None if turn == 0 else tokens, used, k, budgets, g, **common)
        if turn == 0:
            out, state = turns.first_turn(model, params, place(ids), place(mask), k, turn_length=L,
                                          response_length=R, num_generations=g, max_lengths=place(budgets), **common)
        else:
            start = np.where(live, cached, used)
            lengths = used - start
            new = np.zeros((b, max(1, lengths.max())), np.int32)
            for i in np.flatnonzero(lengths):
                new[i, :lengths[i]] = tokens[i, start[i]:used[i]]
            out, state = turns.next_turn(model, params, state, turns.TurnInput(new, start, lengths, budgets), k,
                                         turn_length=L, response_length=R, place=place, **common)
        out, ref = jax.device_get(out), jax.device_get(ref)
        results.append((out, ref, live.copy()))
        n = ref.mask.sum(axis=1)
        for i in np.flatnonzero(live):  # the reference's turn goes on the record
            cached[i] = used[i] + n[i] - 1
            tokens[i, used[i]:used[i] + n[i]] = ref.tokens[i, :n[i]]
            used[i] += n[i]
            observation = rng.integers(3, V, 9 if (long_observation and i == 1 and turn == 0) else rng.integers(0, 4))
            if (turn == 0 and i == 5) or used[i] + observation.size >= R:
                live[i] = False
                continue
            tokens[i, used[i]:used[i] + observation.size] = observation
            used[i] += observation.size
    return results


def _check(results):
    for turn, (out, ref, live) in enumerate(results):
        rows = np.flatnonzero(live)
        np.testing.assert_array_equal(out.tokens[rows], ref.tokens[rows], err_msg=f"turn {turn}")
        np.testing.assert_array_equal(out.mask[rows], ref.mask[rows], err_msg=f"turn {turn}")
        np.testing.assert_allclose(out.logprobs[rows], ref.logprobs[rows], rtol=0, atol=2e-5, err_msg=f"turn {turn}")
    assert sum(r[2].sum() for r in results[1:]) >= 8  # later turns were played


CASES = [("gpt2", False, False, 1), ("qwen2", True, False, 2), ("llama", True, True, 1), ("gemma3", False, False, 2),
         ("gemma3", True, False, 1)]


@pytest.mark.parametrize("arch,scan,hoist,g", CASES,
                         ids=[f"{a}-{'scan' if s else 'loop'}{'-hoist' if h else ''}-g{g}" for a, s, h, g in CASES])
def test_kept_cache_turns_sample_what_reprefilling_samples(arch, scan, hoist, g):
    """Four turns with observations between them and a row that ended: the same tokens and
    masks as prefilling the context every turn, log-probs equal up to rounding (the first
    turn is the single-turn sampler's, exactly)."""
    model = jm.Model(_config(arch, max_position_embeddings=Q + R + L), scan_layers=scan, hoist_layers=hoist)
    params = perturbed(model.init(jax.random.key(0)), 1)
    results = _play(model, params, g=g, long_observation=arch == "gpt2")
    _check(results)
    first, ref, _ = results[0]
    np.testing.assert_array_equal(first.logprobs, ref.logprobs)


def test_kept_cache_turns_on_a_mesh_equal_one_device():
    """Rows split over a 2x4 mesh: the same turns as the reference on one device."""
    model = jm.Model(_config("llama"), scan_layers=True)
    params = perturbed(model.init(jax.random.key(0)), 1)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4))
    _check(_play(model, params, g=2, mesh=mesh, turns_played=3, seed=3))


def test_new_tokens_longer_than_a_turn_compile_once_per_piece_width():
    """New tokens are fed in pieces of a power of two up to the turn length: a row whose
    observation is longer than a turn takes several pieces of the same compiled program,
    and later turns with the same width reuse it."""
    model = jm.Model(_config("gpt2", max_position_embeddings=Q + R + L))
    params = perturbed(model.init(jax.random.key(0)), 1)
    before = turns._next_turn_jit._cache_size()
    _check(_play(model, params, long_observation=True, seed=4))
    assert turns._next_turn_jit._cache_size() - before <= 2  # piece widths: the turn length (5), at most one other
    assert turns.piece_width(3, 16) == 8 and turns.piece_width(9, 16) == 16 and turns.piece_width(40, 16) == 16


def test_bad_new_tokens_are_refused_before_anything_runs():
    model = jm.Model(_config("llama"))
    params = model.init(jax.random.key(0))
    ids, mask = _prompts(np.random.default_rng(0), 2, 1)
    _, state = turns.first_turn(model, params, ids, mask, jax.random.key(0), turn_length=L, response_length=R)
    with pytest.raises(ValueError, match="response_length=24"):
        turns.next_turn(model, params, state, turns.TurnInput(np.ones((2, 3)), np.array([R - 1, 0]), np.array([3, 1])),
                        jax.random.key(1), turn_length=L, response_length=R)
    with pytest.raises(ValueError, match="must be \\(2,\\)"):
        turns.next_turn(model, params, state, turns.TurnInput(np.ones((2, 3)), np.array([0]), np.array([1, 1])),
                        jax.random.key(1), turn_length=L, response_length=R)
    with pytest.raises(ValueError, match="turn_length"):
        turns.first_turn(model, params, ids, mask, jax.random.key(0), turn_length=R + 1, response_length=R)
