"""On-policy distillation through the trainer: the teacher in the reference's place, its
per-token reverse KL as the advantage (the estimator itself is checked against a loop, and
its train_step against a loop of updates, in tests/test_critic_free_step.py), the student
moving towards the teacher, and the bad input."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.algorithms.distill import reverse_kl_advantages


def settings(tmp_path, **changes):
    base = dict(batch_size=16, mini_batch_size=8, ppo_epochs=1, iterations=2, query_length=32, response_length=8,
                learning_rate=3e-3, output_dir=str(tmp_path / "run"), report_to="jsonl", sample_every=0)
    return jaxppo.Config.for_algorithm("distill", **{**base, **changes})


@pytest.fixture
def models():
    """The tokenizer, a student and a teacher (fresh copies: a trainer owns and donates them)."""
    tok = demo.demo_tokenizer()
    return tok, demo.demo_policy(tok, seed=0), demo.demo_policy(tok, seed=1)


def metrics(tmp_path):
    return [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]


def test_the_reverse_kl_advantage_is_a_per_token_difference():
    logp = np.log(np.array([[0.5, 0.25, 0.9]], np.float32))
    teacher = np.log(np.array([[0.25, 0.5, 0.1]], np.float32))
    got = np.asarray(reverse_kl_advantages(logp, teacher, np.array([[1, 1, 0]])))
    np.testing.assert_allclose(got, [[np.log(0.5), np.log(2.0), 0.0]], rtol=1e-6)


def test_a_teacher_equal_to_the_student_gives_no_signal(models, tmp_path):
    tok, student, _ = models
    teacher = (student[0], jax.tree.map(np.array, student[1]))
    trainer = jaxppo.Trainer(settings(tmp_path, iterations=1), policy=student,
                             tokenizer=tok, prompts=demo.DEMO_PROMPTS, teacher=teacher)
    trainer.train()
    m = metrics(tmp_path)[0]
    assert m["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert m["ppo/advantages/mean"] == pytest.approx(0.0, abs=1e-5)
    assert "objective/scores" in m  # no reward: scores are 0


def test_the_student_moves_towards_the_teacher(models, tmp_path):
    tok, student, teacher = models
    trainer = jaxppo.Trainer(settings(tmp_path, iterations=12), policy=student, tokenizer=tok,
                             prompts=demo.DEMO_PROMPTS, teacher=teacher)
    trainer.train()
    kl = [m["distill/reverse_kl"] for m in metrics(tmp_path)]
    assert kl[0] > 0.5 and np.mean(kl[-3:]) < 0.6 * np.mean(kl[:3])
    # The run records its teacher (a resumed run must match it).
    saved = json.load(open(tmp_path / "run" / "run_settings.json"))
    assert "teacher" in json.dumps(saved)


def test_task_rewards_mixed_in_with_a_weight(models, tmp_path):
    tok, student, teacher = models
    config = settings(tmp_path, iterations=1, num_generations=4, task_reward_weight=0.5)
    trainer = jaxppo.Trainer(config, policy=student, tokenizer=tok, prompts=demo.DEMO_PROMPTS, teacher=teacher,
                             reward_fns=demo.lowercase_reward)
    trainer.train()
    m = metrics(tmp_path)[0]
    assert np.isfinite(m["distill/reverse_kl"]) and "frac_reward_zero_std" in m and m["objective/scores"] > 0


def test_a_lora_student_is_scored_against_the_teacher_not_its_base(models, tmp_path):
    import jaxppo.models as jm

    tok, student, teacher = models
    trainer = jaxppo.Trainer(settings(tmp_path, iterations=1), policy=student, tokenizer=tok,
                             prompts=demo.DEMO_PROMPTS, teacher=teacher, lora=jm.LoraConfig(rank=2, alpha=4, targets="all-linear"))
    assert trainer.parts.ref_params is not None and not trainer.parts.spec.ref_is_policy
    trainer.train()
    assert metrics(tmp_path)[0]["distill/reverse_kl"] > 0.5  # a teacher unlike the student (its base gives 0)


@pytest.mark.parametrize("case, message", [
    ("no teacher", r"advantage_estimator='distill' distils from a teacher: give teacher= \(--teacher\)"),
    ("teacher without distill", r"teacher= \(--teacher\) is read by on-policy distillation"),
    ("teacher and reference", r"give teacher= \(--teacher\) or ref_policy= \(--ref-model\), not both"),
    ("another vocabulary", r"teacher= \(--teacher\) has a vocabulary of 300 tokens and the policy one of"),
    ("weight without groups", r"task_reward_weight=0.5 is invalid: task_reward_weight must be 0 with "
                              r"AdvantageConfig.num_generations=1"),
    ("weight without distill", r"task_reward_weight must be 0 with advantage_estimator='grpo'"),
    ("weight without a reward", r"give a reward"),
])
def test_bad_input(models, tmp_path, case, message):
    tok, student, teacher = models
    kwargs = dict(policy=student, tokenizer=tok, prompts=demo.DEMO_PROMPTS, teacher=teacher)
    make = lambda: settings(tmp_path)
    if case == "no teacher":
        kwargs.pop("teacher")
    elif case == "teacher without distill":
        make = lambda: jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4,
                                                   query_length=32, response_length=8, output_dir=str(tmp_path))
        kwargs["reward_fns"] = demo.lowercase_reward
    elif case == "teacher and reference":
        kwargs["ref_policy"] = teacher
    elif case == "another vocabulary":
        small = dataclasses.replace(teacher[0].config, vocab_size=300)
        model = dataclasses.replace(teacher[0], config=small)
        kwargs["teacher"] = (model, model.init(jax.random.key(0)))
    elif case == "weight without groups":
        make = lambda: settings(tmp_path, task_reward_weight=0.5)
    elif case == "weight without distill":
        make = lambda: jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4,
                                                   task_reward_weight=0.5)
    elif case == "weight without a reward":
        make = lambda: settings(tmp_path, num_generations=4, task_reward_weight=0.5)
    with pytest.raises(ValueError, match=message):
        jaxppo.Trainer(make(), **kwargs)


def test_the_command(models, tmp_path):
    import jaxppo.models as jm
    from jaxppo import cli

    tok, student, teacher = models
    paths = {}
    for name, (model, params) in (("student", student), ("teacher", teacher)):
        paths[name] = str(tmp_path / name)
        jm.save_pretrained(model, params, paths[name])
        tok.save_pretrained(paths[name])
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(demo.DEMO_PROMPTS))
    out = tmp_path / "cmd"
    assert cli.main(["--algorithm", "distill", "--model", paths["student"], "--teacher", paths["teacher"],
                     "--prompts", str(prompts), "--iterations", "1", "--batch-size", "16", "--mini-batch-size", "8",
                     "--query-length", "32", "--response-length", "8", "--output-dir", str(out), "--no-progress",
                     "--report-to", "jsonl"]) == 0
    line = json.loads(open(out / "metrics.jsonl").readline())
    assert line["distill/reverse_kl"] > 0
