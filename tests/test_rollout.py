"""Rollout math (KL estimators, KL-shaped rewards, KL controller, running moments) against
reference formulas written here, and the compiled rollout against a direct computation."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.update.kl import KLControllerState, adaptive_kl_update, fixed_kl_controller, kl_per_token, kl_shaped_rewards
from jaxppo.update.stats import RunningMoments, running_moments_update
from jaxppo.errors import RewardError
from jaxppo.rollout.rewards import check_scores
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.forward import Shaping, finish_rollout


def test_kl_estimators_match_formulas():
    lp = np.array([[-1.0, -2.0, -0.5]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5]], np.float32)
    for est, f in {
        "k1": lambda a, b: a - b,
        "k3": lambda a, b: math.exp(b - a) - 1 - (b - a),
        "abs": lambda a, b: abs(a - b),
        "mse": lambda a, b: 0.5 * (a - b) ** 2,
    }.items():
        got = np.asarray(kl_per_token(jnp.asarray(lp), jnp.asarray(ref), est))
        want = [f(float(a), float(b)) for a, b in zip(lp[0], ref[0])]
        np.testing.assert_allclose(got[0], want, atol=1e-6)
    with pytest.raises(ValueError, match="k1, k3, abs, mse"):
        kl_per_token(jnp.asarray(lp), jnp.asarray(ref), "k2")


def test_kl_shaped_rewards_put_score_at_last_real_token():
    kl = jnp.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1]])
    scores = jnp.array([2.0, -1.0])
    rewards, non_score = kl_shaped_rewards(kl, scores, mask, 0.5)
    expected = np.array([[-0.05, -0.1 + 2.0, 0, 0], [-0.25, -0.3, -0.35, -0.4 - 1.0]])
    np.testing.assert_allclose(np.asarray(rewards), expected, atol=1e-6)
    np.testing.assert_allclose(np.asarray(non_score).sum(1), [-0.15, -1.3], atol=1e-6)


def test_adaptive_kl_controller_matches_ziegler_formula():
    state = KLControllerState(jnp.float32(0.2), jnp.float32(6.0), jnp.float32(10000.0))
    beta = 0.2
    for kl in [3.0, 12.0, 6.0, 100.0]:
        state = adaptive_kl_update(state, jnp.float32(kl), 256)
        beta *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 256 / 10000
        assert float(state.beta) == pytest.approx(beta, rel=1e-6)
    fixed = fixed_kl_controller(0.1)
    assert float(adaptive_kl_update(fixed, jnp.float32(50.0), 256).beta) == pytest.approx(0.1)


def test_running_moments_match_numpy():
    rng = np.random.default_rng(0)
    chunks = [rng.normal(3, 2, size=n) for n in (5, 17, 64, 1)]
    state = RunningMoments.zeros()
    for c in chunks:
        state = running_moments_update(state, jnp.asarray(c))
    allx = np.concatenate(chunks)
    assert float(state.mean) == pytest.approx(allx.mean(), rel=1e-5)
    assert float(state.var) == pytest.approx(allx.var(), rel=1e-4)
    assert float(state.count) == allx.size


def test_check_scores_names_the_function_row_and_value():
    assert check_scores([1, 2.5], 2).tolist() == [1.0, 2.5]
    assert check_scores(np.array([1, 2]), 2).dtype == np.float32
    # Non-finite numbers pass here: the trainer reports (or skips) them for every kind of reward.
    assert np.isnan(check_scores([1, float("nan")], 2)[1])
    cases = [([1, 2, 3], r"'f' returned 3 scores for 2 responses; expected \(2,\)"),
             ([1, None], r"'f' returned None at row 1 \(prompt 'p1', response 'r1'\)"),
             (["a", "b"], r"'f' returned 'a' \(str\) at row 0"),
             ([1.0, True], r"returned True \(bool\) at row 1"),
             ("12", r"'f' returned a str"),
             (3.0, r"'f' returned a float"),
             (np.ones((2, 1)), r"array of shape \(2, 1\)")]
    for scores, message in cases:
        with pytest.raises(RewardError, match=message):
            check_scores(scores, 2, "'f'", ["p0", "p1"], ["r0", "r1"])


@pytest.fixture(scope="module")
def tiny_policy():
    config = jm.ModelConfig(model_type="gpt2", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                            num_kv_heads=2, intermediate_size=32, max_position_embeddings=32, eos_token_ids=(2,),
                            pad_token_id=0)
    model = jm.Model(config)
    return model, model.init(jax.random.key(0))


def test_finish_rollout_against_direct_computation(tiny_policy):
    model, params = tiny_policy
    critic = jm.Model(model.config, kind="value")
    critic_params = {"params": {"transformer": params["params"]["transformer"],
                                "score": {"kernel": 0.1 * jnp.ones((16, 1))}}}
    apply_fn = jm.PolicyAndCritic(model, critic)
    full = {"policy": params, "critic": critic_params}
    ref_params = jax.tree.map(lambda x: x * 0.9, params)  # a different reference

    def token_reward(p_ids, p_mask, r_ids, r_mask):
        return jnp.sum((r_ids == 7) * r_mask, axis=1).astype(jnp.float32)

    spec = RolloutSpec(policy=model, apply_fn=apply_fn, ref_apply=model.apply, response_length=6, temperature=0.8,
                       policy_params_key="policy", token_reward_fn=token_reward, stop_token_ids=(2,),
                       kl_estimator="k3", missing_eos_penalty=1.5, score_clip=2.0)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 32, size=(8, 4)))
    mask = jnp.ones_like(ids)
    gen = sample_responses(spec, full, ids, mask, jax.random.key(2))
    kl_state = fixed_kl_controller(0.25)
    rollout, stats, _ = finish_rollout(spec, full, ref_params, None, (ids, mask), gen, None,
                                       Shaping(kl_state, RunningMoments.zeros()))

    # Direct computation, step by step.
    tokens = jnp.concatenate([ids, gen.tokens], 1)
    tmask = jnp.concatenate([mask, gen.mask], 1)
    logp = jax.nn.log_softmax(model.apply(params, tokens, tmask)[:, 3:9] / 0.8)
    logp = np.take_along_axis(np.asarray(logp), np.asarray(gen.tokens)[..., None], -1)[..., 0]
    rlogp = jax.nn.log_softmax(model.apply(ref_params, tokens, tmask)[:, 3:9] / 0.8)
    rlogp = np.take_along_axis(np.asarray(rlogp), np.asarray(gen.tokens)[..., None], -1)[..., 0]
    m = np.asarray(gen.mask)
    np.testing.assert_allclose(np.asarray(rollout.logprobs) * m, logp * m, atol=1e-5)
    np.testing.assert_allclose(np.asarray(rollout.logprobs) * m, np.asarray(gen.logprobs) * m, atol=1e-4)
    values = np.asarray(critic.apply(critic_params, tokens, tmask))[:, 3:9]
    np.testing.assert_allclose(np.asarray(rollout.values), values, atol=1e-5)
    toks = np.asarray(gen.tokens)
    for i in range(8):
        n = int(m[i].sum())
        has_eos = bool((toks[i, :n] == 2).any())
        score = float(((toks[i] == 7) * m[i]).sum()) - (0.0 if has_eos else 1.5)
        score = min(max(score, -2.0), 2.0)
        for t in range(6):
            lr = rlogp[i, t] - logp[i, t]
            kl = (math.exp(lr) - 1 - lr) if t < n else 0.0
            expected = -0.25 * kl + (score if t == n - 1 else 0.0)
            assert float(rollout.rewards[i, t]) == pytest.approx(expected, abs=1e-4), (i, t)
    assert float(stats["val/num_eos_tokens"]) == sum(bool((toks[i][m[i] > 0] == 2).any()) for i in range(8))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_carries_sampler_logprobs_and_sequence_scores(tiny_policy, temperature):
    """The sampler's own log-probs of the sampled tokens (behaviour policy) ride in the
    rollout, equal to the forward pass's within float32 rounding; critic-free rollouts carry
    each completion's sequence score (score + summed KL penalty = the sum of its rewards)
    and no values."""
    model, params = tiny_policy
    spec = RolloutSpec(policy=model, apply_fn=model.apply, ref_apply=model.apply, response_length=7,
                       temperature=temperature, stop_token_ids=(2,), kl_estimator="k1", uses_critic=False)
    ids = jnp.asarray(np.random.default_rng(3).integers(3, 32, size=(8, 5)))
    mask = jnp.asarray(np.arange(5)[None] >= np.arange(8)[:, None] % 3, jnp.int32)  # some left padding
    gen = sample_responses(spec, params, ids, mask, jax.random.key(4))
    ref_params = jax.tree.map(lambda x: x * 0.9, params)
    host_scores = jnp.asarray(np.random.default_rng(5).normal(size=8), jnp.float32)
    rollout, _, _ = finish_rollout(spec, params, ref_params, None, (ids, mask), gen, host_scores,
                                   Shaping(fixed_kl_controller(0.1), RunningMoments.zeros()))
    m = np.asarray(gen.mask)
    assert rollout.values is None
    np.testing.assert_array_equal(np.asarray(rollout.sampler_logprobs), np.asarray(gen.logprobs))
    sampler, scored = np.asarray(rollout.sampler_logprobs) * m, np.asarray(rollout.logprobs) * m
    # float32 rounding: a few ulps of log-probs below 8 in magnitude (measured: 2 ulps).
    assert np.abs(scored).max() < 8
    np.testing.assert_allclose(sampler, scored, rtol=0, atol=4 * float(np.spacing(np.float32(8))))
    np.testing.assert_allclose(np.asarray(rollout.scores), (np.asarray(rollout.rewards) * m).sum(axis=1),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(rollout.scores), np.asarray(host_scores), atol=1e-4)  # the KL penalty counts


def test_rollout_spec_reads_its_settings_from_the_configs():
    """`RolloutSpec.from_config`: each setting the rollout reads comes from its concern's
    field (listed here by hand, the independent side), with non-default values."""
    model = jm.Model(jm.ModelConfig(model_type="gpt2", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=2, intermediate_size=32, max_position_embeddings=32))
    ppo = jaxppo.Config.for_algorithm(
        "dapo", batch_size=8, mini_batch_size=4, num_generations=4, temperature=0.7, kl_loss_coef=0.1,
        overlong_penalty_factor=0.5, overlong_buffer=3, pack_sequences=True, pack_length=40)
    config = ppo.replace(response_length=12, kl_estimator="k3", missing_eos_penalty=1.5, normalize_scores=True,
                         score_clip=4.0, num_slots=2)
    spec = RolloutSpec.from_config(config, policy=model, apply_fn=model.apply, ref_apply=None, stop_token_ids=(1,))
    expected = dict(response_length=12, temperature=0.7, keep_ref_logprobs=True, kl_estimator="k3",
                    missing_eos_penalty=1.5, normalize_scores=True, score_clip=4.0, uses_critic=False,
                    num_generations=4, num_slots=2, overlong_penalty_factor=0.5, overlong_buffer=3,
                    mask_truncated=True, pack_sequences=True, pack_length=40)
    assert {name: getattr(spec, name) for name in expected} == expected
    assert type(spec.temperature) is float and spec.stop_token_ids == (1,)


def _old_logprobs_rollouts(model, params, critic=None, critic_params=None, group=1, ref=True):
    """finish_rollout's rollouts with the sampler's log-probs and recomputed, same samples."""
    apply_fn, full = (model.apply, params) if critic is None else (jm.PolicyAndCritic(model, critic),
                                                                    {"policy": params, "critic": critic_params})
    ids = jnp.asarray(np.repeat(np.random.default_rng(3).integers(3, 32, size=(8 // group, 5)), group, 0))
    mask = jnp.asarray(np.arange(5)[None] >= np.repeat(np.arange(8 // group) % 3, group)[:, None], jnp.int32)
    out = {}
    for source in ("sampler", "recompute"):
        spec = RolloutSpec(policy=model, apply_fn=apply_fn, ref_apply=model.apply if ref else None, response_length=7,
                           temperature=0.7, stop_token_ids=(2,), kl_estimator="k3", uses_critic=critic is not None,
                           policy_params_key=None if critic is None else "policy", num_generations=group,
                           old_logprobs=source)
        gen = sample_responses(spec, full, ids, mask, jax.random.key(4))
        ref_params = jax.tree.map(lambda x: x * 0.9, params) if ref else None
        out[source] = (spec, gen, finish_rollout(spec, full, ref_params, None, (ids, mask), gen, None,
                                                 Shaping(fixed_kl_controller(0.1), RunningMoments.zeros()))[0])
    return out


@pytest.mark.parametrize("group", [1, 4])
def test_old_logprobs_from_the_sampler(tiny_policy, group):
    """`old_logprobs="sampler"`: the rollout's log-probs are the sampler's own, exactly; the
    critic's values (run alone) and everything else equal the recomputing pass's up to
    float rounding."""
    model, params = tiny_policy
    critic = jm.Model(model.config, kind="value")
    critic_params = {"params": {"transformer": params["params"]["transformer"],
                                "score": {"kernel": 0.1 * jnp.ones((16, 1))}}}
    out = _old_logprobs_rollouts(model, params, critic, critic_params, group)
    (_, gen, sampled), (_, _, recomputed) = out["sampler"], out["recompute"]
    m = np.asarray(gen.mask)
    np.testing.assert_array_equal(np.asarray(sampled.logprobs), np.asarray(gen.logprobs))
    np.testing.assert_allclose(np.asarray(sampled.logprobs) * m, np.asarray(recomputed.logprobs) * m, atol=1e-5)
    for name in ("values", "rewards", "scores"):
        np.testing.assert_allclose(np.asarray(getattr(sampled, name)) * (m if name != "scores" else 1),
                                   np.asarray(getattr(recomputed, name)) * (m if name != "scores" else 1),
                                   atol=2e-5, err_msg=name)


def test_old_logprobs_from_the_sampler_need_no_forward(tiny_policy):
    """With the sampler's log-probs, no reference and no critic, the compiled forward pass
    runs no model: its FLOPs are a small fraction of the recomputing pass's."""
    model, params = tiny_policy
    out = _old_logprobs_rollouts(model, params, ref=False)
    flops = {}
    for source, (spec, gen, _) in out.items():
        ids = jnp.ones((8, 5), jnp.int32)
        fn = jax.jit(lambda p, g, spec=spec: finish_rollout(spec, p, None, None, (ids, jnp.ones_like(ids)), g, None,
                                                            Shaping(fixed_kl_controller(0.1), RunningMoments.zeros())))
        flops[source] = fn.lower(params, gen).compile().cost_analysis()["flops"]
    assert flops["sampler"] < 0.02 * flops["recompute"], flops


