"""Reward-model training (`jaxppo.RewardTrainer`): the Bradley-Terry loss against a plain
loop and against TRL 1.12's `RewardTrainer` (tokenization, loss and gradients on identical
weights and batches), the compiled steps against a plain loop of optax updates, the update
count, gradient accumulation, exact resume after a kill, the export that transformers
loads, LoRA, the command, and bad input."""

import copy
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.models.hf import hf_arrays
from jaxppo.cli import reward_model_main as main
from jaxppo.run.reward_model import RewardModelConfig, RewardTrainer
from jaxppo.update.minibatches import minibatch_indices
from jaxppo.update.preference import bradley_terry_loss, preference_loss_fn

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}")


def letter_pairs(n, seed=0, margin=False, prompt=True):
    """Text pairs a tiny model learns at once: lowercase letters chosen over digits."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(2, 7))
        row = {"chosen": "".join(rng.choice(list("abcdefgh"), k)), "rejected": "".join(rng.choice(list("0123456"), k))}
        if prompt:
            row["prompt"] = "q" * int(rng.integers(1, 4)) + ":"
        if margin:
            row["margin"] = float(rng.uniform(0, 1))
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GPT-2 causal LM (the "SFT model") and its byte tokenizer (pad 0, EOS 1), and
    the same weights as a GPT2ForSequenceClassification with a random score head."""
    import transformers

    tok = demo.demo_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.eos_token_id,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, num_labels=1)
    root = tmp_path_factory.mktemp("rm")
    causal, classifier = str(root / "sft"), str(root / "classifier")
    lm = transformers.GPT2LMHeadModel(config)
    lm.save_pretrained(causal)
    tok.save_pretrained(causal)
    torch.manual_seed(1)
    seq = transformers.GPT2ForSequenceClassification(config)
    seq.transformer.load_state_dict(lm.transformer.state_dict())
    seq.save_pretrained(classifier)
    tok.save_pretrained(classifier)
    return causal, classifier, tok


def small_config(tmp_path, **settings):
    base = dict(batch_size=16, mini_batch_size=8, epochs=1, learning_rate=1e-3, output_dir=str(tmp_path / "run"),
                checkpoint_every=0)
    return RewardModelConfig.from_settings(**{**base, **settings})


def test_the_loss_equals_a_plain_loop():
    rng = np.random.default_rng(0)
    chosen, rejected, margin = (rng.normal(size=6).astype(np.float32) for _ in range(3))
    for m, coef in ((None, None), (margin, None), (margin, 0.01), (None, 0.5)):
        terms = []
        for i in range(6):
            d = float(chosen[i]) - float(rejected[i]) - (0.0 if m is None else float(m[i]))
            terms.append(-math.log(1.0 / (1.0 + math.exp(-d))))
        want = sum(terms) / 6
        if coef is not None:
            want += coef * sum((float(chosen[i]) + float(rejected[i])) ** 2 for i in range(6)) / 6
        loss, stats = bradley_terry_loss(jnp.asarray(chosen), jnp.asarray(rejected),
                                         None if m is None else jnp.asarray(m), coef)
        assert float(loss) == pytest.approx(want, rel=1e-5)
        assert float(stats["accuracy"]) == pytest.approx(np.mean(chosen > rejected))
        assert float(stats["margin"]) == pytest.approx(np.mean(chosen - rejected), rel=1e-5, abs=1e-6)


TRL_CASES = {
    "text": (dict(), dict(), False),
    # The padding token is the EOS token (as for Llama, Qwen, SmolLM2): the appended EOS is
    # padding to transformers, so both read the score at the token before it.
    "pad-is-eos": (dict(), dict(), False),
    "text-margin": (dict(), dict(), True),
    "center-rewards": (dict(center_rewards_coefficient=0.01), dict(center_rewards_coefficient=0.01), False),
    "chat": (dict(), dict(), False),
}


def _chat(rows):
    return [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]


