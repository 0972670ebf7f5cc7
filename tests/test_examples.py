"""Every example runs on tiny local models and does what it says."""

import importlib.util
import json
import os
import pathlib
import sys

import numpy as np
import pytest

import hf_models
from trainer_setup import run_command
from jaxppo import demo

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"examples_{name}"] = module  # dataclasses (Flax modules) need their module registered
    spec.loader.exec_module(module)
    return module


def test_research_train_step_learns_and_counts_updates():
    result = load("research_train_step").main(["--iterations", "12", "--batch-size", "32", "--mini-batch-size", "8"])
    assert result["updates_per_step"] == 4 * 32 // 8
    assert result["step"] == 12 * result["updates_per_step"]
    # The score starts near chance (1/16 of tokens on target) and must clearly rise.
    assert result["last"] > result["first"] + 0.2, result


def test_demo_example_runs_with_flags(tmp_path):
    history = load("demo").main(["--iterations", "2", "--batch-size", "16", "--mini-batch-size", "4",
                                 "--response-length", "8", "--output-dir", str(tmp_path), "--no-progress"])
    assert [h["ppo/updates_applied"] for h in history] == [16, 16]
    assert (tmp_path / "metrics.png").is_file() and (tmp_path / "final_policy" / "config.json").is_file()


def test_hf_policy_reward_example(tmp_path):
    policy, rm = hf_models.build_byte_level_pair(str(tmp_path), demo.demo_tokenizer())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in demo.DEMO_PROMPTS[:10]))
    history = load("hf_policy_reward").main([
        "--model", policy, "--reward-model", rm, "--prompts", str(prompts), "--iterations", "2",
        "--batch-size", "8", "--mini-batch-size", "4", "--ppo-epochs", "1", "--gradient-accumulation-steps", "2",
        "--query-length", "32", "--response-length", "6", "--output-dir", str(tmp_path / "run"), "--no-progress",
        "--scan-layers", "--remat", "full", "--logits-chunk-size", "4"])  # the settings it recommends
    assert [h["ppo/updates_applied"] for h in history] == [2, 2]
    assert all(np.isfinite(h["loss/total_avg"]) for h in history)
    with pytest.raises(SystemExit, match="--reward-model"):
        load("hf_policy_reward").main(["--model", policy])


@pytest.mark.parametrize("flags", [[], ["--token-reward"]], ids=["text", "tokens"])
def test_custom_reward_example(tmp_path, flags):
    history = load("custom_reward").main(["--iterations", "2", "--output-dir", str(tmp_path)] + flags)
    assert len(history) == 2 and all(np.isfinite(h["objective/scores"]) for h in history)


@pytest.mark.parametrize("sizes", [(8, 2, 2, 1), (16, 8, 1, 4)])
def test_chex_update_count_pattern(sizes):
    load("test_update_counts").test_updates_per_train_step_are_pinned(*sizes)


@pytest.mark.slow
def test_main_job_default_demo_learns(tmp_path):
    """The README's first command: the embedded demo with its defaults."""
    run_command("--output-dir", tmp_path, "--no-progress")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == demo.DEMO_TRAINER["iterations"]
    first = np.mean([r["objective/scores"] for r in rows[:10]])
    last = np.mean([r["objective/scores"] for r in rows[-10:]])
    kl = [r["objective/kl"] for r in rows]
    assert last > first + 2.0, (first, last)
    assert max(kl[-10:]) < 40.0, kl[-10:]  # bounded by the KL penalty
    assert all(r["ppo/updates_applied"] == 16 for r in rows)
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


