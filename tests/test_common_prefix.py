"""The prompts' common prefix once (`PPOConfig.common_prefix`, `jaxppo.update.prefix`): the
layout against a plain Python loop; the forward pass (policy, critic, reference, reward
model) and `train_step` equal to the usual layout's; the compiled program's FLOPs; the
trainer end to end; bad input."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo.models.sampling import Sampling
from jaxppo import demo
from jaxppo.rollout.engines import sample_responses
from jaxppo.rollout.spec import RolloutSpec
from jaxppo.rollout.forward import Shaping, finish_rollout
from jaxppo.update.kl import fixed_kl_controller
from jaxppo.update.prefix import common_prefix_length, prefix_layout, prefix_query, to_region
from jaxppo.update.stats import RunningMoments
from trainer_setup import perturbed, small_trainer

V, Q, R, P = 64, 12, 6, 5  # vocabulary, prompt width, response length, shared prefix


def _prompts(seed, b, prefix=P):
    """`b` left-padded prompts (width Q) of prefix + 1..Q-prefix own tokens, the prefix shared."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, V, prefix)
    ids, mask = np.zeros((b, Q), np.int32), np.zeros((b, Q), np.int32)
    for i in range(b):
        own = rng.integers(3, V, rng.integers(1, Q - prefix + 1))
        row = np.concatenate([shared, own])
        ids[i, Q - len(row):], mask[i, Q - len(row):] = row, 1
    return ids, mask


def test_common_prefix_length_matches_a_plain_loop():
    for seed in range(20):
        rng = np.random.default_rng(seed)
        ids, mask = _prompts(seed, 6, prefix=int(rng.integers(0, 5)))
        if seed % 3 == 0:  # another row equal to row 0 up to a random point
            ids[1] = ids[0]
            mask[1] = mask[0]
        rows = [list(r[m > 0]) for r, m in zip(ids, mask)]
        expected = 0
        while all(len(r) > expected for r in rows) and len({r[expected] for r in rows}) == 1:
            expected += 1
        assert common_prefix_length(ids, mask) == expected, (seed, rows)
    with pytest.raises(ValueError, match=r"must be the same \(N, Q\)"):
        common_prefix_length(np.zeros((0, 3)), np.zeros((0, 3)))


def _moved_batch(seed, response_seed, b):
    """`b` prompts with responses of random lengths, and the batch in the common-prefix
    layout: (ids, mask, tokens, response_mask, (query, query_mask, region, attention mask,
    trained mask))."""
    ids, mask = _prompts(seed, b)
    rng = np.random.default_rng(response_seed)
    tokens = rng.integers(3, V, (b, R)).astype(np.int32)
    lengths = rng.integers(1, R + 1, b)
    response_mask = (np.arange(R)[None] < lengths[:, None]).astype(np.int32)
    layout = prefix_layout(jnp.asarray(mask), P, R)
    query, query_mask = prefix_query(layout, jnp.asarray(ids))
    moved = (query, query_mask, to_region(layout, jnp.asarray(ids), jnp.asarray(tokens)),
             to_region(layout, jnp.asarray(mask), jnp.asarray(response_mask)),
             to_region(layout, jnp.zeros_like(jnp.asarray(mask)), jnp.asarray(response_mask)))
    return ids, mask, tokens, response_mask, moved


def test_layout_matches_a_plain_loop():
    """Every row: the query is the prefix, the region the rest of the prompt then the
    response, padding at the end; the masks follow their tokens."""
    ids, mask, tokens, response_mask, (query, query_mask, region, attention, trained) = _moved_batch(1, 2, 5)
    assert region.shape == (5, Q - P + R) and query.shape == (5, P)
    for i in range(5):
        real = list(ids[i][mask[i] > 0])
        own = real[P:]
        np.testing.assert_array_equal(np.asarray(query[i]), real[:P])
        assert np.all(np.asarray(query_mask[i]) == 1)
        width = len(own) + R
        np.testing.assert_array_equal(np.asarray(region[i, :width]), own + list(tokens[i]))
        assert np.all(np.asarray(region[i, width:]) == 0)
        np.testing.assert_array_equal(np.asarray(attention[i]), [1] * len(own) + list(response_mask[i])
                                      + [0] * (Q - P - len(own)))
        np.testing.assert_array_equal(np.asarray(trained[i]), [0] * len(own) + list(response_mask[i])
                                      + [0] * (Q - P - len(own)))
    with pytest.raises(ValueError, match=r"common prefix of 0 tokens: it must be in \[1, 12\]"):
        prefix_layout(jnp.asarray(mask), 0, R)