@pytest.mark.parametrize("case", list(TRL_CASES))
def test_tokens_loss_and_gradients_equal_trl(checkpoint, tmp_path, case):
    import datasets
    import transformers
    from trl import RewardConfig as TRLRewardConfig
    from trl import RewardTrainer as TRLRewardTrainer

    _, classifier, tok = checkpoint
    trl_settings, ours, margin = TRL_CASES[case]
    if case == "pad-is-eos":
        tok = copy.deepcopy(tok)
        tok.pad_token = tok.eos_token
    rows = letter_pairs(8, seed=3, margin=margin)
    if case == "chat":
        rows = _chat(rows)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(classifier)
    args = TRLRewardConfig(output_dir=str(tmp_path / "trl"), report_to=[], bf16=False, fp16=False, use_cpu=True,
                           gradient_checkpointing=False, per_device_train_batch_size=8, **trl_settings)
    trl_trainer = TRLRewardTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                   processing_class=tok)
    examples = [trl_trainer.train_dataset[i] for i in range(8)]
    inputs = trl_trainer.data_collator([{k: e[k] for k in ("chosen_ids", "rejected_ids", "margin") if k in e}
                                        for e in examples])
    trl_trainer.model.train()
    loss = trl_trainer.compute_loss(trl_trainer.model, dict(inputs))
    loss.backward()
    want = {name: p.grad.detach().numpy() for name, p in trl_trainer.model.named_parameters()}

    config = small_config(tmp_path, batch_size=8, **ours)
    trainer = RewardTrainer(classifier, rows, config=config, tokenizer=tok)
    assert trainer.model.config.pad_token_id == tok.pad_token_id == trl_trainer.model.config.pad_token_id
    # TRL's tokens, pair by pair.
    for i, e in enumerate(examples):
        for side, key in enumerate(("chosen_ids", "rejected_ids")):
            got = trainer.pairs.tokens[i, side][trainer.pairs.mask[i, side] == 1]
            np.testing.assert_array_equal(got, e[key])
    loss_fn = preference_loss_fn(trainer.model.apply, config.pairs.center_rewards_coefficient)
    (ours_loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainer.state.params, trainer.pairs.arrays())
    assert float(ours_loss) == pytest.approx(loss.item(), rel=1e-5)
    got = dict((name, np.asarray(g).T if transpose else np.asarray(g))
               for name, g, transpose in hf_arrays(trainer.model, grads))
    assert set(got) <= set(want) and len(got) >= len(want) - 1  # all but the tied lm_head (no classifier has one)
    for name, g in got.items():
        np.testing.assert_allclose(g, want[name], rtol=2e-4, atol=2e-6, err_msg=name)


def _plain_run(trainer, steps):
    """The steps as a plain Python loop: each step's rows, the same permutation per mini-batch,
    one optax update per mini-batch with gradients of the loss on those pairs."""
    config = trainer.config
    tx = trainer.state.tx
    params = jax.device_get(trainer.state.params)
    opt_state = tx.init(params)
    loss_fn = preference_loss_fn(trainer.model.apply, config.pairs.center_rewards_coefficient)
    for step in range(steps):
        rows = trainer.rows_of_step(step)
        order = np.asarray(minibatch_indices(jax.random.fold_in(trainer.run.key, step), config.batch))[0]
        for idx in order:
            (_, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, trainer.pairs.arrays(rows[idx]))
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    return params


def test_steps_equal_a_plain_loop_and_the_update_count_is_pinned(checkpoint, tmp_path):
    causal, _, _ = checkpoint
    # Plain SGD (and Adam below): Adam's first steps (g / |g|) magnify float rounding in tiny gradients.
    trainer = RewardTrainer(causal, letter_pairs(40), config=small_config(tmp_path, epochs=2,
                                                                          transformation=optax.sgd(0.1)))
    assert trainer.steps == math.ceil(2 * 40 / 16) and trainer.total_updates == trainer.steps * 2
    want = _plain_run(trainer, trainer.steps)
    for _ in range(trainer.steps):
        trainer.train_step()
    assert int(trainer.state.step) == trainer.total_updates == 10
    for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Every pair is trained on: the two epochs' orders each hold all 40 pairs.
    seen = np.concatenate([trainer.rows_of_step(s) for s in range(trainer.steps)])
    assert sorted(seen[:40]) == list(range(40)) and sorted(seen[40:80]) == list(range(40))