def test_grpo_verifiable_example_passes_the_answer_column(tmp_path):
    module = load("grpo_verifiable")
    seen = []
    original = module.exact_match

    def spy(prompts, completions, answer):
        seen.append((list(prompts), list(answer)))
        return original(prompts, completions, answer)

    module.exact_match = spy
    history = module.main(["--iterations", "2", "--output-dir", str(tmp_path)])
    answers = {r["prompt"]: r["answer"] for r in module.make_dataset()}
    assert len(seen) == 2 and all(a == [answers[p] for p in prompts] for prompts, a in seen)
    assert all(len(prompts) == 64 and len(set(prompts)) <= 8 for prompts, _ in seen)  # 8 prompts x 8 completions
    assert all(r["ppo/updates_applied"] == 8 and 0.0 <= r["rewards/spy/mean"] <= 1.0 for r in history)


def test_grpo_two_rewards_example_weights_both(tmp_path):
    history = load("grpo_two_rewards").main(["--iterations", "2", "--output-dir", str(tmp_path)])
    for row in history:
        assert row["reward"] == pytest.approx(row["rewards/lowercase_reward/mean"]
                                              + 0.5 * row["rewards/variety/mean"] * row["rewards/variety/scored_fraction"],
                                              rel=1e-5)
        assert "loss/value_avg" not in row and row["clip_ratio/region_mean"] >= 0.0


@pytest.mark.slow
def test_main_job_grpo_demo_learns(tmp_path):
    """`jaxppo --algorithm grpo`: the demo's task with GRPO, no critic."""
    run_command("--algorithm", "grpo", "--output-dir", tmp_path, "--no-progress", "--no-plot")
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == demo.DEMO_TRAINER["iterations"]
    first = np.mean([r["objective/scores"] for r in rows[:10]])
    last = np.mean([r["objective/scores"] for r in rows[-10:]])
    assert last > first + 2.0, (first, last)
    assert all(r["ppo/updates_applied"] == 16 and "loss/value_avg" not in r for r in rows)
    settings = json.loads((tmp_path / "run_settings.json").read_text())
    assert settings["advantages"]["advantage_estimator"] == "grpo" and settings["batch"]["num_generations"] == 8


def test_algorithm_flag_sets_defaults_and_flags_override():
    from jaxppo.cli import resolve

    ppo, _ = resolve(["--algorithm", "dapo", "--cliprange-high", "0.3", "--num-generations", "4"])
    assert (ppo.advantages.advantage_estimator, ppo.loss.cliprange_low, ppo.loss.cliprange_high, ppo.batch.num_generations) == ("grpo", 0.2, 0.3, 4)
    assert ppo.kl.kl_coef == 0.0 and ppo.loss.loss_aggregation == "token_mean"
    ppo, _ = resolve([])
    assert ppo.advantages.advantage_estimator == "gae" and ppo.batch.num_generations == 1
    with pytest.raises(SystemExit, match="--algorithm 'grpo2' is invalid; valid: ppo, grpo"):
        resolve(["--algorithm", "grpo2"])


def test_lora_qwen3_example_exports_a_peft_adapter_equal_to_the_merged_policy(tmp_path):
    """The LoRA example on a tiny local Qwen3: it trains, and its two exports agree: peft's
    model (base checkpoint + final_adapter/) gives the logits of final_policy/ (merged)."""
    import peft
    import torch
    import transformers

    base_dir = str(tmp_path / "qwen3")
    base = hf_models.build_qwen3_with_tokenizer(base_dir, demo.demo_tokenizer())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in demo.DEMO_PROMPTS[:8]))
    run = tmp_path / "run"
    history = load("lora_qwen3").main([
        "--model", base_dir, "--prompts", str(prompts), "--iterations", "2", "--batch-size", "8",
        "--mini-batch-size", "4", "--ppo-epochs", "1", "--lora-rank", "4", "--learning-rate", "1e-2", "--query-length", "32",
        "--response-length", "6", "--output-dir", str(run), "--no-progress", "--scan-layers"])
    assert [h["ppo/updates_applied"] for h in history] == [2, 2]
    assert all(np.isfinite(h["loss/total_avg"]) for h in history)
    adapter_config = json.load(open(run / "final_adapter" / "adapter_config.json"))
    assert adapter_config["r"] == 4 and adapter_config["base_model_name_or_path"] == os.path.abspath(base_dir)
    ids = torch.tensor([[5, 9, 40, 41, 42, 7]])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final_policy")).eval()(ids).logits
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(run / "final_adapter")).eval()(ids).logits
    assert (merged - before).abs().max() > 1e-3  # training moved the adapters
    np.testing.assert_allclose(adapted.numpy(), merged.numpy(), atol=1e-4, rtol=0)


