"""Multi-turn episodes (issue 19): the environment contract, token in / token out, the
masks, GAE and group advantages across turns, faults, the chat continuation, the demo."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.update.advantages import discounted_returns, gae
from jaxppo.update.kl import at_last_token
from jaxppo.rollout.engines.static import generate
from jaxppo.rollout.environments import EpisodeSetup, StepResult, chat_continuation, run_episodes
from jaxppo.run.iteration import select_prompts

from jaxppo.tracking import read_table

from trainer_setup import TwoTurns, run_command, small_trainer

Q, R, L = 32, 16, 4  # prompt width, response budget, tokens per turn


class OneTurn:
    """Ends every episode after one turn with the demo's lowercase score."""

    def reset(self, prompt):
        pass

    def step(self, completion):
        return StepResult(None, demo.lowercase_reward([None], [completion])[0], True)


def trainer_with(tmp_path, environment, ppo=None, **settings):
    ppo = ppo or jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1,
                                                num_generations=2)
    settings = {"response_length": R, "turn_length": L, "max_turns": 3, "export_final": False, **settings}
    return small_trainer(tmp_path, ppo=ppo, environment=environment, reward_fns=None, max_len=Q + R, **settings)


def byte_ids(text):
    return [b + 3 for b in text.encode()]  # ByT5: a byte's id is the byte + 3


@pytest.mark.parametrize("turn_cache", [False, True], ids=["reprefill", "turn-cache"])
def test_two_turn_episode_is_the_hand_built_sequence(tmp_path, turn_cache):
    """The response region is turn 1 as sampled, the observation's bytes, turn 2 as sampled
    from the hand-built context; the mask is 1, 0, 1 over them; the rewards add. With the
    cache kept between turns the second turn's log-probs equal up to rounding (the keys and
    values of its context come from the decode steps, not one prefill), exactly without."""
    trainer = trainer_with(tmp_path, TwoTurns, turn_cache=turn_cache)
    tok, spec = trainer.tokenizer, trainer.parts.spec
    params = spec.policy_params(trainer.state.params)
    batch = select_prompts(trainer.parts.table, trainer.run.key, 0, trainer.config)
    key = jax.random.key(7)
    setup = EpisodeSetup(trainer.parts.environment, trainer.parts.table, tok)
    episodes = run_episodes(setup, spec, trainer.state.params, batch, key, 0)
    out = jax.device_get(episodes.output)

    ids, mask = trainer.parts.table.ids[batch.rows], trainer.parts.table.mask[batch.rows]
    common = dict(response_length=L, temperature=spec.temperature, stop_token_ids=spec.stop_token_ids,
                  pad_token_id=spec.pad_token_id)
    first = jax.device_get(generate(spec.policy, params, ids, mask, key, num_generations=2,
                                    max_lengths=np.full(8, L), **common))
    contexts, budgets, expected = np.zeros((8, Q + R), np.int32), [], []
    context_mask = np.zeros((8, Q + R), np.int32)
    for i in range(8):
        turn1 = first.tokens[i, :first.mask[i].sum()].tolist()
        sequence = ids[i][mask[i] > 0].tolist() + turn1 + byte_ids("ok")
        contexts[i, Q + R - len(sequence):], context_mask[i, Q + R - len(sequence):] = sequence, 1
        budgets.append(min(L, R - len(turn1) - 2))
        expected.append(turn1)
    second = jax.device_get(generate(spec.policy, params, contexts, context_mask, jax.random.fold_in(key, 1),
                                     max_lengths=np.asarray(budgets), **common))
    for i in range(8):
        turn1, turn2 = expected[i], second.tokens[i, :second.mask[i].sum()].tolist()
        n = len(turn1) + 2 + len(turn2)
        np.testing.assert_array_equal(out.tokens[i, :n], turn1 + byte_ids("ok") + turn2)
        assert (out.tokens[i, n:] == spec.pad_token_id).all()
        np.testing.assert_array_equal(out.mask[i], [1] * len(turn1) + [0, 0] + [1] * len(turn2) + [0] * (R - n))
        np.testing.assert_array_equal(out.attention_mask[i], [1] * n + [0] * (R - n))
        np.testing.assert_allclose(out.logprobs[i, :len(turn1)], first.logprobs[i, :len(turn1)], rtol=0, atol=0)
        np.testing.assert_allclose(out.logprobs[i, len(turn1) + 2:n], second.logprobs[i, :len(turn2)], rtol=0,
                                   atol=2e-5 if turn_cache else 0)
        assert out.logprobs[i, len(turn1):len(turn1) + 2].tolist() == [0.0, 0.0]
        text2 = tok.decode(turn2, skip_special_tokens=True)
        assert episodes.rewards[i] == pytest.approx(0.5 + len(text2))
    assert not out.truncated.any()
    assert episodes.metrics["env/turns_mean"] == 2.0 and episodes.metrics["env/observation_tokens"] == 2.0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_multiturn_iteration_scores_the_sampled_tokens_on_policy(tmp_path, algorithm):
    """Through the trainer (GRPO; PPO with its critic and GAE across the turns): the scoring
    pass over prompt + turns + observations gives the sampler's log-probs at the model's
    tokens (f32 rounding), and the metrics are logged."""
    ppo = None if algorithm == "grpo" else jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1)
    trainer = trainer_with(tmp_path, TwoTurns, ppo=ppo)
    metrics = trainer.step()
    assert metrics["sampling/sampling_logp_difference/max"] < 1e-4
    assert metrics["env/turns_mean"] == 2.0 and metrics["env/failed_episodes"] == 0
    assert metrics["rewards/environment/mean"] == pytest.approx(metrics["reward"])
    assert metrics["ppo/updates_applied"] == 2