def test_accumulation_gives_the_same_update(checkpoint, tmp_path):
    causal, _, _ = checkpoint
    rows = letter_pairs(16, margin=True)
    results = []
    for k in (1, 4):
        config = small_config(tmp_path / str(k), gradient_accumulation_steps=k, transformation=optax.sgd(0.1))
        trainer = RewardTrainer(causal, rows, config=config)
        trainer.train_step()
        results.append(jax.device_get(trainer.state.params))
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_training_learns_and_the_export_loads_in_transformers(checkpoint, tmp_path):
    import transformers

    causal, _, tok = checkpoint
    config = small_config(tmp_path, epochs=4, eval_fraction=0.25, eval_every=3, report_to=("jsonl", "tensorboard"))
    trainer = RewardTrainer(causal, letter_pairs(64), config=config)
    before = trainer.evaluate()
    last = trainer.train()
    assert last["eval/accuracy"] >= 0.9 > before["accuracy"] - 0.1 and last["eval/margin"] > before["margin"] + 0.5
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["iteration"] for m in lines] == list(range(trainer.steps))
    assert [m["iteration"] for m in lines if "eval/accuracy" in m] == [2, 5, 8, 11]
    export = str(tmp_path / "run" / "reward_model")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(export)
    assert hf.config.architectures == ["GPT2ForSequenceClassification"] and hf.config.pad_token_id == tok.pad_token_id
    chosen, rejected = trainer.pair_scores()
    pairs = trainer.eval_pairs
    with torch.no_grad():  # transformers, right-padded as the pairs are
        logits = hf(input_ids=torch.tensor(pairs.tokens[:, 0].astype(np.int64)),
                    attention_mask=torch.tensor(pairs.mask[:, 0].astype(np.int64))).logits[:, 0].numpy()
    np.testing.assert_allclose(logits, chosen, rtol=1e-4, atol=1e-5)
    # jaxppo's trainers load it as a reward model.
    model, params = jm.from_pretrained(export)
    assert model.kind == "reward"
    np.testing.assert_allclose(np.asarray(model.apply(params, jnp.asarray(pairs.tokens[:, 1]),
                                                      jnp.asarray(pairs.mask[:, 1]))), rejected, rtol=1e-5, atol=1e-6)


def test_a_killed_run_resumes_exactly(checkpoint, tmp_path, monkeypatch):
    causal, _, _ = checkpoint
    rows = letter_pairs(48)
    straight = RewardTrainer(causal, rows, config=small_config(tmp_path / "a", epochs=2, checkpoint_every=2))
    straight.train()
    config = small_config(tmp_path / "b", epochs=2, checkpoint_every=2)
    killed = RewardTrainer(causal, rows, config=config)
    complete = RewardTrainer.complete

    def dies_at_step_5(self, rows):
        if self.step == 5:
            raise KeyboardInterrupt
        return complete(self, rows)

    monkeypatch.setattr(RewardTrainer, "complete", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):  # the loop saves a checkpoint (at step 5) on its way out
        killed.train()
    monkeypatch.setattr(RewardTrainer, "complete", complete)
    resumed = RewardTrainer(causal, rows, config=config)
    resumed.train()
    assert resumed.step == straight.step == 6 and int(resumed.state.step) == int(straight.state.step)
    for a, b in zip(jax.tree.leaves(resumed.state.params), jax.tree.leaves(straight.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(resumed.state.opt_state), jax.tree.leaves(straight.state.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lines = [json.loads(line) for line in open(tmp_path / "b" / "run" / "metrics.jsonl")]
    assert [m["iteration"] for m in lines] == list(range(6))
    # Another setting in the same directory is refused, naming it.
    with pytest.raises(jaxppo.RunError, match="center_rewards_coefficient"):
        RewardTrainer(causal, rows, config=config.replace(center_rewards_coefficient=0.1)).train()


def test_lora_trains_adapters_and_the_head_only(checkpoint, tmp_path):
    import transformers

    causal, _, _ = checkpoint
    config = small_config(tmp_path, lora_rank=4, lora_alpha=8, lora_targets=("c_attn",), epochs=2)
    trainer = RewardTrainer(causal, letter_pairs(32), config=config)
    base = jax.device_get(trainer.state.params["params"])
    trainer.train()
    after = jax.device_get(trainer.state.params["params"])
    assert not np.array_equal(base["score"]["kernel"], after["score"]["kernel"])
    for path, value in jax.tree_util.tree_leaves_with_path(base):
        if "score" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(value, _at(after, path))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "run" / "reward_model"))
    pairs = trainer.pairs
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor(pairs.tokens[:4, 0].astype(np.int64)),
                    attention_mask=torch.tensor(pairs.mask[:4, 0].astype(np.int64))).logits[:, 0].numpy()
    chosen, _ = trainer.pair_scores(pairs.take(np.arange(8)))
    np.testing.assert_allclose(logits, chosen[:4], rtol=1e-4, atol=1e-5)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


