"""PPO on CartPole (gymnax) with jaxppo's mini-batch loop as the update phase, the PureJaxRL way:
the whole training run is one function, jitted, and vmapped over seeds.

    pip install gymnax==0.0.9          # (the `test` extra installs it)
    python examples/cartpole.py                     # 4 seeds, 500k steps each
    python examples/cartpole.py --seeds 16 --update hand
    python examples/cartpole.py --cores 2           # (see below: 1 by default on jaxlib < 0.11)

Everything happens inside `train(key)`: the train state is created there
(`jaxppo.TrainState.create` under `jit` and `vmap`), 4 environments step for 128 steps per
iteration, GAE runs over the time-major rollout with the environments' auto-reset dones
(`jaxppo.update.advantages.gae_time_major`), and the update phase is
`jaxppo.update.update_epochs_fn(state, batch, key, loss_fn, sizes)`: 4 epochs of 4 shuffled
mini-batches of 128 transitions, one optax update each. The settings are PureJaxRL's
CartPole ones (clip 0.2, GAE lambda 0.95, entropy 0.01, value 0.5, gradient norm 0.5,
Adam 2.5e-4 annealed linearly). `--update hand` swaps in an update phase written out by
hand (nested `lax.scan`s over epochs and mini-batches, as PureJaxRL writes it), the
reference `benchmarks/cartpole.py` times the loop against.

On jaxlib older than 0.11 the script pins itself to `--cores` CPU cores, 1 by default:
with more than one, jaxlib 0.10.2's CPU runtime stalled on this program now and then on a
2-core machine (every thread idle, the result never ready; with the hand-written update
phase as well), and one core ran it as fast as two. jaxlib 0.12.0.1 ran it on two cores
without a stall (9 runs), so on 0.11 and newer the default is 0: the process is left as it
is. Nothing else in jaxppo needs this (`--cores 0` leaves the process as it is, e.g. on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxppo
from jaxppo.version import release

# jaxlib 0.10's CPU runtime stalled on this program on two cores (see above): one core there.
DEFAULT_CORES = 1 if release(jax.__version__) < (0, 11) else 0


@dataclasses.dataclass(frozen=True)
class Config:
    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    update_epochs: int = 4
    num_minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    lr: float = 2.5e-4
    anneal_lr: bool = True
    skip_nonfinite_updates: bool = True  # the loop's non-finite check (BatchConfig.skip_nonfinite_updates)

    @property
    def num_updates(self) -> int:
        """Iterations: rollouts of num_envs x num_steps transitions."""
        return self.total_timesteps // self.num_steps // self.num_envs

    @property
    def batch(self) -> jaxppo.BatchConfig:
        """The mini-batch loop's config (`update_epochs` finds it as `.batch`)."""
        batch = self.num_envs * self.num_steps
        return jaxppo.BatchConfig(batch_size=batch, mini_batch_size=batch // self.num_minibatches,
                                  ppo_epochs=self.update_epochs, skip_nonfinite_updates=self.skip_nonfinite_updates)


def _dense(features, scale):
    return nn.Dense(features, kernel_init=nn.initializers.orthogonal(scale), bias_init=nn.initializers.zeros)


class ActorCritic(nn.Module):
    """Two tanh MLPs of 64 units: observation -> (action logits, value)."""

    actions: int

    @nn.compact
    def __call__(self, obs):
        actor = nn.tanh(_dense(64, np.sqrt(2))(nn.tanh(_dense(64, np.sqrt(2))(obs))))
        critic = nn.tanh(_dense(64, np.sqrt(2))(nn.tanh(_dense(64, np.sqrt(2))(obs))))
        return _dense(self.actions, 0.01)(actor), _dense(1, 1.0)(critic)[..., 0]


class Transition(NamedTuple):
    obs: jax.Array
    action: jax.Array
    logprob: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array
    finished_return: jax.Array  # the episode's return where it ended at this step, else 0


def make_loss(network: ActorCritic, config: Config):
    """PPO's clipped loss on a mini-batch of transitions (advantages normalised within it)."""

    def loss_fn(params, mb):
        logits, value = network.apply(params, mb["obs"])
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, mb["action"][:, None], axis=-1)[:, 0]
        clipped = mb["value"] + jnp.clip(value - mb["value"], -config.clip_eps, config.clip_eps)
        value_loss = 0.5 * jnp.mean(jnp.maximum((value - mb["targets"]) ** 2, (clipped - mb["targets"]) ** 2))
        log_ratio = logp - mb["logprob"]
        ratio = jnp.exp(log_ratio)
        adv = (mb["advantages"] - mb["advantages"].mean()) / (mb["advantages"].std() + 1e-8)
        policy_loss = -jnp.mean(jnp.minimum(ratio * adv,
                                            jnp.clip(ratio, 1 - config.clip_eps, 1 + config.clip_eps) * adv))
        entropy = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1))
        total = policy_loss + config.vf_coef * value_loss - config.ent_coef * entropy
        return total, {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy,
                       "approxkl": jnp.mean((ratio - 1) - log_ratio)}

    return loss_fn