def test_continuous_engine_plays_the_same_episodes(tmp_path):
    """Turns sampled by the continuous sampler (3 slots for 8 rows; an ended row
    takes one token of a slot) give the static sampler's episodes."""
    static = trainer_with(tmp_path / "static", TwoTurns).step()
    slots = trainer_with(tmp_path / "slots", TwoTurns, num_slots=3).step()
    for name in ("reward", "env/turns_mean", "env/observation_tokens", "completions/mean_length"):
        assert static[name] == slots[name], name
    assert static["loss/total_avg"] == pytest.approx(slots["loss/total_avg"], rel=1e-6, abs=1e-7)


def test_one_turn_episodes_equal_the_single_turn_path(tmp_path):
    """PPO (GAE, critic) where every episode ends after its first turn, scored by the
    environment, equals the single-turn trainer scored by the same function: the same
    metrics and parameters."""
    ppo = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, kl_coef=0.1)
    settings = dict(response_length=8, max_len=Q + 8, iterations=2, export_final=False, checkpoint_every=0)
    single_trainer = small_trainer(tmp_path / "single", ppo=ppo, **settings)
    single = single_trainer.train()
    multi_trainer = small_trainer(tmp_path / "multi", ppo=ppo, environment=OneTurn, reward_fns=None, **settings)
    multi = multi_trainer.train()
    for a, b in zip(single, multi):
        assert a["reward"] == b["reward"]
        for name in ("loss/total_avg", "loss/value_avg", "policy/approxkl_avg", "objective/kl"):
            assert a[name] == pytest.approx(b[name], rel=1e-6, abs=1e-7), name
    for a, b in zip(jax.tree.leaves(single_trainer.state.params), jax.tree.leaves(multi_trainer.state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def _gapped_mask(rng, b, t):
    """Rows of model turns with environment gaps inside and padding after."""
    mask = np.zeros((b, t), np.float32)
    for i in range(b):
        n = rng.integers(3, t + 1)
        mask[i, :n] = rng.random(n) < 0.7
        mask[i, 0] = 1
    return mask


def test_gae_skips_environment_tokens_like_a_loop_over_the_model_tokens():
    """GAE on a mask with gaps equals ordinary GAE over each row's model tokens alone."""
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=(2, 6, 12)).astype(np.float32)
    mask = _gapped_mask(rng, 6, 12)
    gamma, lam = 0.9, 0.8
    adv, ret = gae(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma, lam)
    returns = discounted_returns(jnp.asarray(rewards), jnp.asarray(mask), gamma)
    last = at_last_token(jnp.arange(1.0, 7.0), jnp.asarray(mask))
    for i in range(6):
        idx = np.flatnonzero(mask[i])
        r, v = rewards[i, idx], values[i, idx]
        a, running, g, acc = np.zeros(idx.size), 0.0, np.zeros(idx.size), 0.0
        for s in reversed(range(idx.size)):
            next_v = v[s + 1] if s + 1 < idx.size else 0.0
            running = r[s] + gamma * next_v - v[s] + gamma * lam * running
            a[s] = running
            acc = r[s] + gamma * acc
            g[s] = acc
        np.testing.assert_allclose(np.asarray(adv)[i, idx], a, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ret)[i, idx], a + v, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(returns)[i, idx], g, rtol=1e-5, atol=1e-5)
        assert not np.asarray(adv)[i][mask[i] == 0].any()
        expected_last = np.zeros(12)
        expected_last[idx[-1]] = i + 1
        np.testing.assert_array_equal(np.asarray(last)[i], expected_last)


