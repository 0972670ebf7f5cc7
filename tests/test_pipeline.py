"""Pipelined iterations (`TrainerConfig.max_staleness`, `jaxppo.run.pipeline`): a pipelined
run against a plain one-thread loop that samples iteration i from the parameters of
iteration i - k; the staleness bound; the synchronous loop untouched at k = 0; a failed
weight snapshot refusing later samples; a split mesh against one device; bad settings."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.rollout.environments import StepResult
from jaxppo.run import iteration
from jaxppo.run.pipeline import Producer, version_of

from trainer_setup import require_devices, small_trainer

GRPO = dict(batch_size=16, mini_batch_size=8, ppo_epochs=1, num_generations=4)
ITERATIONS = 4


def scripted(prompts, completions):
    """Every third prompt's group scores 0 (dropped by dynamic sampling), the others by
    length and lowercase letters (a spread)."""
    return [0.0 if len(p) % 3 == 0 else float(len(c) % 4) + demo.lowercase_reward([p], [c])[0]
            for p, c in zip(prompts, completions)]


class TwoTurns:
    """A two-turn episode: an observation after the first turn, the lowercase score after
    the second."""

    def reset(self, prompt):
        self.turns = 0

    def step(self, completion):
        self.turns += 1
        return StepResult(" ok" if self.turns == 1 else None, demo.lowercase_reward([None], [completion])[0],
                          self.turns == 2)


CASES = {  # name: (max_staleness, trainer settings)
    "ppo-k1": (1, dict()),
    "grpo-lora-k1": (1, dict(ppo=jaxppo.Config.for_algorithm("grpo", **GRPO),
                             lora=jm.LoraConfig(rank=4, alpha=8, targets="all-linear"))),
    "grpo-dynamic-k2": (2, dict(ppo=jaxppo.Config.for_algorithm("grpo", **GRPO), reward_fns=scripted,
                                dynamic_sampling=True)),
    "grpo-environment-k1": (1, dict(ppo=jaxppo.Config.for_algorithm("grpo", **GRPO), environment=TwoTurns,
                                    reward_fns=None, response_length=10, turn_length=4, max_turns=2, max_len=48)),
}


def sequential(trainer, iterations: int, k: int):
    """The reference: one thread, the stages in order; iteration i samples from a copy of
    the parameters after max(0, i - k) iterations and trains the current ones. Returns the
    per-iteration device metrics (host floats)."""
    versions, rows = [jax.tree.map(jnp.copy, trainer.run.train.params)], []
    for i in range(iterations):
        run = trainer.run
        k_sample, k_train = run.iteration_keys(i)
        view = run.replace(train=run.train.replace(params=versions[version_of(i, k)]))
        batch, gen, _, scores, _, consumed, _ = trainer.parts.collector.collect(view, i, k_sample)
        built = iteration.build(trainer.parts.spec, run.train.params, trainer.parts.ref_params, trainer.parts.reward_params,
                                     batch, gen, scores, run)
        new_run, device = iteration.update(run, built, k_train, trainer.train_step, trainer.config)
        trainer.run = new_run.replace(prompts_consumed=consumed)
        versions.append(jax.tree.map(jnp.copy, trainer.run.train.params))
        rows.append({name: float(value) for name, value in jax.device_get(device).items()})
    return rows


@pytest.mark.parametrize("case", list(CASES))
def test_pipelined_run_is_the_loop_that_samples_k_iterations_behind(tmp_path, case):
    k, settings = CASES[case]
    trainer = small_trainer(tmp_path / "pipelined", iterations=ITERATIONS, max_staleness=k, export_final=False,
                            **settings)
    assert not trainer.parts.spec.sampler_logprobs_used  # stale samples: old log-probs recomputed at update time
    history = trainer.train()
    reference = small_trainer(tmp_path / "sequential", iterations=ITERATIONS, old_logprobs="recompute",
                              export_final=False, **settings)
    expected = sequential(reference, ITERATIONS, k)
    for i, (row, want) in enumerate(zip(history, expected)):
        assert row["rollout/staleness_max"] == row["rollout/staleness_mean"] == min(i, k) <= k
        assert row["rollout/policy_version"] == version_of(i, k)
        shared = [name for name in want if name in row]
        assert len(shared) > 10
        for name in shared:
            assert row[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), (i, name)
    for a, b in zip(jax.tree.leaves(trainer.run.train.params), jax.tree.leaves(reference.run.train.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert [v for _, v in trainer_sampled(trainer)] == [version_of(i, k) for i in range(ITERATIONS)]
    assert len(trainer.run.behind) == k  # the snapshots still to be sampled from, checkpointed with the run
    if settings.get("dynamic_sampling"):
        assert any(row["dynamic/groups_dropped"] for row in history)  # the rounds ran in the producer


def trainer_sampled(trainer):
    """(iteration, version) of each batch the producer sampled, in order."""
    return trainer.parts.pipeline.producer.sampled


def test_k0_is_the_synchronous_loop(tmp_path):
    """max_staleness=0 (the default) takes today's path: no producer, no snapshots in the
    run state or its checkpoint, the sampler's own log-probs, no staleness metrics; an
    explicit 0 is the default bit for bit."""
    default = small_trainer(tmp_path / "default", iterations=2, export_final=False)
    assert default.config.sampling.max_staleness == 0 and default.parts.spec.sampler_logprobs_used
    rows = default.train()
    assert default.parts.pipeline is None and default.run.behind is None
    assert "behind" not in default.run.checkpoint_tree()
    assert not any(name.startswith("rollout/") for name in rows[0])
    explicit = small_trainer(tmp_path / "explicit", iterations=2, export_final=False, max_staleness=0).train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in rows] == [drop(r) for r in explicit]


def test_a_failed_snapshot_refuses_every_later_sample(tmp_path):
    """The weights of iteration 2 (after iteration 1's update) never reach the sampler (the
    copy fails): the run stops with an error naming it before any work of iteration 2,
    its checkpoint and metrics are those of iteration 2, and nothing is sampled from older
    weights for iteration 3 (k = 1: it needs version 2)."""
    trainer = small_trainer(tmp_path, iterations=6, max_staleness=1, export_final=False)
    take, calls = trainer.parts.pipeline.snapshots.take, []

    def failing(train):
        calls.append(1)
        if len(calls) == 3:  # 1: version 0 when the pipeline starts, 2: version 1, 3: version 2
            raise RuntimeError("device to device copy failed (injected)")
        return take(train)

    trainer.parts.pipeline.snapshots.take = failing
    with pytest.raises(jaxppo.RunError, match=r"iteration 2: the parameters of iteration 2 could not be handed to "
                                               r"the sampler \(RuntimeError: device to device copy failed"):
        trainer.train()
    assert trainer.iteration == 2 and len(trainer.history) == 2
    assert max(i for i, _ in trainer_sampled(trainer)) <= 2  # iteration 3 needs version 2: never sampled
    resumed = small_trainer(tmp_path, iterations=6, max_staleness=1, export_final=False)
    assert resumed.directory.open(resumed.run, resumed.settings()).iteration == 2
    resumed.directory.close()


def test_a_reward_error_stops_the_run_at_its_own_iteration(tmp_path):
    """The reward function fails on iteration 2's batch (scored in the producer while
    iteration 1 trains): iterations 0 and 1 complete with their metrics and checkpoint, the
    error is the one the synchronous loop raises, before iteration 2's update."""
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        if len(calls) == 3:
            raise ZeroDivisionError("injected")
        return demo.lowercase_reward(prompts, responses)

    trainer = small_trainer(tmp_path, iterations=5, max_staleness=1, export_final=False, reward_fns=reward)
    with pytest.raises(jaxppo.RewardError, match=r"iteration 2: reward function '.*reward' raised ZeroDivisionError: "
                                                 r"injected .*nothing was updated"):
        trainer.train()
    assert trainer.iteration == 2 and [r["iteration"] for r in trainer.history] == [0, 1]


