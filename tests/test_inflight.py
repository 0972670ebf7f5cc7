"""In-flight weight updates in the continuous sampler
(`jaxppo.rollout.engines.continuous.generate_inflight`): without an update it is the engine; with
"recompute", every token after an update is drawn from the new policy given its whole
context, against a plain loop of full forwards; the same parameters under a new version
change no token either way; the version of every token is recorded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo.models as jm
from jaxppo.models.sampling import Sampling
from jaxppo.rollout.engines.continuous import generate_continuous, generate_inflight
from jaxppo.models.decoding import pick_tokens, step_keys

from trainer_setup import tiny_llama

V, N, Q, R, SLOTS = 24, 8, 5, 10, 3
STOPS = (2, 3)


@pytest.fixture(scope="module", params=[False, True], ids=["unrolled", "scanned"])
def tiny(request):
    model = tiny_llama(request.param, V)
    return model, model.init(jax.random.key(0)), model.init(jax.random.key(7))


def prompts():
    rng = np.random.default_rng(0)
    ids = rng.integers(4, V, (N, Q))
    mask = np.ones_like(ids)
    mask[1::2, :2] = 0
    return ids * mask, mask


class Source:
    """Version 0 for the first `switch_after` asks, then version 1."""

    def __init__(self, first, second, switch_after=1):
        self.params, self.asked, self.switch_after = (first, second), 0, switch_after

    def __call__(self):
        self.asked += 1
        version = int(self.asked > self.switch_after)
        return version, self.params[version]


def run(model, source, on_update, steps_per_check=2):
    ids, mask = prompts()
    return generate_inflight(model, source, ids, mask, jax.random.key(1), response_length=R, num_slots=SLOTS,
                             stop_token_ids=STOPS, steps_per_check=steps_per_check, on_update=on_update)


@pytest.mark.parametrize("on_update", ["keep", "recompute"])
def test_without_an_update_it_is_the_engine(tiny, on_update):
    model, params, _ = tiny
    ids, mask = prompts()
    expected = generate_continuous(model, params, ids, mask, jax.random.key(1), response_length=R, num_slots=SLOTS,
                                   stop_token_ids=STOPS)
    out, versions = run(model, lambda: (0, params), on_update)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(expected.mask))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(expected.logprobs), atol=1e-6)
    assert not np.asarray(versions).any()


@pytest.mark.parametrize("on_update", ["keep", "recompute"])
def test_a_new_version_of_the_same_parameters_changes_no_token(tiny, on_update):
    """Version 1 is a copy of version 0: kept caches and recomputed ones give the tokens of
    a run without an update (log-probs up to rounding), and the versions say which tokens
    came after the switch."""
    model, params, _ = tiny
    plain, _ = run(model, lambda: (0, params), on_update)
    out, versions = run(model, Source(params, jax.tree.map(jnp.copy, params), switch_after=2), on_update)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(plain.logprobs), atol=2e-5)
    versions, mask = np.asarray(versions), np.asarray(out.mask)
    assert (versions[mask == 1] == 1).any() and (versions[mask == 1] == 0).any()
    assert (np.diff(versions, axis=1)[mask[:, 1:] == 1] >= 0).all()  # a row's versions never go back


@functools.partial(jax.jit, static_argnames="model")
def forward(model, params, ids, mask):
    """The logits of the next token after each left-padded row: a full forward, no cache."""
    return model.apply(params, ids, mask)[:, -1]


def full_forward_tokens(model, versions_params, out, versions):
    """The plain loop: each token drawn from the full forward (no cache) of the version the
    engine recorded for it, over the row's prompt and the tokens before it, with the row's
    step key. Returns the tokens and log-probs."""
    ids, mask = prompts()
    keys = jax.random.split(jax.random.key(1), N)
    tokens, mask_out = np.asarray(out.tokens), np.asarray(out.mask)
    want_tokens, want_logprobs = np.zeros_like(tokens), np.zeros(tokens.shape, np.float32)
    for i in range(N):
        context = list(ids[i][mask[i] == 1])
        for t in range(int(mask_out[i].sum())):
            params = versions_params[int(versions[i, t])]
            pad = Q + R - len(context)  # left-padded to one width: one compile
            logits = forward(model, params, jnp.asarray([[0] * pad + context]),
                             jnp.asarray([[0] * pad + [1] * len(context)]))
            token, logprob, _ = pick_tokens(logits, step_keys(keys[i][None], t), Sampling(temperature=np.float32(1.0)))
            want_tokens[i, t], want_logprobs[i, t] = int(token[0]), float(logprob[0])
            context.append(int(tokens[i, t]))
    return want_tokens, want_logprobs


def test_recompute_draws_every_later_token_from_the_new_policy(tiny):
    model, first, second = tiny
    out, versions = run(model, Source(first, second, switch_after=2), "recompute")
    versions, mask = np.asarray(versions), np.asarray(out.mask)
    assert (versions[mask == 1] == 1).sum() > 5 and (versions[mask == 1] == 0).sum() > 5
    want_tokens, want_logprobs = full_forward_tokens(model, (first, second), out, versions)
    np.testing.assert_array_equal(np.where(mask == 1, np.asarray(out.tokens), 0), np.where(mask == 1, want_tokens, 0))
    np.testing.assert_allclose(np.where(mask == 1, np.asarray(out.logprobs), 0), want_logprobs, atol=2e-5)


def test_keep_differs_from_recompute_only_where_old_keys_and_values_are_read(tiny):
    """With "keep", tokens drawn before the switch are the run's without an update, and
    the rows admitted after it (their whole cache computed by the new parameters) are the
    plain loop's of version 1; rows that straddle the switch read old keys and values."""
    model, first, second = tiny
    out, versions = run(model, Source(first, second, switch_after=2), "keep")
    versions, mask = np.asarray(versions), np.asarray(out.mask)
    plain, _ = run(model, lambda: (0, first), "keep")
    before = (versions == 0) & (mask == 1)
    np.testing.assert_array_equal(np.asarray(out.tokens)[before], np.asarray(plain.tokens)[before])
    fresh = [i for i in range(N) if mask[i].any() and (versions[i][mask[i] == 1] == 1).all()]
    assert fresh  # some requests started after the switch
    want_tokens, want_logprobs = full_forward_tokens(model, (first, second), out, versions)
    for i in fresh:
        real = mask[i] == 1
        np.testing.assert_array_equal(np.asarray(out.tokens)[i][real], want_tokens[i][real])
        np.testing.assert_allclose(np.asarray(out.logprobs)[i][real], want_logprobs[i][real], atol=2e-5)


def test_bad_arguments_are_refused():
    model = jm.Model(jm.ModelConfig(model_type="llama", vocab_size=V, hidden_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=1, intermediate_size=32, max_position_embeddings=64))
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"on_update='later' is invalid; valid: 'keep' .* or 'recompute'"):
        generate_inflight(model, None, ids, mask, jax.random.key(0), response_length=R, num_slots=2,
                          on_update="later")
    with pytest.raises(ValueError, match=r"steps_per_check=0 must be a positive int"):
        generate_inflight(model, None, ids, mask, jax.random.key(0), response_length=R, num_slots=2,
                          steps_per_check=0)