def test_group_advantages_per_episode_on_the_model_tokens_only():
    """GRPO on a multi-turn rollout: each episode's advantage is its group-normalised
    score (plain loop), on its model tokens, 0 at the environment's tokens."""
    rng = np.random.default_rng(1)
    b, t, g = 8, 10, 4
    mask = _gapped_mask(rng, b, t)
    attention = (np.arange(t)[None] <= np.array([np.flatnonzero(m)[-1] for m in mask])[:, None]).astype(np.int32)
    scores = rng.normal(size=b).astype(np.float32)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=b, num_generations=g, kl_loss_coef=0.0)
    rollout = jaxppo.RolloutBatch(
        query_tokens=jnp.ones((b, 3), jnp.int32), query_mask=jnp.ones((b, 3), jnp.int32),
        response_tokens=jnp.ones((b, t), jnp.int32), response_mask=jnp.asarray(mask), logprobs=jnp.zeros((b, t)),
        values=None, rewards=at_last_token(jnp.asarray(scores), jnp.asarray(mask)), scores=jnp.asarray(scores),
        response_attention_mask=jnp.asarray(attention))
    jaxppo.update.check_rollout(rollout, config)
    advantages = np.asarray(jaxppo.update.compute_advantages(rollout, config)[0])
    for i in range(b):
        group = scores[i // g * g:(i // g + 1) * g].astype(np.float64)
        expected = (scores[i] - group.mean()) / (group.std(ddof=1) + 1e-4)
        np.testing.assert_allclose(advantages[i][mask[i] > 0], expected, rtol=1e-4)
        assert not advantages[i][mask[i] == 0].any()


class Raising(TwoTurns):
    def step(self, completion):
        raise KeyError("no such state")


class WrongType(TwoTurns):
    def step(self, completion):
        return {"done": True}


class Hanging(TwoTurns):
    def step(self, completion):
        time.sleep(30)


@pytest.mark.parametrize("environment, message", [
    (Raising, r"step raised KeyError: 'no such state'"),
    (WrongType, r"step raised TypeError: step returned a dict .* must return a jaxppo.StepResult"),
    (Hanging, r"step took longer than environment_timeout=0.3 s"),
])
def test_environment_faults_name_the_environment_row_and_turn_and_update_nothing(tmp_path, environment, message):
    trainer = trainer_with(tmp_path, environment, environment_timeout=0.3)
    before = jax.tree.map(np.asarray, trainer.state.params)
    with pytest.raises(jaxppo.EpisodeError, match=rf"environment 'test_environments\.{environment.__name__}': "
                                                   rf"iteration 0, row 0, turn 1 .*{message}.*nothing was updated"):
        trainer.step()
    assert trainer.iteration == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_faulty_episodes_end_with_score_zero_when_asked(tmp_path):
    class HalfRaising(TwoTurns):
        def reset(self, prompt):
            super().reset(prompt)
            self.bad = len(prompt) % 2 == 0

        def step(self, completion):
            if self.bad:
                raise RuntimeError("broken")
            return super().step(completion)

    trainer = trainer_with(tmp_path, HalfRaising, environment_errors="end", prompts=["ab", "abc", "abcd", "abcde"])
    prompts = [trainer.parts.table.texts[r] for r in select_prompts(trainer.parts.table, trainer.run.key, 0, trainer.config).rows]
    metrics = trainer.step()
    bad = sum(len(p) % 2 == 0 for p in prompts)
    assert bad == 4 and metrics["env/failed_episodes"] == bad
    assert metrics["rewards/environment/scored_fraction"] == pytest.approx(1 - bad / 8)
    assert metrics["ppo/updates_applied"] == 2


def test_bad_environment_settings_and_imports_fail_before_compiling(tmp_path):
    from jaxppo import cli

    with pytest.raises(SystemExit, match="cannot import module 'no_such_module'"):
        cli.build_trainer(*cli.resolve(["--environment", "no_such_module:make", "--output-dir", str(tmp_path)]))
    with pytest.raises(SystemExit, match="expected MODULE:FACTORY"):
        cli.build_trainer(*cli.resolve(["--environment", "jaxppo.demo", "--output-dir", str(tmp_path)]))
    with pytest.raises(ValueError, match=r"EnvironmentConfig.turn_length=40 is invalid"):
        jaxppo.Config.from_settings(response_length=32, turn_length=40)
    with pytest.raises(ValueError, match=r"EnvironmentConfig.environment_errors='skip' is invalid"):
        jaxppo.Config.from_settings(environment_errors="skip")
    with pytest.raises(TypeError, match="environment must be a factory"):
        trainer_with(tmp_path, environment=TwoTurns())


def test_chat_observations_continue_the_template_after_the_stop_token():
    """Messages are rendered as the template would after the model's turn: with Qwen's
    layout, "\\n" after the <|im_end|> the model produced, then the new messages and the
    generation prompt."""
    tok = demo.demo_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text = chat_continuation(tok, [{"role": "tool", "content": "42"}], ended_with="<|im_end|>")
    assert text == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # A turn cut off before its stop token gets the whole closing text.
    assert chat_continuation(tok, [{"role": "user", "content": "go"}]).startswith("<|im_end|>\n<|im_start|>user\n")


def test_multiturn_resume_equals_the_uninterrupted_run(tmp_path):
    """Also the evaluation's episodes (sampled, every iteration): the resumed run's equal."""
    settings = dict(prompts=demo.multiturn_prompts(), eval_prompts=demo.multiturn_prompts()[:3], eval_every=1,
                    eval_generations=2, eval_temperature=1.0)
    straight = trainer_with(tmp_path / "a", demo.GuessTheDigit, iterations=3, **settings).train()
    trainer_with(tmp_path / "b", demo.GuessTheDigit, iterations=1, **settings).train()
    resumed = trainer_with(tmp_path / "b", demo.GuessTheDigit, iterations=3, **settings).train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k not in ("eps", "eval/time")}
    assert len(resumed) == 3 and [drop(r) for r in resumed] == [drop(r) for r in straight]
    assert all("eval/rewards/environment/mean" in r for r in straight)
    assert read_table(str(tmp_path / "a" / "eval_completions.table.jsonl")) == read_table(
        str(tmp_path / "b" / "eval_completions.table.jsonl"))


