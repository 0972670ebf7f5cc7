"""PPOTrainer end to end on tiny local models: update counts, logging, export, exact resume,
Hugging Face policy + reward model, bad input, non-finite updates, the CLI."""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.cli import resolve

import hf_models

TRL_METRICS = ["objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
               "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens", "eps",
               "lr", "episode", "ppo/updates_applied"]


@pytest.fixture(scope="module")
def tokenizer():
    return demo.demo_tokenizer()


def small_configs(tmp, **trainer):
    ppo = jaxppo.Config.from_settings(batch_size=16, mini_batch_size=4, ppo_epochs=2, kl_coef=0.1)
    tc = dict(iterations=4, query_length=32, response_length=8, learning_rate=1e-3, output_dir=str(tmp),
              progress=False, sample_every=2, num_samples=1)
    tc.update(trainer)
    return ppo, dict(**tc)


def make_trainer(tokenizer, tmp, reward_fns=demo.lowercase_reward, callbacks=(), prompts=None, **trainer):
    ppo, tc = small_configs(tmp, **trainer)
    policy = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)
    return jaxppo.Trainer(ppo.replace(**tc), policy=policy, tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS if prompts is None else prompts,
                          reward_fns=reward_fns, callbacks=callbacks)


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("time/") and k != "eps"}


def test_run_counts_updates_logs_plots_and_exports(tokenizer, tmp_path):
    import transformers

    trainer = make_trainer(tokenizer, tmp_path, checkpoint_every=2)
    history = trainer.train()
    assert len(history) == 4
    for row in history:
        assert row["ppo/updates_applied"] == 2 * 16 // 4
        for name in TRL_METRICS:
            assert name in row and np.isfinite(row[name]), name
    assert int(trainer.state.step) == 4 * trainer.config.batch.updates_per_step
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [r["iteration"] for r in lines] == [0, 1, 2, 3]
    assert open(tmp_path / "metrics.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert any(f.startswith("events") for f in os.listdir(tmp_path / "tensorboard"))
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["2", "4"]

    # The exported policy is the trained one, as transformers sees it.
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final_policy")).eval()
    ids, mask = jm.encode_prompts(tokenizer, ["Hello there", "abc"], 12)
    import torch

    with torch.no_grad():
        ref = exported(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                       position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))).logits.numpy()
    ours = np.asarray(trainer.policy_model.apply(trainer.policy_params(), jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], ref[real], atol=1e-4)
    initial = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)[1]
    assert not np.allclose(np.asarray(jax.tree.leaves(initial)[0]), np.asarray(jax.tree.leaves(trainer.policy_params())[0]))


def test_interrupted_run_resumes_to_identical_metrics(tokenizer, tmp_path):
    straight = make_trainer(tokenizer, tmp_path / "a", iterations=6, checkpoint_every=2, export_final=False,
                            plot=False, report_to="jsonl").train()

    def kill_after_3(iteration, metrics):
        if iteration == 3:
            os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal: checkpoint, then KeyboardInterrupt

    run_b = tmp_path / "b"
    interrupted = make_trainer(tokenizer, run_b, iterations=6, checkpoint_every=2, export_final=False, plot=False,
                               report_to="jsonl", callbacks=[kill_after_3])
    with pytest.raises(KeyboardInterrupt):
        interrupted.train()
    assert interrupted.iteration == 4
    resumed = make_trainer(tokenizer, run_b, iterations=6, checkpoint_every=2, export_final=False, plot=False,
                           report_to="jsonl")
    history = resumed.train()
    assert [r["iteration"] for r in history] == list(range(6))
    assert [_comparable(r) for r in history] == [_comparable(r) for r in straight]
    lines = [json.loads(x)["iteration"] for x in open(run_b / "metrics.jsonl")]
    assert lines == list(range(6))


