"""The trainer with the critic-free algorithms: group sampling, no critic, no reference
when no KL is used, the first update exactly on-policy, reward functions with dataset
columns, weights and None, metrics, resume, and the refusals."""

import json

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.algorithms import ALGORITHMS
from jaxppo.run import iteration

TOKENIZER = demo.demo_tokenizer()


def grpo_trainer(tmp_path, name="grpo", iterations=1, ppo=None, prompts=None, reward_fns=demo.lowercase_reward,
                 **kwargs):
    ppo = ppo or jaxppo.Config.for_algorithm(name, batch_size=8, mini_batch_size=4, ppo_epochs=2,
                                                num_generations=4 if name != "reinforce_pp" else 1)
    tc = dict(iterations=iterations, query_length=32, response_length=6, learning_rate=1e-3,
              output_dir=str(tmp_path), progress=False, sample_every=0, export_final=False, plot=False,
              report_to="jsonl", **kwargs.pop("trainer", {}))
    tc.update(jaxppo.AdapterConfig.of(kwargs.pop("lora", None), kwargs.pop("lora_init", None)))  # LoRA: settings
    rewards = {"reward_fns": reward_fns}
    return jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(TOKENIZER, width=32, layers=1, max_len=38),
                             tokenizer=TOKENIZER, prompts=prompts or demo.DEMO_PROMPTS, **rewards, **kwargs)


EPS = float(np.finfo(np.float32).eps)
# The ulp of a log-prob at the scale of these tiny models' (about -6 over 384 tokens; at most
# 16 in magnitude here): a per-token log-ratio of a few of these is rounding.
LOGPROB_ULP = float(np.spacing(np.float32(16.0)))


def assert_on_policy(row):
    """The first update's mean ratio within 4 ulps of 1, and its approxkl (half the mean
    squared per-token log-ratio) within that of a log-ratio of 4 log-prob ulps."""
    assert abs(row["val/ratio"] - 1.0) <= 4 * EPS, row["val/ratio"]
    assert 0.0 <= row["policy/approxkl_avg"] <= 0.5 * (4 * LOGPROB_ULP) ** 2, row["policy/approxkl_avg"]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_first_update_is_on_policy(tmp_path, name):
    """Sampler, rollout scoring and loss agree on positions (left-padded prompts of
    different lengths): with one update per iteration, its ratio is 1 within float32
    rounding. Not bit for bit: the rollout's forward pass and the loss's forward (inside the
    gradient) are different compiled programs, and XLA may fuse and round their log-softmax
    differently (on this AVX2 CPU they differ by an ulp on a few tokens; a position off by
    one would move the ratio by far more)."""
    ppo = jaxppo.Config.for_algorithm(name, batch_size=8, mini_batch_size=8, ppo_epochs=1,
                                         num_generations=1 if name in ("ppo", "reinforce_pp") else 4,
                                         # 6-token completions rarely stop: DAPO's masking of truncated ones
                                         # would leave no token to measure the ratio on (tests/test_shaping.py
                                         # runs the preset with it)
                                         mask_truncated_completions=False)
    # On-policy distillation needs its teacher (another random policy of the same vocabulary).
    teacher = {"teacher": demo.demo_policy(TOKENIZER, seed=1, width=32, layers=1, max_len=38)} if name == "distill" else {}
    trainer = grpo_trainer(tmp_path, ppo=ppo, **teacher)
    assert trainer.parts.table.mask.min(axis=1).max() == 0  # the prompts are left-padded
    row = trainer.step()
    assert_on_policy(row)
    assert row["ppo/updates_applied"] == 1
    has_critic = name == "ppo"
    assert ("loss/value_avg" in row) == has_critic
    if not has_critic:
        assert not any(k in trainer.state.params for k in ("critic", "policy"))  # the policy's own params only
        assert "value_head" not in trainer.state.params["params"]
    assert (trainer.parts.ref_params is None) == (not ppo.needs_reference)
    assert ("objective/kl" in row) == (trainer.parts.ref_params is not None)


def test_groups_metrics_and_counts(tmp_path):
    trainer = grpo_trainer(tmp_path, iterations=2)
    rows = trainer.prompt_indices(0)
    groups = rows.reshape(2, 4)
    assert (groups == groups[:, :1]).all() and len(set(groups[:, 0])) == 2  # 2 prompts x 4 completions, consecutive
    history = trainer.train()
    assert [r["episode"] for r in history] == [8, 16]
    assert all(r["ppo/updates_applied"] == 2 * 8 // 4 for r in history)
    for name in ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                 "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl",
                 "rewards/lowercase_reward/mean", "rewards/lowercase_reward/std"]:
        assert name in history[-1] and np.isfinite(history[-1][name]), name
    assert 0.0 <= history[-1]["frac_reward_zero_std"] <= 1.0