def test_a_skipped_iteration_hands_on_its_unchanged_parameters(tmp_path):
    """skip_nonfinite_scores under a pipeline: iteration 1's scores are NaN (scored in the
    producer), so it is skipped without an update; the run goes on, sampling iteration 2
    from version 1 and iteration 3 from version 2 (the same parameters: nothing changed)."""
    calls = []

    def reward(prompts, responses):
        calls.append(1)
        scores = demo.lowercase_reward(prompts, responses)
        return [float("nan")] * len(scores) if len(calls) == 2 else scores

    trainer = small_trainer(tmp_path, iterations=4, max_staleness=1, export_final=False, reward_fns=reward,
                            skip_nonfinite_scores=True)
    with pytest.warns(RuntimeWarning, match="iteration 1 skipped"):
        rows = trainer.train()
    assert [r["ppo/updates_applied"] for r in rows] == [4, 0, 4, 4]
    assert [rows[i]["rollout/policy_version"] for i in (0, 2, 3)] == [0, 1, 2]
    assert trainer.run.skipped_iterations == 1 and trainer_sampled(trainer) == [(0, 0), (1, 0), (2, 1), (3, 2)]


def test_split_mesh_matches_one_device(tmp_path):
    """sampler_devices=4 of 8: the sampler on a mesh of its own, the trainer on the other
    four, snapshots moved device to device; the same metrics and parameters as one device
    with the same k."""
    require_devices(8)
    ppo = jaxppo.Config.for_algorithm("grpo", **GRPO)
    single = small_trainer(tmp_path / "single", iterations=3, max_staleness=1, ppo=ppo, export_final=False)
    expected = single.train()
    split = small_trainer(tmp_path / "split", iterations=3, max_staleness=1, ppo=ppo, export_final=False,
                          sampler_devices=4)
    assert split.parts.sampler_mesh.devices.size == 4 and split.parts.mesh.devices.size == 4
    assert not set(split.parts.sampler_mesh.devices.flat) & set(split.parts.mesh.devices.flat)
    rows = split.train()
    assert {d for leaf in jax.tree.leaves(split.run.behind) for d in leaf.devices()} == set(split.parts.sampler_mesh.devices.flat)
    for a, b in zip(expected, rows):
        assert a["reward"] == b["reward"]
        for name in ("loss/total_avg", "policy/approxkl_avg", "sampling/importance_sampling_ratio/mean"):
            assert a[name] == pytest.approx(b[name], rel=1e-4, abs=1e-6), name
    for a, b in zip(jax.tree.leaves(single.state.params), jax.tree.leaves(split.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("settings, message", [
    (dict(max_staleness=-1), r"max_staleness=-1 is invalid: max_staleness must be an int >= 0"),
    (dict(max_staleness=1.5), r"max_staleness=1.5 is invalid"),
    (dict(sampler_devices=2), r"sampler_devices=2 .* set SamplingConfig.max_staleness >= 1"),
], ids=["negative", "float", "split-without-pipeline"])
def test_bad_pipeline_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxppo.Config.from_settings(**settings)


def test_split_mesh_settings_are_refused_before_anything_compiles(tmp_path):
    require_devices(8)
    with pytest.raises(ValueError, match=r"sampler_devices=8 leaves no device to train on: 8 devices exist"):
        small_trainer(tmp_path / "a", max_staleness=1, sampler_devices=8)
    with pytest.raises(ValueError, match=r"batch_size=16 must split evenly over the 3 sampler devices"):
        small_trainer(tmp_path / "b", max_staleness=1, sampler_devices=3)
    from jaxppo import sharding

    everything = sharding.make_mesh(sharding.MeshConfig())
    with pytest.raises(ValueError, match=r"the trainer's mesh uses devices .* the last 4"):
        small_trainer(tmp_path / "c", max_staleness=1, sampler_devices=4, mesh=everything)


@pytest.mark.parametrize("on_update", ["keep", "recompute"])
def test_inflight_updates_take_newer_versions_within_the_bound(tmp_path, monkeypatch, on_update):
    """The continuous sampler under a pipeline with in-flight updates, its decode
    slowed (50 ms before each check for new parameters) so that the trainer publishes
    versions while it generates: tokens come from newer versions than the iteration
    started from, every token's version lies between max(0, i - k) and i, and the run
    trains to the end."""
    newest = Producer._newest
    monkeypatch.setattr(Producer, "_newest", lambda self, iteration: (time.sleep(0.05), newest(self, iteration))[1])
    ppo = jaxppo.Config.for_algorithm("grpo", **GRPO)
    trainer = small_trainer(tmp_path, iterations=5, max_staleness=2, ppo=ppo, export_final=False, num_slots=4,
                            inflight_updates=on_update, inflight_steps=1)
    rows = trainer.train()
    for i, row in enumerate(rows):
        assert version_of(i, 2) <= row["rollout/policy_version"] <= i
        assert 0 <= row["rollout/staleness_mean"] <= row["rollout/staleness_max"] <= min(i, 2)
    assert any(row["rollout/staleness_mean"] < min(i, 2) for i, row in enumerate(rows))  # fresher than the bound
    assert all(r["ppo/updates_applied"] == 2 for r in rows)


@pytest.mark.parametrize("settings, message", [
    (dict(inflight_updates="later", max_staleness=1, num_slots=4), r"inflight_updates='later' is invalid"),
    (dict(inflight_updates="keep", max_staleness=1), r"it needs SamplingConfig.num_slots \(the continuous sampler\)"),
    (dict(inflight_updates="keep", num_slots=4), r"it needs SamplingConfig.max_staleness >= 1"),
    (dict(inflight_updates="keep", max_staleness=1, num_slots=4, inflight_steps=0),
     r"inflight_steps=0 is invalid: inflight_steps must be a positive int"),
], ids=["unknown", "no-slots", "no-pipeline", "steps"])
def test_bad_inflight_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxppo.Config.from_settings(**settings)