def _config(**changes):
    base = dict(model_type="llama", vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                intermediate_size=64, max_position_embeddings=32, eos_token_ids=(2,))
    base.update(changes)
    return jm.ModelConfig(**base)


@pytest.fixture(scope="module")
def scored():
    """One batch sampled once and scored in both layouts: PPO with a separate critic, a
    reference, a reward model and the sampler's log-probs as the old policy's."""
    cfg = _config()
    policy, critic, reward = jm.Model(cfg), jm.Model(cfg, kind="value"), jm.Model(cfg, kind="reward")
    params = {"policy": perturbed(policy.init(jax.random.key(0)), 1),
              "critic": perturbed(critic.init(jax.random.key(1)), 2)}
    ref_params = perturbed(params["policy"], 3)
    reward_params = perturbed(reward.init(jax.random.key(4)), 5)
    ids, mask = (jnp.asarray(a) for a in _prompts(6, 8))
    out = {}
    for prefix in (P, 0):
        spec = RolloutSpec(policy=policy, apply_fn=jm.PolicyAndCritic(policy, critic), ref_apply=policy.apply,
                           response_length=R, policy_params_key="policy", stop_token_ids=(2,), kl_estimator="k3",
                           keep_ref_logprobs=True, reward_apply=reward.apply, old_logprobs="sampler",
                           common_prefix=prefix)
        gen = sample_responses(spec, params, ids, mask, jax.random.key(7))
        rollout, stats, _ = finish_rollout(spec, params, ref_params, reward_params, (ids, mask), gen, None,
                                           Shaping(fixed_kl_controller(0.2), RunningMoments.zeros()))
        out[prefix] = (rollout, jax.device_get(stats))
    return out, params, jm.PolicyAndCritic(policy, critic), np.asarray(mask)


def test_scoring_pass_in_the_common_prefix_layout_equals_the_usual_one(scored):
    out, _, _, mask = scored
    (moved, stats_p), (usual, stats_u) = out[P], out[0]
    lengths = mask.sum(axis=1) - P  # each row's own prompt tokens, before its response in the region
    assert moved.query_tokens.shape == (8, P) and moved.response_tokens.shape == (8, Q - P + R)
    for i, own in enumerate(lengths):
        m = np.asarray(usual.response_mask[i]) > 0
        np.testing.assert_array_equal(np.asarray(moved.response_mask[i, own:own + R]), np.asarray(usual.response_mask[i]))
        assert not np.asarray(moved.response_mask[i, :own]).any() and not np.asarray(moved.response_mask[i, own + R:]).any()
        for name in ("response_tokens", "logprobs", "sampler_logprobs", "values", "ref_logprobs", "rewards"):
            a, b = np.asarray(getattr(moved, name)[i, own:own + R]), np.asarray(getattr(usual, name)[i])
            np.testing.assert_allclose(a[m], b[m], rtol=2e-5, atol=2e-5, err_msg=f"{name} row {i}")
    for key in ("per_row/raw_scores", "per_row/model_scores", "objective/kl", "objective/scores",
                "val/response_length", "val/num_eos_tokens", "objective/entropy"):
        np.testing.assert_allclose(stats_p[key], stats_u[key], rtol=2e-5, atol=2e-5, err_msg=key)
    np.testing.assert_allclose(np.asarray(moved.scores), np.asarray(usual.scores), rtol=2e-5, atol=2e-5)