def test_the_command(checkpoint, tmp_path, capsys):
    causal, _, _ = checkpoint
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in letter_pairs(32, margin=True)))
    out = tmp_path / "cmd"
    flags = ["--pairs", str(pairs), "--model", causal, "--output-dir", str(out), "--batch-size", "16",
             "--mini-batch-size", "8", "--learning-rate", "1e-3", "--eval-fraction", "0.25"]
    assert main(flags) == 0
    assert os.path.isfile(out / "reward_model" / "model.safetensors")
    # The same command again (through `jaxppo`): the finished run is found, nothing is retrained.
    from jaxppo import cli

    capsys.readouterr()
    assert cli.main(["reward-model"] + flags + ["--no-progress", "--no-plot"]) == 0  # free on resume, as a policy run's
    assert "resumed from iteration 2" in capsys.readouterr().out
    assert cli.main(["reward-model"] + flags + ["--center-rewards-coefficient", "0.01"]) == 1
    assert "holds a run with other settings" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--batch-size: BatchConfig.batch_size=16 is not divisible by "
                       "BatchConfig.mini_batch_size=6: every row .a completion, or a reward model's pair. must land in exactly "
                       "one mini-batch"):
        main(["--pairs", str(pairs), "--model", causal, "--batch-size", "16", "--mini-batch-size", "6"])


