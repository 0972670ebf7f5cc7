"""Reward functions as TRL users write them (`jaxppo.rollout.rewards.HostRewards`): `async def`
functions run concurrently (with the synchronous ones in threads beside them), proven by
handshakes that only complete when both are in flight; without async ones, one after
another in order; `trainer_state`; a dict of named parts, summed and reported part by part;
each function's time in the metrics line."""

import asyncio
import threading

import numpy as np
import pytest

from jaxppo.errors import RewardError
from jaxppo.rollout.rewards import HostRewards, RewardFunction

from trainer_setup import small_trainer

PROMPTS, COMPLETIONS = ["a", "b", "c"], ["x", "yy", "zzz"]


def test_async_functions_run_together_and_sync_ones_beside_them_in_threads():
    first, second = asyncio.Event(), asyncio.Event()
    barrier = threading.Barrier(2, timeout=20)

    async def judge(prompts, completions):  # waits for `verifier` to have started: only concurrently
        first.set()
        await asyncio.wait_for(second.wait(), 20)
        return [1.0] * len(completions)

    async def verifier(prompts, completions):
        await asyncio.wait_for(first.wait(), 20)
        second.set()
        await asyncio.to_thread(barrier.wait)  # and meets `sandbox`, a plain function, in flight
        return [float(len(c)) for c in completions]

    def sandbox(prompts, completions):
        barrier.wait()
        return [0.5, None, 0.5]

    rewards = HostRewards([RewardFunction("judge", judge, 1.0), RewardFunction("verifier", verifier, 2.0),
                           RewardFunction("sandbox", sandbox, 1.0)])
    total, per_function, times = rewards(0, PROMPTS, COMPLETIONS, {})
    np.testing.assert_allclose(total, [1 + 2 * 1 + 0.5, 1 + 2 * 2, 1 + 2 * 3 + 0.5])
    assert per_function["sandbox"][1].tolist() == [True, False, True]
    assert set(times) == {"judge", "verifier", "sandbox"} and all(t >= 0 for t in times.values())


def test_without_async_functions_they_run_in_order_in_the_calling_thread():
    calls = []

    def make(name):
        def fn(prompts, completions):
            calls.append((name, threading.get_ident()))
            return [1.0] * len(completions)
        fn.__name__ = name
        return fn

    HostRewards([RewardFunction(n, make(n), 1.0) for n in ("a", "b", "c")])(0, PROMPTS, COMPLETIONS, {})
    assert calls == [(n, threading.get_ident()) for n in ("a", "b", "c")]


def test_async_functions_work_where_an_event_loop_already_runs():
    async def judge(prompts, completions):
        await asyncio.sleep(0)
        return [2.0] * len(completions)

    async def inside():  # as in a notebook: HostRewards is called from code under a running loop
        return HostRewards([RewardFunction("judge", judge, 1.0)])(0, PROMPTS, COMPLETIONS, {})

    assert asyncio.run(inside()).total.tolist() == [2.0, 2.0, 2.0]


def test_dict_parts_and_errors_name_the_part():
    def shaped(prompts, completions):
        return {"format": [1.0, 0.0, 1.0], "correct": [None, 1.0, 0.0]}

    total, per_function, _ = HostRewards([RewardFunction("shaped", shaped, 0.5)])(0, PROMPTS, COMPLETIONS, {})
    np.testing.assert_allclose(total, [0.5, 0.5, 0.5])
    assert per_function["shaped/correct"][1].tolist() == [False, True, True]
    with pytest.raises(RewardError, match=r"reward function 'bad' \(part 'correct'\) returned 2 scores for 3"):
        HostRewards([RewardFunction("bad", lambda p, c: {"format": [1.0] * 3, "correct": [1.0] * 2}, 1.0)])(
            0, PROMPTS, COMPLETIONS, {})
    with pytest.raises(RewardError, match=r"returned a dict with keys \[1\]"):
        HostRewards([RewardFunction("bad", lambda p, c: {1: [1.0] * 3}, 1.0)])(0, PROMPTS, COMPLETIONS, {})

    async def raises(prompts, completions):
        raise ValueError("judge down")

    with pytest.raises(RewardError, match=r"iteration 3: reward function 'raises' raised ValueError: judge down"):
        HostRewards([RewardFunction("raises", raises, 1.0)])(3, PROMPTS, COMPLETIONS, {})


def test_the_trainer_passes_trainer_state_and_logs_parts_and_times(tmp_path):
    states = []

    async def graded(prompts, completions, trainer_state):
        states.append(dict(trainer_state))
        return {"length": [len(c) / 10 for c in completions], "lower": [float(c.islower()) for c in completions]}

    trainer = small_trainer(tmp_path / "run", iterations=2, export_final=False, reward_fns=graded)
    history = trainer.train()
    assert states == [{"iteration": 0, "updates": 0}, {"iteration": 1, "updates": 4}]  # 2 epochs x 16 / 8
    for line in history:
        assert {"rewards/graded/length/mean", "rewards/graded/lower/mean", "time/reward/graded"} <= set(line)
        assert line["reward"] == pytest.approx(line["rewards/graded/mean"])


def test_a_jax_array_of_scores_is_taken_as_the_numpy_array_it_holds():
    """A reward function that returns a JAX array (or a list of JAX scalars) is scored as one
    returning the same NumPy values; a JAX array of the wrong shape is refused as NumPy's is."""
    import jax.numpy as jnp

    from jaxppo.rollout.rewards import check_scores

    expected = np.array([0.5, -1.0, 2.0], np.float32)
    for scores in (jnp.asarray(expected), list(jnp.asarray(expected)), [jnp.float32(v) for v in expected]):
        np.testing.assert_array_equal(check_scores(scores, 3), check_scores(expected, 3))
    rewards = HostRewards([RewardFunction("jax", lambda p, c: jnp.arange(len(c), dtype=jnp.float32), 1.0)])
    total, per_function, _ = rewards(0, PROMPTS, COMPLETIONS, {})
    np.testing.assert_array_equal(total, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(per_function["jax"][0], [0.0, 1.0, 2.0])
    with pytest.raises(RewardError, match=r"returned an array of shape \(3, 1\); expected \(3,\)"):
        check_scores(jnp.zeros((3, 1)), 3)
    with pytest.raises(RewardError, match=r"returned (np\.)?True_? \(bool_?\) at row 0; each score must be a real number"):
        check_scores(jnp.asarray([True, False, True]), 3)