def test_the_evaluation_plays_episodes_as_a_hand_built_greedy_loop(tmp_path):
    """With an environment, the evaluation plays each eval prompt's episodes on the run's
    engine (turn cache kept) at eval_temperature 0: every completion is the greedy first
    turn, the observation and the greedy second turn decoded as a hand-built loop of
    `generate` calls gives them, scored by the environment (0.5 + the second turn's length)."""
    prompts = demo.DEMO_PROMPTS[:5]  # 10 rows: chunks of 4 prompts x 2, the last padded
    trainer = trainer_with(tmp_path, TwoTurns, iterations=1, eval_prompts=prompts, eval_temperature=0.0,
                           eval_generations=2)
    tok, spec = trainer.tokenizer, trainer.parts.spec
    params = jax.tree.map(jnp.copy, spec.policy_params(trainer.state.params))  # the update donates the originals
    metrics = trainer.step()
    table = trainer.last.eval_table[1]
    evaluator = trainer.parts.evaluator
    ids, mask = np.repeat(evaluator.table.ids, 2, axis=0), np.repeat(evaluator.table.mask, 2, axis=0)
    common = dict(temperature=spec.temperature, stop_token_ids=spec.stop_token_ids, pad_token_id=spec.pad_token_id,
                  greedy=True)
    b, q = ids.shape
    first = jax.device_get(generate(spec.policy, params, ids, mask, jax.random.key(0), response_length=L,
                                    max_lengths=np.full(b, L), **common))
    contexts, context_mask, budgets = np.zeros((b, q + R), np.int32), np.zeros((b, q + R), np.int32), []
    for i in range(b):
        sequence = ids[i][mask[i] > 0].tolist() + first.tokens[i, :first.mask[i].sum()].tolist() + byte_ids("ok")
        contexts[i, q + R - len(sequence):], context_mask[i, q + R - len(sequence):] = sequence, 1
        budgets.append(min(L, R - int(first.mask[i].sum()) - 2))
    second = jax.device_get(generate(spec.policy, params, contexts, context_mask, jax.random.key(0),
                                     response_length=L, max_lengths=np.asarray(budgets), **common))
    rewards = []
    for i, row in enumerate(table):
        turn1 = tok.decode(first.tokens[i, :first.mask[i].sum()].tolist(), skip_special_tokens=True)
        turn2 = tok.decode(second.tokens[i, :second.mask[i].sum()].tolist(), skip_special_tokens=True)
        assert row[0] == prompts[i // 2] and row[1] == turn1 + "ok" + turn2
        rewards.append(0.5 + len(turn2))
        assert row[2] == row[3] == rewards[-1]  # the reward, the environment's column
        assert row[4] == int(first.mask[i].sum() + second.mask[i].sum())  # the policy's tokens
    assert len(table) == 10
    assert metrics["eval/reward_mean"] == pytest.approx(np.mean(rewards))
    assert metrics["eval/rewards/environment/mean"] == pytest.approx(np.mean(rewards))


class KilledMidEpisode(demo.GuessTheDigit):
    """SIGTERM from inside a step of iteration 2's episodes (the first time only)."""

    calls = [0]

    def step(self, completion):
        KilledMidEpisode.calls[0] += 1
        if KilledMidEpisode.calls[0] == 1:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
        return super().step(completion)


def test_a_kill_mid_episode_resumes_to_the_uninterrupted_run(tmp_path):
    """A SIGTERM while iteration 2's environments are stepping: a checkpoint of the two
    finished iterations, KeyboardInterrupt; the resumed run replays iteration 2's episodes
    from reset and ends with the uninterrupted metrics."""
    kwargs = dict(iterations=4, prompts=demo.multiturn_prompts())
    straight = trainer_with(tmp_path / "a", demo.GuessTheDigit, **kwargs).train()

    def arm(iteration, metrics):
        if iteration == 1:
            KilledMidEpisode.calls[0] = 0

    KilledMidEpisode.calls[0] = -10**9  # disarmed until iteration 1 ends
    interrupted = trainer_with(tmp_path / "b", KilledMidEpisode, callbacks=[arm], **kwargs)
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert interrupted.iteration == 2
    resumed = trainer_with(tmp_path / "b", KilledMidEpisode, **kwargs).train()
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]


def test_multiturn_demo_learns(tmp_path):
    """`jaxppo --demo multiturn`: the score rises over a short run (GRPO on the embedded
    guess-the-digit environment)."""
    out = tmp_path / "demo"
    run_command("--demo", "multiturn", "--iterations", "36", "--output-dir", out, "--no-progress", "--no-plot",
                "--report-to", "jsonl", "--no-export-final", "--sample-every", "0")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = np.mean([r["reward"] for r in rows[:6]]), np.mean([r["reward"] for r in rows[-6:]])
    assert last > first + 0.2, (first, last)
    assert rows[-1]["env/turns_mean"] < rows[0]["env/turns_mean"]
