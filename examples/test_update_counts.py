"""A pattern for your own test suite: pin the number of optimizer updates with chex.

Run with `python -m pytest examples/test_update_counts.py`. Copy it next to your model and
replace `apply_fn`/`params` with yours: the facts pinned here hold for any model.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxppo
from jaxppo.testing.toy import make_toy

Q, R = 4, 6


def _rollout(batch, vocab=32):
    k1, k2 = jax.random.split(jax.random.key(0))
    return jaxppo.RolloutBatch(
        query_tokens=jax.random.randint(k1, (batch, Q), 0, vocab), query_mask=jnp.ones((batch, Q), jnp.int32),
        response_tokens=jax.random.randint(k2, (batch, R), 0, vocab), response_mask=jnp.ones((batch, R), jnp.int32),
        logprobs=jnp.full((batch, R), -jnp.log(vocab)), values=jnp.zeros((batch, R)), rewards=jnp.ones((batch, R)))


@pytest.mark.parametrize("batch_size, mini_batch_size, ppo_epochs, accumulation",
                         [(8, 2, 2, 1), (16, 8, 1, 4)])
def test_updates_per_train_step_are_pinned(batch_size, mini_batch_size, ppo_epochs, accumulation):
    apply_fn, params = make_toy(jax.random.key(1), vocab_size=32, width=16, depth=1, heads=2, max_len=Q + R,
                                seq_len=Q + R)
    config = jaxppo.Config(batch=jaxppo.BatchConfig(batch_size=batch_size, mini_batch_size=mini_batch_size,
                           ppo_epochs=ppo_epochs, gradient_accumulation_steps=accumulation))
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(1e-3))

    # One trace of the whole update loop, however often it is called. (chex counts traces
    # per function definition, so reset the counter between parametrized cases.)
    chex.clear_trace_counter()
    step = jax.jit(chex.assert_max_traces(lambda s, r, k: jaxppo.update.train_step_fn(s, r, k, config), n=1))
    for i in range(3):
        state, metrics = step(state, _rollout(batch_size), jax.random.key(i))
        assert int(state.step) == (i + 1) * ppo_epochs * batch_size // mini_batch_size
    chex.assert_shape(metrics["per_minibatch/loss/total"], (ppo_epochs, batch_size // mini_batch_size))
    chex.assert_trees_all_equal(metrics["ppo/updates_applied"], jnp.int32(config.batch.updates_per_step))