def test_hf_policy_against_hf_reward_model(tokenizer, tmp_path):
    policy_dir, rm_dir = hf_models.build_byte_level_pair(str(tmp_path), tokenizer)
    ppo, tc = small_configs(tmp_path / "run", iterations=2, export_final=False, plot=False)
    trainer = jaxppo.Trainer(ppo.replace(**tc), policy=policy_dir, reward_model=rm_dir,
                                tokenizer=jm.load_tokenizer(policy_dir), prompts=demo.DEMO_PROMPTS)
    # The critic starts as a copy of the reward model (TRL's default).
    rm_model, rm_params = jm.from_pretrained(rm_dir)
    critic_params = trainer.state.params["critic"]["params"]
    np.testing.assert_array_equal(np.asarray(critic_params["transformer"]["h_0"]["c_fc"]["kernel"]),
                                  np.asarray(rm_params["params"]["transformer"]["h_0"]["c_fc"]["kernel"]))
    history = trainer.train()
    assert [r["ppo/updates_applied"] for r in history] == [8, 8]
    # Scores are the reward model's scores of prompt + response.
    rows, gen = trainer.last.samples
    ids, mask = jnp.asarray(trainer.parts.table.ids[rows]), jnp.asarray(trainer.parts.table.mask[rows])
    rm_scores = rm_model.apply(rm_params, jnp.concatenate([ids, gen.tokens], 1), jnp.concatenate([mask, gen.mask], 1))
    assert history[-1]["objective/raw_scores"] == pytest.approx(float(jnp.mean(rm_scores)), abs=1e-5)


def test_shared_trunk_and_adaptive_kl(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, iterations=2, shared_trunk=True, adaptive_kl_target=0.5, kl_horizon=100,
                           kl_estimator="k3", export_final=True, plot=False, report_to="jsonl")
    history = trainer.train()
    assert "value_head" in trainer.state.params["params"]
    assert int(trainer.state.step) == 2 * trainer.config.batch.updates_per_step
    beta = trainer.config.kl.kl_coef
    for row in history:
        assert row["objective/kl_coef"] == pytest.approx(beta, rel=1e-5)
        beta *= 1 + min(max(row["objective/kl"] / 0.5 - 1, -0.2), 0.2) * 16 / 100
    assert float(trainer.run.kl.beta) == pytest.approx(beta, rel=1e-5)
    jm.from_pretrained(str(tmp_path / "final_policy"))  # exported without the value head


def test_bad_input_is_refused(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tokenizer, tmp_path, prompts=[])
    long_prompt = ["x" * 40]
    with pytest.raises(ValueError, match=r"longer than DataConfig.query_length=32 \(--query-length\).*"
                                         r"overlong_prompts='truncate'"):
        make_trainer(tokenizer, tmp_path, prompts=long_prompt)
    trainer = make_trainer(tokenizer, tmp_path, prompts=long_prompt, overlong_prompts="truncate")
    assert trainer.parts.table.mask.all()
    with pytest.raises(ValueError, match="give a reward: reward_model"):
        ppo, tc = small_configs(tmp_path)
        jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tokenizer), tokenizer=tokenizer, prompts=["a"])

    for bad, message in [(lambda p, r: [1.0] * (len(r) - 1), "expected \\(16,\\)"),
                         (lambda p, r: [float("inf")] * len(r), "non-finite")]:
        trainer = make_trainer(tokenizer, tmp_path, reward_fns=bad)
        before = jax.tree.map(np.asarray, trainer.state.params)
        with pytest.raises(ValueError, match=message):
            trainer.step()
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.state.params)):
            np.testing.assert_array_equal(a, np.asarray(b))
    with pytest.raises(ValueError, match="total_episodes=20 is not a multiple"):  # 0.4's name, read where settings come in
        jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8, total_episodes=20)