def test_train_step_in_the_common_prefix_layout_equals_the_usual_one(scored):
    """The same updates (same key: the same mini-batches), the query run once per micro-batch."""
    out, params, apply_fn, _ = scored
    config = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=2, gradient_accumulation_steps=2)
    results = []
    for prefix, flag in ((P, True), (0, False)):
        rollout, _ = out[prefix]
        jaxppo.update.check_rollout(rollout, config.replace(common_prefix=flag))
        state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
        results.append(jaxppo.train_step(state, rollout, jax.random.key(9), config.replace(common_prefix=flag)))
    (moved, m_moved), (usual, m_usual) = results
    shift = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(usual.params), jax.tree.leaves(params)))
    assert shift > 1e-2
    chex.assert_trees_all_close(moved.params, usual.params, rtol=5e-4, atol=5e-5)
    assert int(moved.step) == int(usual.step) == config.batch.updates_per_step == 4
    for key in ("per_minibatch/loss/total", "per_minibatch/policy/approxkl", "per_minibatch/loss/value"):
        np.testing.assert_allclose(m_moved[key], m_usual[key], rtol=5e-4, atol=1e-5, err_msg=key)


def test_seq_mean_token_sum_norm_divides_by_the_response_length_in_either_layout(scored, tmp_path):
    """Dr. GRPO's aggregation divides by a constant, by default the batch's width: in the
    common-prefix layout that width also counts the rest of each prompt. `train_step`
    refuses the layout without `loss_norm_length`; given the response length it trains as
    the usual layout does; the trainer sets it by itself."""
    out, params, apply_fn, _ = scored
    config = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1, loss_aggregation="seq_mean_token_sum_norm")
    state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
    with pytest.raises(ValueError, match=r"loss_norm_length=None is invalid: .*the response length .*common_prefix=True"):
        jaxppo.train_step(state, out[P][0], jax.random.key(9), config.replace(common_prefix=True))
    results = []
    for prefix, changes in ((P, dict(common_prefix=True, loss_norm_length=R)), (0, dict(common_prefix=False))):
        state = jaxppo.TrainState.create(apply_fn=apply_fn, params=params, tx=optax.sgd(0.5))
        results.append(jaxppo.train_step(state, out[prefix][0], jax.random.key(9), config.replace(**changes)))
    (moved, m_moved), (usual, m_usual) = results
    np.testing.assert_allclose(m_moved["per_minibatch/loss/policy"], m_usual["per_minibatch/loss/policy"], rtol=5e-4,
                               atol=1e-5)
    chex.assert_trees_all_close(moved.params, usual.params, rtol=5e-4, atol=5e-5)
    trainer = small_trainer(tmp_path, iterations=1, prompts=[PREFIX_TEXT + p for p in demo.DEMO_PROMPTS],
                            max_len=64, query_length=48, export_final=False,
                            ppo=config.replace(batch_size=16, mini_batch_size=8, common_prefix=True))
    assert trainer.config.loss.loss_norm_length == trainer.config.sampling.response_length == 6


def test_the_query_runs_once_per_micro_batch_in_the_compiled_loss():
    """Compiled FLOPs of the loss's forward: one query of p tokens for the micro-batch, not
    B of Q (abstract parameters; nothing runs)."""
    model = jm.Model(_config(hidden_size=64, intermediate_size=128))
    params = jax.eval_shape(model.init, jax.random.key(0))
    b, q, p, r = 16, 48, 40, 16
    usual = jax.jit(lambda prm, qt, qm, rt, rm: model.response_outputs(prm, qt, qm, rt, rm, 1.0))
    moved = jax.jit(lambda prm, qt, qm, rt, rm: model.grouped_outputs(prm, qt[:1], qm[:1], rt, rm, 1.0))
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    flops_usual = usual.lower(params, ints(b, q), ints(b, q), ints(b, r), ints(b, r)).compile().cost_analysis()["flops"]
    flops_moved = moved.lower(params, ints(b, p), ints(b, p), ints(b, q - p + r), ints(b, q - p + r)).compile(
    ).cost_analysis()["flops"]
    # tokens: 16 * (48 + 16) = 1024 against 40 + 16 * 24 = 424 (0.41x); the LM head runs at
    # 24 positions per row instead of 16
    assert flops_moved < 0.6 * flops_usual, (flops_moved, flops_usual)