def hand_update(state, batch, key, loss_fn, config: Config):
    """The update phase written out by hand: per epoch a permutation, the batch reshaped to
    mini-batches, a scan of one optax update each (no checks, no metrics beyond the loss)."""
    sizes = config.batch

    def epoch(carry, _):
        state, key = carry
        key, k_perm = jax.random.split(key)
        perm = jax.random.permutation(k_perm, sizes.batch_size)
        shaped = jax.tree.map(lambda x: jnp.take(x, perm, axis=0).reshape(
            (sizes.num_minibatches, sizes.mini_batch_size) + x.shape[1:]), batch)

        def minibatch(state, mb):
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, mb)
            return state.apply_gradients(grads=grads), loss

        state, losses = jax.lax.scan(minibatch, state, shaped)
        return (state, key), losses

    (state, _), losses = jax.lax.scan(epoch, (state, key), None, length=sizes.ppo_epochs)
    return state, {"loss": losses}


def make_train(config: Config, update: str = "jaxppo"):
    """`train(key) -> (final train state, mean return of the episodes that ended in each
    iteration (num_updates,))`: jittable and vmappable over keys."""
    import gymnax

    env, env_params = gymnax.make("CartPole-v1")
    network = ActorCritic(env.action_space(env_params).n)
    loss_fn = make_loss(network, config)
    sizes = config.batch
    updates_per_iteration = sizes.updates_per_step
    lr = (lambda count: config.lr * (1.0 - (count // updates_per_iteration) / config.num_updates)) \
        if config.anneal_lr else config.lr
    tx = optax.chain(optax.clip_by_global_norm(config.max_grad_norm), optax.adam(lr, eps=1e-5))
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def update_phase(state, batch, key):
        if update == "jaxppo":
            return jaxppo.update.update_epochs_fn(state, batch, key, loss_fn, sizes)
        return hand_update(state, batch, key, loss_fn, config)

    def rollout(state, carry):
        def env_step(carry, _):
            env_state, obs, episode_return, key = carry
            key, k_action, k_step = jax.random.split(key, 3)
            logits, value = network.apply(state.params, obs)
            action = jax.random.categorical(k_action, logits)
            logprob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], axis=-1)[:, 0]
            next_obs, env_state, reward, done, _ = step_envs(jax.random.split(k_step, config.num_envs), env_state,
                                                             action, env_params)
            episode_return = episode_return + reward
            finished = jnp.where(done, episode_return, 0.0)
            carry = (env_state, next_obs, episode_return * (1.0 - done), key)
            return carry, Transition(obs, action, logprob, value, reward, done, finished)

        return jax.lax.scan(env_step, carry, None, length=config.num_steps)

    def iteration(carry, _):
        state, env_carry = carry
        env_carry, traj = rollout(state, env_carry)
        _, last_value = network.apply(state.params, env_carry[1])
        advantages, targets = jaxppo.update.advantages.gae_time_major(traj.reward, traj.value, traj.done,
                                                                      last_value, config.gamma, config.gae_lambda)
        flat = lambda x: x.reshape((-1,) + x.shape[2:])
        batch = {"obs": flat(traj.obs), "action": flat(traj.action), "logprob": flat(traj.logprob),
                 "value": flat(traj.value), "advantages": flat(advantages), "targets": flat(targets)}
        key, k_update = jax.random.split(env_carry[3])
        state, _ = update_phase(state, batch, k_update)
        ended = jnp.sum(traj.done)
        mean_return = jnp.where(ended > 0, jnp.sum(traj.finished_return) / jnp.maximum(ended, 1), jnp.nan)
        return (state, env_carry[:3] + (key,)), mean_return

    def train(key):
        k_init, k_reset, k_run = jax.random.split(key, 3)
        obs_shape = env.observation_space(env_params).shape
        params = network.init(k_init, jnp.zeros(obs_shape))
        state = jaxppo.TrainState.create(apply_fn=network.apply, params=params, tx=tx)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(k_reset, config.num_envs),
                                                                env_params)
        env_carry = (env_state, obs, jnp.zeros(config.num_envs), k_run)
        (state, _), returns = jax.lax.scan(iteration, (state, env_carry), None, length=config.num_updates)
        return state, returns

    return train


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--timesteps", type=int, default=500_000)
    parser.add_argument("--update", choices=["jaxppo", "hand"], default="jaxppo")
    parser.add_argument("--cores", type=int, default=DEFAULT_CORES,
                        help="CPU cores to run on (see the module's note; 0: leave the process as it is; "
                             f"default {DEFAULT_CORES} with jax {jax.__version__})")
    args = parser.parse_args(argv)
    if args.cores and hasattr(os, "sched_setaffinity"):  # before jax starts its CPU client
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    config = Config(total_timesteps=args.timesteps)
    train = jax.jit(jax.vmap(make_train(config, args.update)))
    keys = jax.random.split(jax.random.key(0), args.seeds)
    start = time.perf_counter()
    compiled = train.lower(keys).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    state, returns = jax.block_until_ready(compiled(keys))
    run_s = time.perf_counter() - start
    final = np.nanmean(np.asarray(returns)[:, -10:], axis=1)
    print(f"{args.seeds} seeds x {config.total_timesteps} steps, update phase {args.update!r}: compiled in "
          f"{compile_s:.1f} s, ran in {run_s:.1f} s; optimizer updates per seed {int(state.step[0])} "
          f"(= {config.num_updates} iterations x {config.batch.updates_per_step})")
    print("mean return of the last 10 iterations, per seed: " + " ".join(f"{r:.0f}" for r in final))


if __name__ == "__main__":
    main()