def test_nonfinite_losses_skip_updates_and_warn(tokenizer, tmp_path):
    def nan_reward(p_ids, p_mask, r_ids, r_mask):
        # Finite scores (so they pass the score check) whose whitening overflows to NaN.
        return jnp.full((r_ids.shape[0],), 3e38) * jnp.where(jnp.arange(r_ids.shape[0]) % 2 == 0, 1.0, -1.0)

    ppo, tc = small_configs(tmp_path, iterations=1)
    trainer = jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tokenizer, width=32, layers=1, max_len=40),
                                tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fns=nan_reward,
                                reward_fn_on="tokens")
    before = jax.tree.map(np.asarray, trainer.state.params)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        metrics = trainer.step()
    assert metrics["ppo/updates_applied"] == 0 and int(trainer.state.skipped_nonfinite) == ppo.batch.updates_per_step
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_cli_flags_config_file_and_errors(tmp_path):
    config, extras = resolve([])
    assert extras["is_demo"] and config.batch.batch_size == demo.DEMO_PPO["batch_size"]
    assert config.run.iterations == demo.DEMO_TRAINER["iterations"]
    config_file = tmp_path / "run.toml"
    config_file.write_text('mini-batch-size = 8\nppo_epochs = 3\ntarget_kl = 0.5\n[kl]\nkl_estimator = "k3"\n')
    config, extras = resolve(["--config", str(config_file), "--ppo-epochs", "2", "--no-whiten-advantages",
                              "--target-kl", "none", "--score-clip", "3", "--model", "/some/dir"])
    b = config.batch
    assert (b.mini_batch_size, b.ppo_epochs, config.advantages.whiten_advantages, b.target_kl) == (8, 2, False, None)
    assert config.kl.kl_estimator == "k3" and config.rewards.score_clip == 3.0  # a flat key, and one in a table
    assert extras["model"] == "/some/dir" and not extras["is_demo"]
    assert b.batch_size == jaxppo.BatchConfig().batch_size  # library defaults, not the demo's, with --model
    with pytest.raises(SystemExit, match="mini_batch_size=7"):
        resolve(["--mini-batch-size", "7"])
    bad_file = tmp_path / "bad.json"
    bad_file.write_text(json.dumps({"batch_sise": 4}))
    with pytest.raises(SystemExit, match="batch_sise"):
        resolve(["--config", str(bad_file)])