def test_resume_gives_the_uninterrupted_metrics(tmp_path):
    straight = grpo_trainer(tmp_path / "a", iterations=3).train()
    grpo_trainer(tmp_path / "b", iterations=2, trainer=dict(checkpoint_every=1)).train()
    resumed = grpo_trainer(tmp_path / "b", iterations=3, trainer=dict(checkpoint_every=1)).train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]


def test_reward_functions_with_columns_weights_and_none(tmp_path):
    rows = [{"prompt": p, "answer": p.split()[0].lower(), "level": i % 3} for i, p in enumerate(demo.DEMO_PROMPTS)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    calls = []

    def exact(prompts, completions, answer):  # takes one column by name
        calls.append(("exact", list(prompts), list(completions), list(answer)))
        return [float(c.strip().lower() == a) for c, a in zip(completions, answer)]

    def odd_rows(prompts, completions, **columns):  # takes every column; no opinion on even rows
        calls.append(("odd", sorted(columns), [int(x) for x in columns["level"]]))
        return [float(len(c)) if i % 2 else None for i, c in enumerate(completions)]

    trainer = grpo_trainer(tmp_path / "run", prompts=str(path), reward_fns=[exact, odd_rows],
                           reward_weights=[1.0, 0.5])
    row = trainer.step()
    (_, prompts, completions, answers), (_, column_names, levels) = calls
    by_prompt = {r["prompt"]: r for r in rows}
    assert answers == [by_prompt[p]["answer"] for p in prompts] and column_names == ["answer", "level"]
    assert levels == [by_prompt[p]["level"] for p in prompts]
    exact_scores = np.array([float(c.strip().lower() == a) for c, a in zip(completions, answers)])
    odd = np.array([len(c) if i % 2 else 0.0 for i, c in enumerate(completions)], np.float64)
    assert row["reward"] == pytest.approx(np.mean(exact_scores + 0.5 * odd), rel=1e-6)
    assert row["rewards/odd_rows/mean"] == pytest.approx(np.mean(odd[1::2]), rel=1e-6)
    assert row["rewards/odd_rows/scored_fraction"] == 0.5
    assert row["rewards/exact/scored_fraction"] == 1.0


def test_reward_function_faults_name_function_and_row(tmp_path):
    def nobody(prompts, completions):
        return [None] * len(completions)

    def fine(prompts, completions):
        return [1.0] * len(completions)

    trainer = grpo_trainer(tmp_path / "a", reward_fns=[nobody])
    with pytest.raises(jaxppo.RewardError, match="'nobody' returned None at row 0 .*at least one reward function"):
        trainer.step()
    trainer = grpo_trainer(tmp_path / "b", reward_fns=[fine, nobody])  # the other function scores every row
    assert trainer.step()["rewards/nobody/scored_fraction"] == 0.0

    def short(prompts, completions):
        return [1.0]

    with pytest.raises(jaxppo.RewardError, match="'short' returned 1 scores for 8 responses"):
        grpo_trainer(tmp_path / "c", reward_fns=[fine, short]).step()
    with pytest.raises(ValueError, match="reward_weights has 1 weights for 2 reward_fns"):
        grpo_trainer(tmp_path / "d", reward_fns=[fine, short], reward_weights=[1.0])


def test_critic_free_refuses_a_critic_and_settings_stay_compatible(tmp_path):
    with pytest.raises(ValueError, match="critic was given, but advantage_estimator='grpo' has no critic"):
        grpo_trainer(tmp_path, critic=demo.demo_policy(TOKENIZER, width=32, layers=1, max_len=38))
    with pytest.raises(ValueError, match="shared_trunk=True .* has no critic"):
        grpo_trainer(tmp_path, trainer=dict(shared_trunk=True))
    # Runs saved before the algorithm settings existed resume: settings at their defaults
    # (PPO's here) compare as absent, as a record of then holds them.
    from jaxppo.config.record import comparable

    ppo = grpo_trainer(tmp_path, ppo=jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4))
    assert ppo.settings()["advantages"]["advantage_estimator"] == "gae"
    assert "advantage_estimator" not in comparable(ppo.settings()) and "kl_loss_coef" not in comparable(ppo.settings())
    assert comparable(grpo_trainer(tmp_path).settings())["advantage_estimator"] == "grpo"


