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

    tok, student, teacher = models
    config = settings(tmp_path, iterations=1).replace(lora_rank=2, lora_alpha=4, lora_targets="all-linear")
    trainer = jaxppo.Trainer(config, policy=student, tokenizer=tok, prompts=demo.DEMO_PROMPTS, teacher=teacher)
    assert trainer.parts.ref_params is not None and not trainer.parts.spec.ref_is_policy
    trainer.train()
    assert metrics(tmp_path)[0]["distill/reverse_kl"] > 0.5  # a teacher unlike the student (its base gives 0)


@pytest.mark.parametrize("case, message", [
    ("no teacher", r"advantage_estimator='distill' distils from a teacher: give teacher= \(--teacher\)"),
    ("teacher without distill", r"teacher= \(--teacher\) is read by on-policy distillation"),
    ("teacher and reference", r"give teacher= \(--teacher\) or ref_policy= \(--ref-model\), not both"),
    ("another vocabulary", r"teacher= \(--teacher\) has a vocabulary of 300 tokens and the policy one of"),
    ("weight without groups", r"task_reward_weight=0.5 is invalid: task_reward_weight must be 0 with "
                              r"BatchConfig.num_generations=1"),
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


# ------------------------------------------------- the teacher's top k (distill_top_k)


def coarsened_kl_loop(student_logp, teacher_logp, ids, kind):
    """Per position: KL between the two distributions over the teacher's top-k ids and one
    outcome for every other token, summed term by term (float64)."""
    b, t, _ = student_logp.shape
    out = np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            q = [np.exp(student_logp[i, j, v]) for v in ids[i, j]]
            p = [np.exp(teacher_logp[i, j, v]) for v in ids[i, j]]
            q.append(1.0 - sum(q))
            p.append(1.0 - sum(p))
            a, c = (q, p) if kind == "reverse" else (p, q)
            out[i, j] = sum(x * (np.log(x) - np.log(y)) for x, y in zip(a, c))
    return out


def log_softmax64(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize("kind", ["reverse", "forward"])
def test_the_top_k_divergence_equals_a_loop_and_the_full_one_at_the_vocabulary(kind):
    from jaxppo.update.losses import top_k_divergence

    rng = np.random.default_rng(0)
    v, k = 13, 4
    student, teacher = log_softmax64(2 * rng.normal(size=(2, 3, v))), log_softmax64(2 * rng.normal(size=(2, 3, v)))
    ids = np.argsort(-teacher, axis=-1)
    take = lambda logp, n: np.take_along_axis(logp, ids[..., :n], -1).astype(np.float32)  # noqa: E731
    got = np.asarray(top_k_divergence(take(student, k), take(teacher, k), kind))
    np.testing.assert_allclose(got, coarsened_kl_loop(student, teacher, ids[..., :k], kind), rtol=1e-4, atol=1e-6)
    # k = V: the whole distributions, the bucket empty: the KL itself.
    a, c = (student, teacher) if kind == "reverse" else (teacher, student)
    full = np.sum(np.exp(a) * (a - c), axis=-1)
    np.testing.assert_allclose(np.asarray(top_k_divergence(take(student, v), take(teacher, v), kind)), full,
                               rtol=1e-4, atol=1e-6)
    # A lower bound for k < V (coarsening loses information), never negative.
    assert np.all(got <= full + 1e-6) and np.all(got >= -1e-6)


def test_the_full_vocabulary_gradient_is_the_kl_gradient():
    """At k = V the gradient through the student's gathered log-probs is the gradient of
    KL(student || teacher) written over the logits directly."""
    import jax.numpy as jnp

    from jaxppo.update.losses import top_k_divergence

    rng = np.random.default_rng(1)
    v = 9
    logits = jnp.asarray(rng.normal(size=(2, 3, v)), jnp.float32)
    teacher = jax.nn.log_softmax(jnp.asarray(2 * rng.normal(size=(2, 3, v)), jnp.float32))
    ids = jnp.argsort(-teacher, axis=-1)

    def through_top_k(x):
        q = jnp.take_along_axis(jax.nn.log_softmax(x), ids, -1)
        return jnp.sum(top_k_divergence(q, jnp.take_along_axis(teacher, ids, -1), "reverse"))

    def kl(x):
        q = jax.nn.log_softmax(x)
        return jnp.sum(jnp.exp(q) * (q - teacher))

    np.testing.assert_allclose(np.asarray(jax.grad(through_top_k)(logits)), np.asarray(jax.grad(kl)(logits)),
                               rtol=1e-4, atol=1e-6)


def test_the_model_keeps_the_top_k_and_scores_more_ids_as_its_full_logits_do(models):
    """`Model.response_top_logprobs` (the teacher's pass) and `response_outputs(also=...)`
    / `grouped_outputs(also=...)` (the student's, chunked or not) against log-softmax of
    `apply`'s full logits."""
    import jax.numpy as jnp

    tok, (model, params), _ = models
    rng = np.random.default_rng(2)
    b, q, r, k, v = 4, 5, 7, 6, model.config.vocab_size
    queries = jnp.asarray(np.repeat(rng.integers(0, v, size=(2, q)), 2, axis=0), jnp.int32)
    qmask = jnp.asarray(np.repeat([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], 2, axis=0), jnp.int32)
    responses = jnp.asarray(rng.integers(0, v, size=(b, r)), jnp.int32)
    rmask = jnp.asarray(np.arange(r)[None] < np.array([[7], [3], [5], [1]]), jnp.int32)
    tokens = jnp.concatenate([queries, responses], 1)
    full = log_softmax64(model.apply(params, tokens, jnp.concatenate([qmask, rmask], 1))[:, q - 1: q - 1 + r])
    live = np.asarray(rmask, bool)
    taken, top, ids = model.response_top_logprobs(params, queries, qmask, responses, rmask, k)
    order = np.argsort(-full, axis=-1)[..., :k]
    np.testing.assert_array_equal(np.asarray(ids)[live], order[live])
    np.testing.assert_allclose(np.asarray(top)[live], np.take_along_axis(full, order, -1)[live], atol=2e-5)
    np.testing.assert_allclose(np.asarray(taken)[live],
                               np.take_along_axis(full, np.asarray(responses)[..., None], -1)[..., 0][live], atol=2e-5)
    also = jnp.asarray(rng.integers(0, v, size=(b, r, 3)), jnp.int32)
    want = np.take_along_axis(full, np.concatenate([np.asarray(responses)[..., None], np.asarray(also)], -1), -1)
    chunked = dataclasses.replace(model, logits_chunk_size=3)
    for m in (model, chunked):
        got = m.response_outputs(params, queries, qmask, responses, rmask, 1.0, also=also)[0]
        np.testing.assert_allclose(np.asarray(got)[live], want[live], atol=2e-5)
        got = m.grouped_outputs(params, queries[::2], qmask[::2], responses, rmask, 1.0, also=also)[0]
        np.testing.assert_allclose(np.asarray(got)[live], want[live], atol=2e-5)
        np.testing.assert_allclose(np.asarray(m.response_top_logprobs(params, queries, qmask, responses, rmask, k)[1]),
                                   np.asarray(top), atol=1e-6)


def test_top_k_distillation_moves_the_student_and_resumes_exactly(models, tmp_path):
    tok, student, teacher = models
    copy = lambda pair: (pair[0], jax.tree.map(np.array, pair[1]))  # noqa: E731

    def run(out, iterations, **changes):
        config = settings(tmp_path, output_dir=str(out), iterations=iterations, distill_top_k=16,
                          checkpoint_every=1, **changes)
        return jaxppo.Trainer(config, policy=copy(student), tokenizer=tok, prompts=demo.DEMO_PROMPTS,
                              teacher=copy(teacher)).train()

    straight = run(tmp_path / "a", 8)
    divergence = [m["loss/distill_avg"] for m in straight]
    assert divergence[0] > 0.1 and np.mean(divergence[-2:]) < 0.5 * np.mean(divergence[:2])
    # the sampled tokens' estimate of the whole reverse KL falls with it
    kl = [m["distill/reverse_kl"] for m in straight]
    assert np.mean(kl[-3:]) < 0.7 * kl[0]
    assert all(m["ppo/advantages/mean"] == 0.0 for m in straight)  # the teacher's signal is in the loss alone
    run(tmp_path / "b", 5)  # killed after iteration 5 (its checkpoint), then resumed to the end
    resumed = run(tmp_path / "b", 8)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}  # noqa: E731
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]


@pytest.mark.parametrize("case, message", [
    ("top k without distill", r"distill_top_k=8 is invalid: distill_top_k must be 0 with advantage_estimator='grpo'"),
    ("divergence without distill", r"distill_divergence='forward' is invalid: distill_divergence must be 'reverse'"),
    ("unknown divergence", r"distill_divergence='jsd' is invalid: distill_divergence must be one of 'reverse', "
                           r"'forward'"),
    ("negative top k", r"distill_top_k=-1 is invalid: distill_top_k must be an int >= 0"),
    ("top k and packing", r"pack_sequences=True is invalid: pack_sequences must be False with "
                          r"AdvantageConfig.distill_top_k=8"),
    ("divergence without top k", r"distill_divergence='forward' is invalid: distill_divergence must be 'reverse' "
                                 r"with AdvantageConfig.distill_top_k=0"),
])
def test_bad_top_k_settings(case, message):
    grpo = dict(batch_size=16, mini_batch_size=8, num_generations=4)
    make = {
        "top k without distill": lambda: jaxppo.Config.for_algorithm("grpo", distill_top_k=8, **grpo),
        "divergence without distill": lambda: jaxppo.Config.for_algorithm("grpo", distill_divergence="forward",
                                                                          **grpo),
        "unknown divergence": lambda: jaxppo.Config.for_algorithm("distill", distill_divergence="jsd"),
        "negative top k": lambda: jaxppo.Config.for_algorithm("distill", distill_top_k=-1),
        "top k and packing": lambda: jaxppo.Config.for_algorithm("distill", distill_top_k=8, pack_sequences=True),
        "divergence without top k": lambda: jaxppo.Config.for_algorithm("distill", distill_divergence="forward"),
    }[case]
    with pytest.raises(ValueError, match=message):
        make()


def test_a_top_k_beyond_the_vocabulary_and_a_rollout_without_the_teacher_top_are_refused(models, tmp_path):
    import jax.numpy as jnp
    import optax

    tok, student, teacher = models
    v = student[0].config.vocab_size
    with pytest.raises(ValueError, match=rf"distill_top_k={v + 1} is invalid: distill_top_k must be in \[0, {v}\]"):
        jaxppo.Trainer(settings(tmp_path, distill_top_k=v + 1), policy=student, tokenizer=tok,
                       prompts=demo.DEMO_PROMPTS, teacher=teacher)
    config = jaxppo.Config.for_algorithm("distill", batch_size=2, mini_batch_size=2, distill_top_k=4)
    zeros = jnp.zeros((2, 3), jnp.float32)
    rollout = jaxppo.RolloutBatch(query_tokens=jnp.ones((2, 2), jnp.int32), query_mask=jnp.ones((2, 2), jnp.int32),
                                  response_tokens=jnp.ones((2, 3), jnp.int32), response_mask=jnp.ones((2, 3), jnp.int32),
                                  logprobs=zeros, values=None, rewards=zeros, ref_logprobs=zeros)
    state = jaxppo.TrainState.create(apply_fn=teacher[0].apply, params=teacher[1], tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"distill_top_k=4 needs the teacher's top 4 log-probs and ids"):
        jaxppo.train_step(state, rollout, jax.random.key(0), config)
    wrong = rollout.replace(teacher_top_logprobs=jnp.zeros((2, 3, 5)), teacher_top_ids=jnp.zeros((2, 3, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"rollout.teacher_top_logprobs has shape \(2, 3, 5\); expected"):
        jaxppo.train_step(state, wrong, jax.random.key(0), config)