def test_the_lm_head_window_equals_the_whole_region_where_it_is_read():
    """`Model.head_window`: in the common-prefix layout the log-probs and entropies at each
    row's last w attended region positions equal those of the LM head over the whole
    region (0 at the others), and so do the gradients of a loss on the response tokens;
    the compiled forward and backward do less work; bad values refused."""
    model = jm.Model(_config())
    params = perturbed(model.init(jax.random.key(0)), 1)
    *_, (query, query_mask, region, attention, trained) = _moved_batch(4, 5, 6)
    trained = trained.astype(jnp.float32)
    windowed = jm.Model(model.config, head_window=R)

    def outputs(m, prm):
        return m.grouped_outputs(prm, query[:1], query_mask[:1], region, attention)

    (lp_all, _, ent_all), (lp_win, _, ent_win) = outputs(model, params), outputs(windowed, params)
    end = np.asarray(attention).sum(axis=1)
    for i in range(6):
        inside = np.zeros(region.shape[1], bool)
        inside[max(end[i] - R, 0): max(end[i] - R, 0) + R] = True
        np.testing.assert_allclose(np.asarray(lp_win[i])[inside], np.asarray(lp_all[i])[inside], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent_win[i])[inside], np.asarray(ent_all[i])[inside], rtol=1e-6, atol=1e-6)
        assert not np.asarray(lp_win[i])[~inside].any() and not np.asarray(ent_win[i])[~inside].any()
        assert np.all(np.asarray(trained[i])[~inside] == 0)  # every trained token is inside the window
    loss = lambda m: lambda prm: jnp.sum(outputs(m, prm)[0] * trained)  # noqa: E731
    chex.assert_trees_all_close(jax.grad(loss(windowed))(params), jax.grad(loss(model))(params), rtol=1e-4, atol=5e-6)
    wide = _config(vocab_size=4096)  # the head's share of the work as in a real vocabulary
    abstract = jax.eval_shape(jm.Model(wide).init, jax.random.key(0))
    flops = {w: jax.jit(jax.grad(loss(jm.Model(wide, head_window=w)))).lower(abstract).compile().cost_analysis()["flops"]
             for w in (None, R)}
    assert flops[R] < 0.85 * flops[None], flops  # the head at 6 of 13 positions per row
    with pytest.raises(ValueError, match=r"Model.head_window=0 is invalid; use None \(every position\) or a positive"):
        jm.Model(model.config, head_window=0)


def test_check_rollout_refuses_rows_with_another_query(scored):
    out, _, _, _ = scored
    rollout, _ = out[P]
    config = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1, common_prefix=True)
    jaxppo.update.check_rollout(rollout, config)
    changed = rollout.replace(query_tokens=rollout.query_tokens.at[5, 0].add(1))
    with pytest.raises(ValueError, match=r"row 5 has another query than row 0: with LayoutConfig.common_prefix=True"):
        jaxppo.update.check_rollout(changed, config)
    with pytest.raises(ValueError, match="common_prefix=True is invalid.*pack_sequences"):
        config.replace(pack_sequences=True)


PREFIX_TEXT = "Answer in one word: "