@pytest.mark.slow
def test_command_uses_a_persistent_compilation_cache_by_default(tmp_path):
    """The `jaxppo` command caches compiled programs under ~/.cache/jaxppo/xla (here a
    temporary HOME), reuses them in a second run with equal results, and `none` turns it off."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from xla_options import with_devices

    env = {k: v for k, v in os.environ.items() if k not in (
        "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
        "JAX_COMPILATION_CACHE_MAX_SIZE")}  # a user's environment, with the tests' quick code generation
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=root, XLA_FLAGS=with_devices(os.environ.get("XLA_FLAGS", ""), 1))
    args = [sys.executable, "-m", "jaxppo", "--iterations", "1", "--batch-size", "16", "--mini-batch-size", "8",
            "--response-length", "6", "--no-progress", "--sample-every", "0", "--no-plot", "--no-export-final"]
    cache = tmp_path / "home" / ".cache" / "jaxppo" / "xla"
    for run in ("a", "b"):
        done = subprocess.run(args + ["--output-dir", str(tmp_path / run)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        if run == "a":
            entries = sorted(os.listdir(cache))
            assert any("train_step" in name for name in entries) and any("generate" in name for name in entries)
    assert set(entries) <= set(os.listdir(cache))  # kept, and read by the second run (equal results below)
    rows = [[_comparable(json.loads(x)) for x in open(tmp_path / run / "metrics.jsonl")] for run in ("a", "b")]
    assert rows[0] == rows[1]
    env["HOME"] = str(tmp_path / "home2")
    done = subprocess.run(args + ["--output-dir", str(tmp_path / "c"), "--compilation-cache", "none"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (tmp_path / "home2" / ".cache" / "jaxppo").exists()


@pytest.mark.parametrize("remat,scan,chunk", [("dots_with_no_batch_dims_saveable", None, None), (True, True, 3)],
                         ids=["remat", "remat-scanned-chunked"])
def test_remat_scanned_layers_and_logit_chunks_change_nothing_but_memory(tokenizer, tmp_path, remat, scan, chunk):
    rows = []
    for remat_, scan_, chunk_, out in ((None, None, None, "a"), (remat, scan, chunk, "b")):
        ppo, tc = small_configs(tmp_path / out, iterations=1, remat=remat_, scan_layers=scan_,
                                logits_chunk_size=chunk_)
        trainer = jaxppo.Trainer(ppo.replace(**tc), policy=demo.demo_policy(tokenizer, width=32, layers=2, max_len=40),
                                 tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
        if remat_ is not None:
            assert trainer.policy_model.remat == remat_ and trainer.state.apply_fn.critic.remat == remat_
        rows.append(_comparable(trainer.step()))
    assert trainer.policy_model.scan_layers == bool(scan) == trainer.state.apply_fn.critic.scan_layers
    assert trainer.policy_model.logits_chunk_size == chunk
    assert rows[0].keys() == rows[1].keys()
    for name in rows[0]:
        assert rows[1][name] == pytest.approx(rows[0][name], rel=1e-4, abs=1e-6), name
    if scan:  # the export is Hugging Face's per-layer layout, whatever the trainer's
        trainer.export(str(tmp_path / "export"))
        model, params = jm.from_pretrained(str(tmp_path / "export"))
        assert not model.scan_layers
        want = jm.unstack_layers(trainer.state.params["policy"], model.config)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_update_donates_the_old_train_state_and_nothing_else(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, iterations=1)
    old = jax.tree.leaves(trainer.state)
    others = jax.tree.leaves(trainer.parts.ref_params)
    trainer.step()
    assert all(x.is_deleted() for x in old if isinstance(x, jax.Array))  # one train state in memory, not two
    assert not any(x.is_deleted() for x in others)
    trainer.step()  # and the trainer goes on with the new one


def test_bfloat16_compute_keeps_float32_master_weights(tokenizer, tmp_path):
    policy_dir, rm_dir = hf_models.build_byte_level_pair(str(tmp_path), tokenizer)
    ppo, tc = small_configs(tmp_path / "run", iterations=1, export_final=False, plot=False, dtype="bfloat16",
                            ref_dtype="bfloat16", reward_dtype="bfloat16")
    trainer = jaxppo.Trainer(ppo.replace(**tc), policy=policy_dir, reward_model=rm_dir,
                             tokenizer=jm.load_tokenizer(policy_dir), prompts=demo.DEMO_PROMPTS)
    assert trainer.policy_model.dtype == "bfloat16" and trainer.state.apply_fn.critic.dtype == "bfloat16"
    dtypes = lambda tree: {str(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes(trainer.state.params) == {"float32"} and dtypes(trainer.state.opt_state) == {"float32"}
    assert dtypes(trainer.parts.ref_params) == {"bfloat16"} and dtypes(trainer.parts.reward_params) == {"bfloat16"}
    metrics = trainer.step()
    assert metrics["ppo/updates_applied"] == ppo.batch.updates_per_step and np.isfinite(metrics["loss/total_avg"])
    assert dtypes(trainer.state.params) == {"float32"}


def test_the_update_compiles_in_the_background_once_and_that_program_runs(tmp_path):
    """The first iteration's `train_step` is compiled ahead of time from the rollout's
    abstract form while the iteration samples; that compiled program runs every update (the
    jitted path never compiles), and a rollout unlike the abstract one falls back to it."""
    import optax

    from jaxppo.run import compiled
    from jaxppo.update.ppo import train_step, train_step_donating

    from trainer_setup import small_trainer

    before = train_step_donating._cache_size()
    trainer = small_trainer(tmp_path, iterations=2)
    history = trainer.train()
    assert isinstance(trainer.train_step, compiled.Precompiled) and trainer.train_step.compiled is not None
    assert train_step_donating._cache_size() == before  # the plain path compiled nothing
    assert [r["ppo/updates_applied"] for r in history] == [trainer.config.batch.updates_per_step] * 2

    model = jm.Model(jm.ModelConfig(model_type="llama", vocab_size=40, hidden_size=16, num_layers=1, num_heads=2,
                                    num_kv_heads=1, intermediate_size=32, max_position_embeddings=32))
    params = model.init(jax.random.key(0))
    config = jaxppo.Config.for_algorithm("grpo", batch_size=4, mini_batch_size=4, ppo_epochs=1, num_generations=2,
                                            kl_loss_coef=0.0)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    rng = np.random.default_rng(0)

    def rollout(r):
        return jaxppo.RolloutBatch(query_tokens=jnp.asarray(rng.integers(0, 40, (4, 3)), jnp.int32),
                                   query_mask=jnp.ones((4, 3), jnp.int32),
                                   response_tokens=jnp.asarray(rng.integers(0, 40, (4, r)), jnp.int32),
                                   response_mask=jnp.ones((4, r), jnp.int32), logprobs=jnp.full((4, r), -3.7),
                                   values=None, rewards=jnp.zeros((4, r)), scores=jnp.asarray([0.0, 1.0, 1.0, 0.0]))

    class Step:  # a step as `compiled.Precompiled` takes one (this one keeps the state: the test reuses it)
        def __call__(self, s, r, k):
            return train_step(s, r, k, config=config)

        def lower(self, s, r, k):
            return train_step.lower(s, r, k, config=config)

    step = Step()
    real = rollout(5)
    wrong = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rollout(6))  # another response width
    precompiled = compiled.Precompiled(step, (state, wrong, jax.random.key(1)))
    got, _ = precompiled(state, real, jax.random.key(1))
    assert precompiled.compiled is None  # it fell back
    want, _ = step(state, real, jax.random.key(1))
    np.testing.assert_array_equal(jax.tree.leaves(got.params)[0], jax.tree.leaves(want.params)[0])


def test_the_documented_research_loop_is_one_trainer_iteration(tmp_path):
    """docs/research.md's chain of `jaxppo.run.iteration` stages on a trainer's parts, with
    the public `train_step`, gives the parameters one `trainer.train()` iteration gives
    (float32 rounding: the trainer runs the update compiled ahead of time, with donation)."""
    from jaxppo.run import iteration

    from trainer_setup import small_trainer

    trainer = small_trainer(tmp_path / "loop", iterations=1, export_final=False)
    parts, run = trainer.parts, trainer.run
    k_sample, k_train = run.iteration_keys(run.iteration)
    batch = iteration.select_prompts(parts.table, run.key, run.iteration, trainer.config)
    gen, _ = parts.collector.sample(run, batch, k_sample, run.iteration)
    scores = iteration.reward(parts.host_rewards, trainer.tokenizer, parts.table, batch, gen, run.iteration)
    built = iteration.build(parts.spec, run.train.params, parts.ref_params, parts.reward_params, batch, gen, scores,
                            run)
    assert built.rollout.sampler_logprobs.shape == built.rollout.logprobs.shape
    state, metrics = jaxppo.train_step(run.train, built.rollout, k_train, trainer.config)
    assert int(state.step) == trainer.config.batch.updates_per_step == 4

    reference = small_trainer(tmp_path / "trainer", iterations=1, export_final=False)
    reference.train()
    leaves = jax.tree.leaves(reference.state.params)
    assert len(leaves) == len(jax.tree.leaves(state.params))
    for ours, theirs in zip(jax.tree.leaves(state.params), leaves):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-6)
    changed = [not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(small_trainer(
                   tmp_path / "fresh", iterations=1, export_final=False).state.params))]
    assert any(changed)  # the update moved the parameters (the comparison above is not of two copies)