def test_a_reward_model_can_be_one_of_the_reward_functions(tmp_path):
    model, _ = demo.demo_policy(TOKENIZER, width=32, layers=1, max_len=38)
    rm = jaxppo.models.Model(model.config, kind="reward")
    rm_params = rm.init(jax.random.key(1))

    def length(prompts, completions):
        return [float(len(c)) for c in completions]

    row = grpo_trainer(tmp_path, reward_fns=[(rm, rm_params), length], reward_weights=[2.0, 1.0]).step()
    assert row["reward"] == pytest.approx(2.0 * row["rewards/reward_model/mean"] + row["rewards/length/mean"],
                                          rel=1e-5, abs=1e-6)
    assert row["rewards/reward_model/std"] > 0.0  # the model's own scores, one per completion


def test_ids_past_the_tokenizer_decode_as_unknown():
    """A policy whose vocabulary is padded past its tokenizer can sample ids the tokenizer
    does not know; reward functions get text (the unknown token), not a crash."""
    from jaxppo.models.tokenizer import decode_responses, unknown_token_count

    tokens = np.array([[ord("h") + 3, 5000, ord("i") + 3, 0]])
    mask = np.array([[1, 1, 1, 0]])
    assert decode_responses(TOKENIZER, tokens, mask) == ["hi"]  # ByT5's <unk> is a special token: skipped
    assert unknown_token_count(TOKENIZER, tokens, mask) == 1


def test_a_lone_reward_model_entry_keeps_its_weight(tmp_path):
    model, _ = demo.demo_policy(TOKENIZER, width=32, layers=1, max_len=38)
    rm = jaxppo.models.Model(model.config, kind="reward")
    rm_params = rm.init(jax.random.key(1))
    one = grpo_trainer(tmp_path / "a", reward_fns=[(rm, rm_params)], reward_weights=[1.0]).step()
    two = grpo_trainer(tmp_path / "b", reward_fns=[(rm, rm_params)], reward_weights=[2.0]).step()
    assert two["objective/raw_scores"] == pytest.approx(2.0 * one["objective/raw_scores"], rel=1e-6)


@pytest.mark.parametrize("mini_batch_size", [1, 2, 4])
def test_first_update_is_on_policy_within_rounding_at_smaller_mini_batches(tmp_path, mini_batch_size):
    """What holds when a mini-batch is smaller than the batch: the rollout is scored over all
    `batch_size` rows and the loss over `mini_batch_size` rows, and XLA tiles matmuls of
    different row counts differently, so the first update's per-token ratios are 1 within
    float32 rounding (a few ulps), not bit for bit. Measured through the stages, on the
    first mini-batch of the first epoch, whose parameters are the sampling ones."""
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=mini_batch_size, ppo_epochs=1,
                                         num_generations=4)
    trainer = grpo_trainer(tmp_path, ppo=ppo)
    run = trainer.run
    k_sample, k_train = run.iteration_keys(0)
    batch = iteration.select_prompts(trainer.parts.table, run.key, 0, ppo)
    gen = iteration.sample(trainer.parts.spec, run.train.params, batch, k_sample)
    scores = iteration.reward(trainer.parts.host_rewards, TOKENIZER, trainer.parts.table, batch, gen, 0)
    built = iteration.build(trainer.parts.spec, run.train.params, trainer.parts.ref_params, None, batch, gen, scores, run)
    _, metrics = jaxppo.train_step(run.train, built.rollout, k_train, ppo)
    ratio = float(metrics["per_minibatch/val/ratio"][0, 0])
    eps = float(np.finfo(np.float32).eps)
    assert abs(ratio - 1.0) <= 4 * eps, ratio
    # Per token, the log-ratio is a difference of two log-probs near -6 (vocabulary 384),
    # rounded at their own scale: its root mean square is within 4 ulps of the largest
    # |log-prob| (approxkl = 0.5 * mean(log-ratio^2)).
    ulp = float(np.spacing(np.abs(np.asarray(built.rollout.logprobs)).max()))
    approxkl = float(metrics["per_minibatch/policy/approxkl"][0, 0])
    assert approxkl <= 0.5 * (4 * ulp) ** 2, (approxkl, ulp)
