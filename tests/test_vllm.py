"""vLLM as the rollout engine (`jaxppo.rollout.engines.vllm.inprocess`), on vLLM's CPU build. These tests run
in their own environment (vLLM pins its own transformers): `.ci/run` builds it and runs
this file with JAXPPO_REQUIRE_VLLM=1, where a missing vLLM is an error; elsewhere the file
is skipped when vLLM is not installed.

References: jaxppo's own forward pass (`response_outputs`) on the same weights gives the
log-probs vLLM returns for its sampled tokens; after a weight push the new weights' log-probs,
not the old ones'."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("JAXPPO_REQUIRE_VLLM"):
        raise RuntimeError("JAXPPO_REQUIRE_VLLM is set but vLLM is not installed in this environment")
    pytest.skip("vLLM is not installed (tests/test_vllm.py runs in CI's vLLM environment)", allow_module_level=True)

import jaxppo  # noqa: E402
import jaxppo.models as jm  # noqa: E402
from jaxppo import demo  # noqa: E402
from jaxppo.rollout.engines.vllm import inprocess as vllm_engine  # noqa: E402
from jaxppo.update.batch import response_outputs  # noqa: E402

B, G, Q, R, V = 8, 4, 6, 10, 384


def tiny_config(**changes):
    """A Qwen2 layout with head_dim 64 (the CPU attention kernel's sizes), the demo
    tokenizer's vocabulary."""
    base = dict(model_type="qwen2", vocab_size=V, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                head_dim=64, intermediate_size=256, max_position_embeddings=128, activation="silu", qkv_bias=True,
                tie_word_embeddings=True, eos_token_ids=(1,))
    return jm.ModelConfig(**{**base, **changes})


@pytest.fixture(scope="class")
def engine_and_model():
    """A policy with a value head on its trunk, in the scanned layout: what vLLM gets is
    the causal LM alone, its layers unstacked. Closed after the class's tests (one engine
    may be open in a process at a time), before the trainers below start theirs."""
    model = jm.Model(tiny_config(), kind="causal_lm_value", scan_layers=True)
    params = model.init(jax.random.key(0))
    engine = vllm_engine.VLLMEngine(model, params, seed=0, max_model_len=Q + R + 4)
    yield engine, model, params
    engine.close()


def prompts():
    rng = np.random.default_rng(0)
    ids = np.repeat(rng.integers(2, V, (B // G, Q)), G, axis=0)
    mask = np.ones((B, Q), np.int32)
    mask[G:, :2] = 0  # the second group's prompt is left-padded
    return ids, mask


def sample_and_score(engine, model, params, stop=(1,)):
    ids, mask = prompts()
    tokens, logprobs, out_mask = engine.generate(ids, mask, num_generations=G, response_length=R, temperature=0.8,
                                                 stop_token_ids=stop, pad_token_id=0)
    batch = {"query_tokens": jnp.asarray(ids), "query_mask": jnp.asarray(mask),
             "response_tokens": jnp.asarray(tokens), "response_mask": jnp.asarray(out_mask)}
    scored = np.asarray(response_outputs(model.apply, params, batch, 0.8)[0])
    return tokens, logprobs, out_mask, scored


class TestOneEngine:
    """The engine's own tests, on one engine (the class's fixture); the failed push last,
    since vLLM may not recover from a rejected load."""

    def test_vllm_log_probs_equal_the_scoring_pass_and_follow_pushed_weights(self, engine_and_model):
        engine, model, params = engine_and_model
        tokens, logprobs, mask, scored = sample_and_score(engine, model, params)
        assert np.max(np.abs(logprobs - scored) * mask) < 5e-5
        new = jax.tree.map(lambda x: x * 1.3, params)
        engine.push(new, 1)
        tokens, logprobs, mask, scored_new = sample_and_score(engine, model, new)
        assert np.max(np.abs(logprobs - scored_new) * mask) < 5e-5
        # The old weights would not explain these samples: the push changed what vLLM computes.
        batch = {"query_tokens": jnp.asarray(prompts()[0]), "query_mask": jnp.asarray(prompts()[1]),
                 "response_tokens": jnp.asarray(tokens), "response_mask": jnp.asarray(mask)}
        old = np.asarray(response_outputs(model.apply, params, batch, 0.8)[0])
        assert np.max(np.abs(logprobs - old) * mask) > 1e-2
        engine.push(params, 1)  # the update vLLM already holds: nothing is loaded
        _, logprobs, mask, still_new = sample_and_score(engine, model, new)
        assert np.max(np.abs(logprobs - still_new) * mask) < 5e-5

    def test_vllm_output_is_laid_out_like_the_built_in_sampler(self, engine_and_model):
        """Groups of G rows per prompt, the stop token kept with mask 1, padding after it."""
        engine, model, params = engine_and_model
        stop = tuple(range(2, 60))  # about one token in seven stops a row: some rows stop, some run to the budget
        tokens, logprobs, mask, _ = sample_and_score(engine, model, params, stop=stop)
        lengths = mask.sum(1)
        assert np.all(np.diff(mask, axis=1) <= 0)  # a prefix of ones
        stopped = lengths < R
        assert stopped.any()
        assert np.all(np.isin(tokens[stopped, lengths[stopped] - 1], stop))
        assert np.all(tokens[mask == 0] == 0) and np.all(logprobs[mask == 0] == 0)
        assert np.all(logprobs[mask == 1] < 0)
        for row in range(B):  # no stop token before the last real one
            assert not np.any(np.isin(tokens[row, : lengths[row] - 1], stop))

    def test_vllm_samples_with_the_filters_and_stop_strings(self, engine_and_model):
        """Top-k, top-p, min-p and a repetition penalty: vLLM's log-probs are those of the
        distribution it drew from, the plain-loop reference over jaxppo's forward (the
        penalty on the prompt's and the completion's tokens); stop strings (the lowercase
        letters, matched after sampling) end each row at the first one its text holds."""
        from sampling_reference import decoded_stop, reference_probs

        engine, model, params = engine_and_model
        engine.push(params, 2)  # the tests before left other weights in vLLM
        tokenizer = demo.demo_tokenizer()
        strings = tuple("abcdefghijklmnopqrstuvwxyz")
        stops = jm.StopStrings.build(strings, tokenizer, V)
        ids, mask = prompts()
        setting = dict(top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.5)
        free = engine.generate(ids, mask, num_generations=G, response_length=R, temperature=0.8, stop_token_ids=(1,),
                               pad_token_id=0, **setting)
        cut = engine.generate(ids, mask, num_generations=G, response_length=R, temperature=0.8, stop_token_ids=(1,),
                              pad_token_id=0, stop_strings=stops, **setting)
        tokens, logprobs, out_mask = free
        ended = 0
        for row in range(B):
            prompt = [int(t) for t, m in zip(ids[row], mask[row]) if m]
            n = int(out_mask[row].sum())
            seq = prompt + [int(t) for t in tokens[row, :n]]
            out = model.apply(params, np.array([seq]), np.ones((1, len(seq)), np.int32))
            logits = np.asarray(out[0] if isinstance(out, tuple) else out)[0]  # (a value head: (logits, values))
            for j in range(n):
                expected = reference_probs(logits[len(prompt) + j - 1], 0.8, top_k=50, top_p=0.9, min_p=0.01,
                                           penalty=1.5, seen=set(seq[:len(prompt) + j]))
                t = seq[len(prompt) + j]
                assert expected[t] > 0, (row, j, t, float(logprobs[row, j]), np.sort(expected)[::-1][:60])
                np.testing.assert_allclose(logprobs[row, j], np.log(expected[t]), atol=1e-4)
            # vLLM's seed gives other draws on the second call: the stop strings are checked on its own rows
            c_tokens, c_mask = cut[0][row], cut[2][row]
            m = int(c_mask.sum())
            stop = decoded_stop(tokenizer, [int(t) for t in c_tokens[:m]], strings)
            assert stop in (-1, m - 1) and np.all(c_tokens[m:] == 0) and np.all(cut[1][row, m:] == 0)
            ended += stop == m - 1
        assert ended > 0

    def test_vllm_samples_follow_their_seeds_and_greedy_takes_the_argmax(self, engine_and_model):
        """Each prompt group seeded (`request_seeds` of a key): the same key gives the same
        tokens on another call, another key other tokens; greedy decoding (an evaluation at
        temperature 0) takes at every step a token whose log-prob under jaxppo's own
        forward of the same sequence is the largest (up to float rounding)."""
        engine, model, params = engine_and_model
        engine.push(params, 3)
        ids, mask = prompts()
        settings = dict(num_generations=G, response_length=R, temperature=1.0, stop_token_ids=(1,), pad_token_id=0)
        seeds = vllm_engine.request_seeds(jax.random.key(5), B // G)
        assert seeds == vllm_engine.request_seeds(jax.random.key(5), B // G) and len(set(seeds)) == B // G
        first = engine.generate(ids, mask, seeds=seeds, **settings)
        again = engine.generate(ids, mask, seeds=seeds, **settings)
        other = engine.generate(ids, mask, seeds=vllm_engine.request_seeds(jax.random.key(6), B // G), **settings)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(first[0], other[0])
        assert len({tuple(row) for row in first[0][:G]}) > 1  # a group's samples differ (seed, seed + 1, ...)
        tokens, _, out_mask = engine.generate(ids, mask, greedy=True, **settings)
        out = model.apply(params, jnp.asarray(np.concatenate([ids, tokens], 1)),
                          jnp.asarray(np.concatenate([mask, out_mask], 1)))
        logp = np.asarray(jax.nn.log_softmax(out[0] if isinstance(out, tuple) else out))[:, Q - 1:Q - 1 + R]
        chosen = np.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
        assert out_mask.sum() > B
        assert np.max((logp.max(-1) - chosen) * out_mask) < 1e-4

    def test_a_failed_push_is_an_error_and_nothing_samples_after_it(self, engine_and_model):
        """A push vLLM rejects (a tensor of the wrong shape) is an error naming the version, and
        no later sample is drawn from whatever vLLM holds after it."""
        engine, model, params = engine_and_model
        broken = jax.tree.map(lambda x: x, params)
        table = broken["params"]["model"]["embed_tokens"]
        table["embedding"] = table["embedding"][:, :64]  # the wrong width
        with pytest.raises(RuntimeError, match=r"pushing the policy's weights \(version 7\) into vLLM failed"):
            engine.push(broken, 7)
        # vLLM may hold a half-loaded policy now: nothing samples from it. (vLLM's state in this process
        # may not recover from a rejected load either, so this test runs last.)
        with pytest.raises(RuntimeError, match="the last weight push into vLLM failed"):
            sample_and_score(engine, model, params)


def test_a_head_size_the_cpu_kernel_lacks_is_refused_before_vllm_starts():
    model = jm.Model(tiny_config(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16))
    with pytest.raises(ValueError, match=r"vLLM's CPU attention takes head_dim in \(32, 64, .*this policy's head_dim "
                                         r"is 16"):
        vllm_engine.VLLMEngine(model, model.init(jax.random.key(0)), seed=0, max_model_len=32)


def vllm_trainer(tmp_path, iterations=2, eval_prompts=None, **settings):
    tokenizer = demo.demo_tokenizer()
    model = jm.Model(tiny_config())
    params = model.init(jax.random.key(1))
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4)
    tc = dict(**{**dict(iterations=iterations, query_length=32, response_length=8, learning_rate=3e-2,
                                        output_dir=str(tmp_path), progress=False, sample_every=0, checkpoint_every=0,
                                        export_final=False, plot=False, report_to="jsonl", rollout_engine="vllm"),
                                 **settings}, lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj"))
    return jaxppo.Trainer(ppo.replace(**tc), policy=(model, params), tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS[:8],
                          reward_fns=demo.lowercase_reward, eval_prompts=eval_prompts)


def run_trainer(tmp_path, push=True, iterations=2, **settings):
    """Train; return the metrics and the version of every push the trainer asked for. The
    trainer is closed at the end (its engine shut down), as the next one needs."""
    trainer = vllm_trainer(tmp_path, iterations, **settings)
    pushed, push_one = [], trainer.parts.rollout_engine.push
    trainer.parts.rollout_engine.push = lambda params, version: (pushed.append(version), push and push_one(params, version))
    try:
        return trainer.train(), pushed
    finally:
        trainer.close()


def test_trainer_samples_with_vllm_and_keeps_it_in_step_with_the_updates(tmp_path):
    """GRPO with a LoRA policy sampled by vLLM: the sampler's log-probs equal the scoring
    pass's in every iteration, the second one after the adapters were merged and pushed;
    without the push the second iteration's samples come from stale weights and show it."""
    history, _ = run_trainer(tmp_path / "pushed")
    assert [int(r["ppo/updates_applied"]) for r in history] == [2, 2]
    for record in history:
        assert record["sampling/sampling_logp_difference/max"] < 1e-4
    stale, _ = run_trainer(tmp_path / "stale", push=False)
    assert stale[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert stale[1]["sampling/sampling_logp_difference/max"] > 1e-3


def test_one_open_engine_per_process_and_a_closed_trainer_refuses_to_train(tmp_path):
    """vLLM's parallel state is process-wide and an engine's teardown clears it: while a
    trainer's engine is open a second one is refused before vLLM starts; `close()` shuts
    it down, after which the trainer refuses to train and the engine to sample (the next
    test's trainer then starts an engine of its own)."""
    trainer = vllm_trainer(tmp_path / "first", iterations=1)
    try:
        with pytest.raises(RuntimeError, match=r"another VLLMEngine is open in this process.*Trainer.close\(\)"):
            vllm_trainer(tmp_path / "second")
    finally:
        trainer.close()
    assert trainer.parts.rollout_engine.closed
    trainer.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match=r"this Trainer was closed \(Trainer.close\(\)\)"):
        trainer.train()
    assert not (tmp_path / "first" / "metrics.jsonl").exists()  # refused before the run started
    with pytest.raises(RuntimeError, match="this VLLMEngine was closed"):
        trainer.parts.rollout_engine.generate(*prompts(), num_generations=G, response_length=R, temperature=1.0,
                                stop_token_ids=(1,), pad_token_id=0)


def test_pipelined_iterations_sample_with_vllm_from_the_version_k_behind(tmp_path):
    """max_staleness=1 with vLLM: the producer thread pushes each version before sampling
    from it (iteration i from version i - 1); iteration 0's samples are the trained
    policy's (log-probs equal), later ones a version behind and corrected for."""
    history, pushed = run_trainer(tmp_path / "pipelined", iterations=3, max_staleness=1)
    assert pushed == [0, 0, 1]  # the version of each iteration's sampler (0: already in vLLM)
    assert [r["rollout/staleness_max"] for r in history] == [0, 1, 1]
    assert history[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert history[2]["sampling/sampling_logp_difference/max"] > 1e-3  # version 1 sampled, version 2 trained


def test_the_evaluation_samples_on_vllm_and_a_resumed_run_repeats_it(tmp_path):
    """Eval prompts with rollout_engine="vllm": the evaluation samples on vLLM, given the
    policy of its iteration (pushed; the final policy's too); its samples, and the
    training samples, are seeded from the run's keys, so a run stopped after one iteration
    and resumed logs what the uninterrupted run logs: every metric, the evaluations'
    included, and the same evaluation completions."""
    settings = dict(eval_prompts=demo.DEMO_PROMPTS[8:13], eval_every=1, eval_generations=2, eval_temperature=1.0,
                    checkpoint_every=1)
    whole, pushed = run_trainer(tmp_path / "whole", **settings)
    # Each iteration's batch and its evaluation (two chunks of 4 prompts x 2 rows: 8 rows at most, a training
    # batch's), then the final policy's evaluation; a version already in vLLM is not loaded again.
    assert pushed == [0, 0, 0, 1, 1, 1, 2, 2]
    run_trainer(tmp_path / "resumed", iterations=1, **settings)
    resumed, _ = run_trainer(tmp_path / "resumed", **settings)
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time/") and k not in ("eps", "eval/time")}
    assert [drop(r) for r in resumed] == [drop(r) for r in whole]
    assert "eval/reward_mean" in whole[0] and "eval/reward_mean" in whole[1]
    from jaxppo.tracking import read_table

    tables = [read_table(str(tmp_path / name / "eval_completions.table.jsonl")) for name in ("whole", "resumed")]
    assert tables[0] == tables[1] and len(tables[0]) == 2 * 5 * 2
