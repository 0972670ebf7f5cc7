"""Dynamic sampling (issue 20, item 1): zero-spread groups dropped and replaced by groups of
further prompts, against a plain loop over the data stream; the batch size, update count and
shapes unchanged; the prompts consumed are run state."""

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.rollout.dynamic import informative_groups
from jaxppo.rollout.prompts import prompt_stream

from trainer_setup import small_trainer

G, GROUPS = 4, 4  # completions per prompt, prompts per batch


def dead(prompt: str) -> bool:
    """Prompts whose completions all score 0 (no signal)."""
    return len(prompt) % 3 == 0


def scripted(prompts, completions):
    """0 for a dead prompt's rows; otherwise the row's index (every group has a spread)."""
    return [0.0 if dead(p) else float(i) for i, p in enumerate(prompts)]


def distinct(prompts, completions):
    return [float(i) for i in range(len(completions))]


def run(tmp_path, reward_fn, iterations=3, **settings):
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=G * GROUPS, mini_batch_size=8, ppo_epochs=1,
                                         num_generations=G)
    trainer = small_trainer(tmp_path, ppo=ppo, reward_fns=reward_fn, iterations=iterations, export_final=False,
                            **settings)
    return trainer, trainer.train()


@pytest.mark.parametrize("rounds_cap", [1, 2])
def test_the_batch_is_what_a_loop_over_the_stream_picks(tmp_path, rounds_cap):
    trainer, history = run(tmp_path, scripted, dynamic_sampling=True, dynamic_sampling_rounds=rounds_cap)
    prompts, key = demo.DEMO_PROMPTS, trainer.run.key
    position = 0
    for row in history:  # the loop: chunks of GROUPS prompts until GROUPS live ones or the cap
        live, dropped, rounds = [], [], 0
        while rounds < rounds_cap and len(live) < GROUPS:
            chunk = prompt_stream(key, len(prompts), position, GROUPS)
            position, rounds = position + GROUPS, rounds + 1
            live += [p for p in chunk if not dead(prompts[p])]
            dropped += [p for p in chunk if dead(prompts[p])]
        fill = GROUPS - min(len(live), GROUPS)
        assert row["dynamic/rounds"] == rounds and row["dynamic/groups_dropped"] == len(dropped)
        assert row["dynamic/masked_groups"] == fill and row["dynamic/prompts_consumed"] == position
        assert row["ppo/updates_applied"] == 2  # ppo_epochs * batch_size / mini_batch_size, always
    assert trainer.run.prompts_consumed == position
    rows, gen = trainer.last.samples  # the last iteration's batch: live groups first, then the fill
    expected = (live[:GROUPS] + dropped[:fill])
    np.testing.assert_array_equal(rows, np.repeat(expected, G))
    mask = np.asarray(gen.mask)
    assert not mask[(GROUPS - fill) * G:].any() and mask[:(GROUPS - fill) * G].any()
    assert any(r["dynamic/groups_dropped"] for r in history)
    if rounds_cap == 1:  # the cap is hit: masked groups fill the batch, and the update stays finite
        assert any(r["dynamic/masked_groups"] for r in history)
        assert all(np.isfinite(r["loss/total_avg"]) for r in history)


def test_without_dropped_groups_it_is_the_plain_run(tmp_path):
    """When every group has a spread, dynamic sampling changes nothing: the same prompts,
    keys, metrics and parameters."""
    plain_trainer, plain = run(tmp_path / "plain", distinct, iterations=2)
    dyn_trainer, dyn = run(tmp_path / "dynamic", distinct, iterations=2, dynamic_sampling=True)
    for a, b in zip(plain, dyn):
        assert b["dynamic/rounds"] == 1 and b["dynamic/groups_dropped"] == 0
        assert {k: v for k, v in a.items() if not k.startswith(("time/", "eps"))} == \
            {k: v for k, v in b.items() if not k.startswith(("time/", "eps", "dynamic/"))}
    for a, b in zip(jax.tree.leaves(plain_trainer.state.params), jax.tree.leaves(dyn_trainer.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resume_continues_the_stream(tmp_path):
    _, straight = run(tmp_path / "a", scripted, iterations=4, dynamic_sampling=True, checkpoint_every=1)
    run(tmp_path / "b", scripted, iterations=2, dynamic_sampling=True, checkpoint_every=1)
    _, resumed = run(tmp_path / "b", scripted, iterations=4, dynamic_sampling=True, checkpoint_every=1)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]


def test_informative_groups_and_bad_settings(tmp_path):
    scores = np.array([1, 1, 1, 1, 0, 1, 0, 0, 2, 2, np.nan, 2], np.float32)
    np.testing.assert_array_equal(informative_groups(scores, 4), [False, True, True])
    ppo = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8)
    with pytest.raises(ValueError, match=r"dynamic_sampling=True needs groups: BatchConfig.num_generations=1"):
        small_trainer(tmp_path, ppo=ppo, dynamic_sampling=True)
    with pytest.raises(ValueError, match=r"RewardConfig.dynamic_sampling_rounds=0 is invalid"):
        jaxppo.Config.from_settings(dynamic_sampling=True, dynamic_sampling_rounds=0)


def test_with_multiturn_episodes(tmp_path):
    """Dynamic sampling over environment episodes: the groups are picked from the rounds
    with their episodes' tokens, rewards and conversations."""
    trainer, history = run(tmp_path, None, iterations=2, dynamic_sampling=True, environment=demo.GuessTheDigit,
                           prompts=demo.multiturn_prompts(), response_length=16, turn_length=3, max_len=48)
    rows, gen = trainer.last.samples
    assert gen.attention_mask.shape == (G * GROUPS, 16) and len(rows) == G * GROUPS
    assert all(r["ppo/updates_applied"] == 2 and "env/turns_mean" in r for r in history)
    assert history[-1]["dynamic/prompts_consumed"] == trainer.run.prompts_consumed
    # The policy's tokens lie inside the sequence it attends to, row by row, after the picks.
    mask, attention = np.asarray(gen.mask), np.asarray(gen.attention_mask)
    assert not (mask & (1 - attention)).any() and (attention.sum(1) >= mask.sum(1)).all()