def test_trainer_with_common_prefix_trains_as_the_usual_layout(tmp_path, capsys):
    """The trainer end to end: the same samples, scores and update count, parameters equal
    up to float rounding; the prompts' common prefix found by itself; the default (None)
    turns it on for these prompts (a shared prefix of 20 tokens, a quarter of a row) and
    trains exactly as True does."""
    prompts = [PREFIX_TEXT + p for p in demo.DEMO_PROMPTS]
    runs = []
    for flag in (True, False, None):
        trainer = small_trainer(tmp_path / str(flag), iterations=1, prompts=prompts, checkpoint_every=0, max_len=64,
                                query_length=48,
                                export_final=False,
                                ppo=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1,
                                                     common_prefix=flag))
        history = trainer.train()
        runs.append((trainer, history[-1]))
    (moved, m_moved), (usual, m_usual), (auto, m_auto) = runs
    headline = f"the prompts' common prefix ({moved.parts.spec.common_prefix} tokens) runs once"
    assert capsys.readouterr().out.count(headline) == 2  # the True and the default run say so
    assert moved.parts.spec.common_prefix >= len(PREFIX_TEXT) and usual.parts.spec.common_prefix == 0
    # the LM head at each row's last response_length region positions only
    assert moved.policy_model.head_window == 6 and usual.policy_model.head_window is None
    assert auto.parts.spec.common_prefix == moved.parts.spec.common_prefix and auto.config.layout.common_prefix is True
    assert moved.config.layout.common_prefix is True and usual.config.layout.common_prefix is False
    timing = lambda m: {k: v for k, v in m.items() if not k.startswith("time/") and k != "eps"}  # noqa: E731
    assert timing(m_auto) == timing(m_moved)
    chex.assert_trees_all_equal(auto.state.params, moved.state.params)
    assert m_moved["ppo/updates_applied"] == m_usual["ppo/updates_applied"] == 4
    for key in ("objective/scores", "val/response_length", "objective/kl", "loss/policy_avg", "loss/value_avg"):
        np.testing.assert_allclose(m_moved[key], m_usual[key], rtol=1e-3, atol=1e-5, err_msg=key)
    chex.assert_trees_all_close(moved.state.params, usual.state.params, rtol=1e-3, atol=1e-5)


def test_a_resumed_run_in_the_common_prefix_layout_gives_the_uninterrupted_one(tmp_path):
    """Stopped after iteration 2 (its checkpoint) and resumed to 3: the same metrics and
    parameters as three iterations straight, with the layout (on by default for these
    prompts) and the LM-head window the resumed run derives again from the same settings."""
    prompts = [PREFIX_TEXT + p for p in demo.DEMO_PROMPTS]
    starts = []

    class Start:
        def on_train_begin(self, trainer):
            starts.append(trainer.iteration)

    make = lambda out, iterations: small_trainer(out, iterations=iterations, prompts=prompts, max_len=64,  # noqa: E731
                                                 query_length=48, export_final=False, callbacks=(Start(),))
    straight_trainer = make(tmp_path / "straight", 3)
    straight = straight_trainer.train()
    make(tmp_path / "stopped", 2).train()
    resumed_trainer = make(tmp_path / "stopped", 3)
    resumed = resumed_trainer.train()
    assert starts == [0, 0, 2]  # the third run restored iteration 2's checkpoint, not trained from the start
    assert resumed_trainer.parts.spec.common_prefix == straight_trainer.parts.spec.common_prefix >= len(PREFIX_TEXT)
    assert resumed_trainer.policy_model.head_window == straight_trainer.policy_model.head_window == 6
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"}  # noqa: E731
    assert len(resumed) == len(straight) == 3
    assert [drop(r) for r in resumed] == [drop(r) for r in straight]
    chex.assert_trees_all_equal(resumed_trainer.state.params, straight_trainer.state.params)


def test_common_prefix_refuses_prompts_without_one(tmp_path):
    with pytest.raises(ValueError, match="common_prefix=True, but the .* prompts share no leading token"):
        small_trainer(tmp_path, iterations=1, prompts=["abc", "xyz"],
                      ppo=jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, common_prefix=True))