def test_tool_calculator_learns_to_use_the_tool(tmp_path):
    """After the warm start, GRPO with the calculator tool raises exact match on the
    questions the warm start never showed, and the episodes call the tool."""
    result = load("tool_calculator").main(["--output-dir", str(tmp_path)])
    (_, unseen_before, _), (_, unseen_after, calls) = result["before"], result["after"]
    assert unseen_after > unseen_before + 0.2, result
    rewards = [r["reward"] for r in result["history"]]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.2
    assert calls > 0.9 and result["history"][-1]["env/tool_errors/parse"] < 8


def test_the_sums_demo_holds_out_unordered_pairs_and_parses_the_last_integer():
    train, held = demo.sum_pairs(0)
    assert len(held) == demo.SUMS_HELD_OUT and len(set(held)) == len(held)
    unordered = {(min(a, b), max(a, b)) for a, b in held}
    assert not any((min(a, b), max(a, b)) in unordered for a, b in train)  # neither order is trained on
    lo, hi = demo.SUMS_OPERANDS
    assert len(train) + sum(2 - (a == b) for a, b in held) == (hi - lo + 1) ** 2  # every other pair is trained on
    rows = demo.sums_rows([(13, 29)])
    assert rows == [{"prompt": [{"role": "user", "content": "What is 13 + 29?"}], "answer": 42}]
    cases = {"13 + 29 = 42": 42, "The sum is 42.\n": 42, "To add 13 and 29": 29, "no number": None, "-3": -3}
    assert {text: demo.parse_answer(text) for text in cases} == cases
    assert demo.sums_reward(None, ["13 + 29 = 42", "13 + 29 = 41", "To add 13 and 29"], [42, 42, 42]) == [1.0, 0.0, 0.0]


def test_reward_functions_from_the_command_line(tmp_path, monkeypatch):
    """`--reward MODULE:FN` (repeatable) with `--reward-weight`: the functions a user names
    reach the trainer with their weights, receive the prompts' columns, and score the run."""
    import textwrap

    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        calls = []
        def starts_with_a(prompts, completions, topic):
            calls.append(list(topic))
            return [float(c[:1] == "a") for c in completions]
        def length(prompts, completions):
            return [len(c) / 10 for c in completions]
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "topic": f"t{i}"}) for i, p in enumerate(demo.DEMO_PROMPTS[:8])))
    from jaxppo.cli import build_trainer, resolve

    args = ["--prompts", str(prompts), "--reward", "my_rewards:starts_with_a", "--reward", "my_rewards:length",
            "--reward-weight", "2", "--reward-weight", "0.5", "--iterations", "1", "--batch-size", "8",
            "--mini-batch-size", "4", "--response-length", "4", "--output-dir", str(tmp_path / "run"), "--no-progress",
            "--no-plot", "--report-to", "jsonl", "--no-export-final"]
    config, extras = resolve(args)
    assert extras["reward"] == ["my_rewards:starts_with_a", "my_rewards:length"] and extras["reward_weight"] == [2.0, 0.5]
    history = build_trainer(config, extras).train()
    import my_rewards

    assert my_rewards.calls and all(t.startswith("t") for t in my_rewards.calls[0])  # the column reached it
    row = history[0]
    assert row["reward"] == pytest.approx(2 * row["rewards/starts_with_a/mean"] + 0.5 * row["rewards/length/mean"],
                                          rel=1e-5)
