"""`examples/cartpole.py` (issue 26): one update phase of the engine equals a plain Python
loop over the same mini-batches; a short training run, jitted and vmapped over seeds with
the train state created inside, applies the pinned number of updates per seed."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxppo
from jaxppo.update.minibatches import minibatch_indices

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "cartpole.py"


def _example():
    spec = importlib.util.spec_from_file_location("examples_cartpole", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["examples_cartpole"] = module  # Flax modules need their module registered
    spec.loader.exec_module(module)
    return module


def test_one_update_phase_equals_a_python_loop_over_the_same_minibatches():
    """The engine's 4 epochs x 4 mini-batches of the example's PPO loss, against a plain
    loop taking the same rows (the engine's `minibatch_indices`) and one optax update each:
    the same parameters and losses."""
    cp = _example()
    config = cp.Config(num_envs=4, num_steps=16)
    engine = config.batch
    network = cp.ActorCritic(2)
    loss_fn = cp.make_loss(network, config)
    rng = np.random.default_rng(0)
    n = engine.batch_size
    batch = {"obs": jnp.asarray(rng.normal(size=(n, 4)), jnp.float32),
             "action": jnp.asarray(rng.integers(0, 2, n), jnp.int32),
             "logprob": jnp.asarray(np.log(rng.uniform(0.3, 0.7, n)), jnp.float32),
             "value": jnp.asarray(rng.normal(size=n), jnp.float32),
             "advantages": jnp.asarray(rng.normal(size=n), jnp.float32),
             "targets": jnp.asarray(rng.normal(size=n), jnp.float32)}
    params = network.init(jax.random.key(1), jnp.zeros(4))
    tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(1e-2, eps=1e-5))
    state = jaxppo.TrainState.create(apply_fn=network.apply, params=params, tx=tx)
    key = jax.random.key(2)

    new_state, metrics = jaxppo.update.update_epochs(state, batch, key, loss_fn, engine)

    params, opt_state, losses = params, tx.init(params), []
    for epoch in np.asarray(minibatch_indices(key, engine)):
        for rows in epoch:
            mb = {k: v[rows] for k, v in batch.items()}
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, mb)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
    assert int(new_state.step) == engine.updates_per_step == 16
    np.testing.assert_allclose(np.asarray(metrics["loss"]).ravel(), losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(jax.tree.leaves(new_state.params)[0]),
                           np.asarray(jax.tree.leaves(state.params)[0]))  # it trained


SHORT_RUN = """
import json, os, sys
sys.path.insert(0, {examples!r})
import jax, numpy as np
import cartpole
if cartpole.DEFAULT_CORES:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cartpole.DEFAULT_CORES])
config = cartpole.Config(total_timesteps=4 * 4 * 128)
state, returns = jax.jit(jax.vmap(cartpole.make_train(config)))(jax.random.split(jax.random.key(0), 2))
print(json.dumps({{"steps": np.asarray(state.step).tolist(), "updates": config.num_updates,
                  "per_update": config.batch.updates_per_step, "returns": np.asarray(returns).tolist()}}))
"""


def test_a_short_training_run_vmapped_over_seeds_applies_every_update():
    """Four iterations for two seeds in one jit of a vmap (the train state created inside):
    16 updates per iteration for each seed, and episodes that ended with returns of at least
    one step. Run in a child process (on one core under jaxlib < 0.11: see the example's note
    on jaxlib 0.10.2's CPU runtime), with a timeout."""
    code = SHORT_RUN.format(examples=str(EXAMPLE.parent))
    env = {**os.environ, "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["updates"] == 4 and out["per_update"] == 16
    assert out["steps"] == [64, 64]
    returns = np.asarray(out["returns"], dtype=float)
    assert returns.shape == (2, 4)
    assert np.isfinite(returns).any() and np.nanmin(returns) >= 1.0