def test_a_token_reward_function_reads_the_usual_layout():
    """A token-level reward function gets the prompts and responses as they were sampled,
    not the common-prefix layout: the same scores either way (it counts token 7 in the
    response, where the moved prompt tokens would add to the count)."""
    cfg = _config()
    policy = jm.Model(cfg)
    params = perturbed(policy.init(jax.random.key(0)), 1)
    ids, mask = _prompts(6, 8)
    ids[:, -1] = 7  # every prompt ends in a token the function counts, if it read the prompt
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    scores = {}
    for prefix in (P, 0):
        spec = RolloutSpec(policy=policy, apply_fn=policy.apply, ref_apply=None, response_length=R,
                           stop_token_ids=(2,), uses_critic=False, old_logprobs="sampler", common_prefix=prefix,
                           token_reward_fn=lambda q, qm, r, rm: jnp.sum((r == 7) * rm, axis=1).astype(jnp.float32))
        gen = sample_responses(spec, params, ids, mask, jax.random.key(7))
        _, stats, _ = finish_rollout(spec, params, None, None, (ids, mask), gen, None,
                                     Shaping(fixed_kl_controller(0.2), RunningMoments.zeros()))
        scores[prefix] = np.asarray(stats["per_row/raw_scores"])
        expected = np.sum((np.asarray(gen.tokens) == 7) * np.asarray(gen.mask), axis=1)
        np.testing.assert_array_equal(scores[prefix], expected)


def test_the_default_turns_the_common_prefix_on_where_it_pays():
    """`PPOConfig.common_prefix=None` (the trainer's default): on for a single-turn run of one
    completion per prompt, the whole set up front, no packing and no mesh, when the prompts
    share at least AUTO_COMMON_PREFIX_MIN_TOKENS tokens and AUTO_COMMON_PREFIX_MIN_SHARE of a
    row; off otherwise (the rule read back from a plain count of the rows' shared tokens)."""
    from types import SimpleNamespace

    from jaxppo.run.parts import AUTO_COMMON_PREFIX_MIN_SHARE, AUTO_COMMON_PREFIX_MIN_TOKENS, auto_common_prefix

    def table(shared, width=40, rows=6, streamed=False):
        rng = np.random.default_rng(shared)
        ids, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
        prefix = rng.integers(3, V, shared)
        for i in range(rows):  # own tokens that differ in their first token from every other row's
            row = np.concatenate([prefix, [3 + i], rng.integers(3, V, i % 3)])
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        return SimpleNamespace(ids=ids, mask=mask, width=width, streamed=streamed)

    ppo = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, query_length=40, response_length=24)
    assert AUTO_COMMON_PREFIX_MIN_TOKENS == 16 and AUTO_COMMON_PREFIX_MIN_SHARE == 1 / 8
    assert auto_common_prefix(ppo, table(30), None) == 30
    assert auto_common_prefix(ppo, table(16), None) == 16
    assert auto_common_prefix(ppo, table(15), None) == 0  # too few tokens
    long_rows = ppo.replace(response_length=100)  # 16 < (40 + 100) / 8
    assert auto_common_prefix(long_rows, table(16), None) == 0
    assert auto_common_prefix(long_rows, table(18), None) == 18  # 18 >= 140 / 8
    assert auto_common_prefix(ppo, table(30, streamed=True), None) == 0
    assert auto_common_prefix(ppo, table(30), object()) == 0  # an environment
    assert auto_common_prefix(ppo.replace(mesh=object()), table(30), None) == 0  # a mesh
    grpo = ppo.replace(advantages=jaxppo.AdvantageConfig(advantage_estimator="grpo"), num_generations=4)
    assert auto_common_prefix(grpo, table(30), None) == 0  # groups share their whole prompt instead
    packed = ppo.replace(pack_sequences=True)
    assert auto_common_prefix(packed, table(30), None) == 0