@pytest.mark.parametrize("rows, message", [
    ([{"chosen": "ab"}], r"pairs row 0 has no 'rejected' field \(its fields: \['chosen'\]\)"),
    ([{"chosen": "ab", "rejected": "cd", "margin": "1.0"}], r"pairs row 0 field 'margin' is '1.0' \(str\); a margin is "
                                                            "a finite real number"),
    ([{"chosen": "ab", "rejected": "cd", "margin": 1.0}, {"chosen": "ab", "rejected": "cd"}],
     r"pairs row 1 lacks a 'margin' field but pairs row 0 has one"),
    ([{"chosen": "ab", "rejected": "cd"}, {"chosen": [{"role": "user", "content": "x"}], "rejected": "cd"}],
     r"pairs row 1 is a chat pair but pairs row 0 is a text pair"),
    ([{"chosen_ids": [1, 2], "rejected_ids": [3, 100000]}], r"token id 100000, outside the model's vocabulary of"),
    ([{"chosen": "a" * 80, "rejected": "b"}], r"1 of the 1 pairs have a sequence longer than max_length=64 tokens"),
    ([], r"pairs is empty"),
    (["ab"], r"pairs row 0 is a str"),
])
def test_bad_pairs_are_refused_before_the_weights_load(checkpoint, tmp_path, rows, message, monkeypatch):
    causal, _, _ = checkpoint
    monkeypatch.setattr(jaxppo.run.reward_model, "load_reward_model", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises((ValueError, TypeError), match=message):
        RewardTrainer(causal, rows, config=small_config(tmp_path, batch_size=8, max_length=64))


def test_bad_settings_are_refused(checkpoint, tmp_path):
    causal, _, _ = checkpoint
    with pytest.raises(ValueError, match="no setting 'learning_rat' .did you mean 'learning_rate'"):
        RewardModelConfig.from_settings(learning_rat=1e-4)
    with pytest.raises(ValueError, match="center_rewards_coefficient=-1 is invalid"):
        jaxppo.config.PairConfig(center_rewards_coefficient=-1)
    with pytest.raises(ValueError, match="batch_size=16 is more than the 12 training pairs"):
        RewardTrainer(causal, letter_pairs(12), config=small_config(tmp_path))
    with pytest.raises(ValueError, match="give eval_pairs or PairConfig.eval_fraction=0.5, not both"):
        RewardTrainer(causal, letter_pairs(32), eval_pairs=letter_pairs(4), config=small_config(tmp_path,
                                                                                                eval_fraction=0.5))
    dropped = RewardTrainer(causal, letter_pairs(32) + [{"prompt": "q", "chosen": "a" * 80, "rejected": "1"}],
                            config=small_config(tmp_path, max_length=64, overlong_pairs="drop"))
    assert len(dropped.pairs) == 32 and dropped.dropped == {"pairs": 1}


def test_the_settings_are_the_shared_concerns_by_their_names():
    """A reward-model run's settings are `jaxppo.Config`'s concerns (one name each, the same
    names), TRL's defaults over them; one it would not read is refused, not ignored."""
    config = RewardModelConfig.from_settings(batch_size=16, mini_batch_size=4, epochs=2, lora_rank=8, dtype="bfloat16",
                                             seed=3, checkpoint_every=5, learning_rate=2e-5)
    assert (config.batch.batch_size, config.batch.mini_batch_size, config.batch.ppo_epochs) == (16, 4, 1)
    assert config.pairs.epochs == 2 and config.layout.dtype == "bfloat16" and config.run.seed == 3
    assert config.lora.lora == jm.LoraConfig(rank=8, alpha=16.0, targets="all-linear")
    assert config.optimizer.learning_rate == 2e-5 and config.optimizer.lr_schedule == "linear"  # TRL's schedule kept
    assert config.run.checkpoint_every == 5 and config.run.report_to == "jsonl"
    for name in ("batch_size", "epochs", "lora_rank", "dtype", "seed", "learning_rate"):  # Config's names, one each
        assert name in jaxppo.Config.flags() or name == "epochs"
    with pytest.raises(ValueError, match=r"RunConfig.iterations=5 is not a setting of a reward-model run \(the run's "
                                         r"length is PairConfig.epochs"):
        RewardModelConfig.from_settings(iterations=5)
    with pytest.raises(ValueError, match="BatchConfig.ppo_epochs=2 is not a setting of a reward-model run"):
        RewardModelConfig.from_settings(ppo_epochs=2)
    with pytest.raises(ValueError, match="no setting 'save_every' .it is 'checkpoint_every' now"):
        RewardModelConfig.from_settings(save_every=2)
    with pytest.raises(ValueError, match="LayoutConfig.dtype='int8' is invalid"):
        RewardModelConfig.from_settings(dtype="int8")


def test_the_command_reads_a_config_file_and_callbacks_steer_the_loop(checkpoint, tmp_path, capsys):
    """`--config` holds a reward-model run's settings in tables by concern, as a policy run's
    file does; callbacks see each step and may stop the run (resumable, as a policy run's)."""
    causal, _, _ = checkpoint
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in letter_pairs(32)))
    settings = tmp_path / "rm.toml"
    settings.write_text(f'[batch]\nbatch_size = 8\nmini_batch_size = 4\n[pairs]\nepochs = 0.5\n'
                        f'[run]\noutput_dir = "{tmp_path / "cmd"}"\nprogress = false\n')
    assert main(["--pairs", str(pairs), "--model", causal, "--config", str(settings), "--learning-rate", "1e-3"]) == 0
    lines = [json.loads(line) for line in open(tmp_path / "cmd" / "metrics.jsonl")]
    assert [m["iteration"] for m in lines] == [0, 1] and lines[-1]["updates"] == 4  # 16 pairs, 8 a step, 2 updates
    seen = []

    class StopAfterTwo(jaxppo.Callback):
        def on_iteration_end(self, trainer, iteration, metrics):
            seen.append((iteration, trainer.step, metrics["loss"]))
            return jaxppo.Control(stop=iteration == 1)

    config = small_config(tmp_path / "cb", batch_size=8, mini_batch_size=4, epochs=1)
    trainer = RewardTrainer(causal, letter_pairs(32), config=config, callbacks=[StopAfterTwo()])
    trainer.train()
    assert [(i, s) for i, s, _ in seen] == [(0, 1), (1, 2)] and trainer.step == 2 < trainer.steps == 4
    assert "stopped by a callback after 2 iterations (of 4)" in capsys.readouterr().out