def test_old_logprobs_auto_takes_the_sampler_only_where_exact(tiny_policy):
    model, _ = tiny_policy
    spec = lambda **kw: RolloutSpec(policy=model, apply_fn=model.apply, ref_apply=None, response_length=4,
                                    old_logprobs="auto", **kw)
    assert spec().sampler_logprobs_used  # the built-in engine, float32
    assert not spec(rollout_engine="vllm").sampler_logprobs_used
    bf16 = RolloutSpec(policy=jm.Model(model.config, dtype="bfloat16"), apply_fn=model.apply, ref_apply=None,
                       response_length=4, old_logprobs="auto")
    assert not bf16.sampler_logprobs_used
    assert not RolloutSpec(policy=model, apply_fn=model.apply, ref_apply=None, response_length=4).sampler_logprobs_used
    config = RolloutSpec.from_config(jaxppo.Config(), policy=model, apply_fn=model.apply, ref_apply=None)
    assert config.old_logprobs == "auto" and config.sampler_logprobs_used  # the trainer's default


def test_the_trainers_scoring_pass_is_one_compiled_program(tmp_path):
    """`finish_rollout` is compiled (one XLA program for the policy, reference and reward
    forwards, not op by op: 0.5-dev's restructure had lost its `jax.jit`, which made the
    demo's forward pass 12x slower), and later iterations reuse the program."""
    from jaxppo import demo

    assert callable(getattr(finish_rollout, "lower", None))  # a jitted function
    tok = demo.demo_tokenizer()
    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=8, num_generations=4, iterations=3,
                                         query_length=32, response_length=6, output_dir=str(tmp_path),
                                         report_to="jsonl", sample_every=0, progress=False, kl_coef=0.05)
    trainer = jaxppo.Trainer(config, policy=demo.demo_policy(tok, width=32, layers=1, max_len=38), tokenizer=tok,
                             prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
    trainer.step()
    compiled = finish_rollout._cache_size()
    trainer.step()
    trainer.step()
    assert finish_rollout._cache_size() == compiled