def test_the_sampler_prefills_the_common_prefix_once():
    """`generate(..., common_prefix=p)`: the prefix prefilled once for every row. Greedy
    tokens equal a plain loop of full forwards (a prompt that is the prefix alone
    included); sampled tokens equal the usual prefill's for the same key, log-probs up to
    float rounding; the compiled prefill's FLOPs drop with the rows' shared tokens; the
    run's engine uses it for batches that begin with the prefix only; bad input refused."""
    from jaxppo.rollout.engines import StaticEngine
    from jaxppo.rollout.engines.static import generate, generate_jit

    policy = jm.Model(_config())
    params = perturbed(policy.init(jax.random.key(0)), 1)
    ids, mask = _prompts(11, 7)
    ids[0], mask[0] = 0, 0  # a prompt that is the prefix alone
    ids[0, Q - P:], mask[0, Q - P:] = ids[1][mask[1] > 0][:P], 1
    greedy = generate(policy, params, ids, mask, jax.random.key(0), response_length=R, greedy=True,
                      stop_token_ids=(2,), pad_token_id=0, common_prefix=P)
    forward = jax.jit(policy.apply)  # full forwards, no cache: every row left-padded to Q + R
    rows = [list(r[m > 0]) for r, m in zip(ids, mask)]
    expected = [[] for _ in rows]
    for _ in range(R):
        tokens, real = np.zeros((len(rows), Q + R), np.int32), np.zeros((len(rows), Q + R), np.int32)
        for i, row in enumerate(rows):
            tokens[i, Q + R - len(row):], real[i, Q + R - len(row):] = row, 1
        picked = np.asarray(jnp.argmax(forward(params, jnp.asarray(tokens), jnp.asarray(real))[:, -1], -1))
        for i, row in enumerate(rows):
            if not expected[i] or expected[i][-1] != 2:
                expected[i].append(int(picked[i]))
                row.append(int(picked[i]))
    for i, tokens in enumerate(expected):
        n = len(tokens)
        assert np.asarray(greedy.tokens[i, :n]).tolist() == tokens, i
        assert np.asarray(greedy.mask[i]).tolist() == [1] * n + [0] * (R - n)
    sampled = {p: generate(policy, params, ids, mask, jax.random.key(3), response_length=R, stop_token_ids=(2,),
                           pad_token_id=0, common_prefix=p) for p in (P, 0)}
    np.testing.assert_array_equal(np.asarray(sampled[P].tokens), np.asarray(sampled[0].tokens))
    np.testing.assert_allclose(np.asarray(sampled[P].logprobs), np.asarray(sampled[0].logprobs), atol=1e-5)

    # Compiled FLOPs with abstract parameters (nothing runs): 16 prompts of 48 tokens sharing 40.
    ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    wide = jm.Model(_config(max_position_embeddings=64))
    sampling = Sampling(response_length=2, greedy=True, stop_token_ids=(2,), pad_token_id=0, early_stop=False).check(wide)
    abstract = jax.eval_shape(wide.init, jax.random.key(0))
    flops = {p: generate_jit.lower(wide, abstract, ints(16, 48), ints(16, 48), jax.random.key(0), sampling,
                                   common_prefix=p).compile().cost_analysis()["flops"]
             for p in (40, 0)}
    # prompt tokens: 40 + 16 * 8 = 168 against 16 * 48 = 768
    assert flops[40] < 0.5 * flops[0], flops

    spec = RolloutSpec(policy=policy, apply_fn=policy.apply, ref_apply=None, response_length=R, stop_token_ids=(2,),
                       uses_critic=False, common_prefix=P)
    engine = StaticEngine(spec)
    assert engine.prefix_of(ids, mask, 1) == P
    assert engine.prefix_of(ids, mask, 7) == 0  # groups prefill their own prompt once already
    other = ids.copy()
    other[3, Q - mask[3].sum()] += 1  # an evaluation batch without the prefix
    assert engine.prefix_of(other, mask, 1) == 0
    with pytest.raises(ValueError, match=rf"common_prefix={P}: the prompts do not all begin with the same {P}"):
        generate(policy, params, other, mask, jax.random.key(0), response_length=R, common_prefix=P)
    with pytest.raises(ValueError, match="common_prefix=True must be an int >= 0"):
        generate(policy, params, ids, mask, jax.random.key(0), response_length=R, common_prefix=True)
