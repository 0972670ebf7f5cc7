"""Evaluation during training (`Trainer(eval_prompts=...)`, `TrainerConfig.eval_*`,
`jaxppo.run.evaluation`): the eval completions against greedy decoding in a plain loop, the
metrics against plain reference loops over the logged completions (pass@k by enumerating
subsets), the schedule, a crashed and resumed run's evaluations equal to an uninterrupted
run's, and bad input refused before any model loads."""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo import demo
from jaxppo.errors import RewardError
from jaxppo.models.tokenizer import decode_responses
from jaxppo.rollout.engines.static import generate
from jaxppo.run.evaluation import pass_at_k
from jaxppo.tracking import read_metrics, read_table

from trainer_setup import small_trainer

PROMPTS = demo.DEMO_PROMPTS[:20]  # more than a training batch's 16 rows: several chunks, the last padded


def even_length(prompts, completions):
    """A binary reward: 1 where the completion has an even number of characters."""
    return [float(len(c) % 2 == 0) for c in completions]


def _subsets_pass_at_k(correct, k):
    """pass@k by enumeration: the share of k-subsets of the samples holding a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_equals_enumerating_every_subset():
    for n in range(1, 7):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_subsets_pass_at_k(correct, k), abs=1e-12)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_greedy_eval_completions_are_a_plain_loops_greedy_decoding(tmp_path):
    trainer = small_trainer(tmp_path / "run", iterations=1, eval_prompts=PROMPTS, eval_temperature=0.0,
                            eval_reward_fns=[even_length], export_final=False)
    initial = jax.tree.map(jnp.copy, trainer.policy_params())
    history = trainer.train()
    table = read_table(str(tmp_path / "run" / "eval_completions.table.jsonl"))
    assert [r["iteration"] for r in table] == [0] * len(PROMPTS)
    spec, tok = trainer.parts.spec, trainer.tokenizer
    for row, prompt in zip(table, PROMPTS):  # one prompt at a time, from the initial parameters
        ids, mask = jaxppo.models.encode_prompts(tok, [prompt], 32)
        out = generate(spec.policy, initial, ids, mask, jax.random.key(7), response_length=6, greedy=True,
                       stop_token_ids=spec.stop_token_ids, pad_token_id=spec.pad_token_id)
        assert row["prompt"] == prompt
        assert row["completion"] == decode_responses(tok, np.asarray(out.tokens), np.asarray(out.mask))[0]
        assert row["length"] == int(np.asarray(out.mask).sum())
        assert row["reward"] == row["even_length"] == even_length(None, [row["completion"]])[0]
    assert history[0]["eval/reward_mean"] == pytest.approx(np.mean([r["reward"] for r in table]))
    final = json.loads((tmp_path / "run" / "final_eval.json").read_text())
    assert final["iteration"] == 1 and final["eval/reward_mean"] == trainer.evaluate()["eval/reward_mean"]


def _check_against_the_table(rows, table, g):
    """Each evaluated line's metrics, recomputed from its logged completions in plain loops."""
    for line in rows:
        got = [r for r in table if r["iteration"] == line["iteration"]]
        assert len(got) == len(PROMPTS) * g
        rewards = [even_length(None, [r["completion"]])[0] for r in got]
        assert [r["reward"] for r in got] == rewards  # scored by the function, as logged
        assert line["eval/reward_mean"] == pytest.approx(np.mean(rewards))
        assert line["eval/completions/mean_length"] == pytest.approx(np.mean([r["length"] for r in got]))
        assert line["eval/completions/stopped_ratio"] == pytest.approx(np.mean([r["stopped"] for r in got]))
        for k in (1, 2, 3):
            per_prompt = [_subsets_pass_at_k([bool(x) for x in rewards[i * g:(i + 1) * g]], k)
                          for i in range(len(PROMPTS))]
            assert line[f"eval/pass@{k}"] == pytest.approx(np.mean(per_prompt), abs=1e-12)


def test_sampled_evaluations_follow_the_schedule_and_survive_a_crash_and_a_resume(tmp_path):
    calls, crash = [], [False]

    def crashing(prompts, completions):  # with crash set, the 4th iteration's scoring raises (a crash), once
        calls.append(1)
        if crash[0] and len(calls) == 4:
            raise ValueError("the judge went away")
        return demo.lowercase_reward(prompts, completions)

    settings = dict(iterations=5, checkpoint_every=2, eval_prompts=PROMPTS, eval_reward_fns=[even_length],
                    eval_every=2, eval_generations=3, eval_temperature=1.0, export_final=False)
    whole = small_trainer(tmp_path / "whole", reward_fns=crashing, **settings).train()
    calls.clear()
    crash[0] = True
    with pytest.raises(RewardError, match="the judge went away"):
        small_trainer(tmp_path / "crashed", reward_fns=crashing, **settings).train()
    resumed = small_trainer(tmp_path / "crashed", reward_fns=crashing, **settings).train()

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("eps", "eval/time")}
                for r in rows]

    assert [sorted(k for k in r if k.startswith("eval/")) != [] for r in whole] == [True, False, True, False, True]
    assert comparable(resumed) == comparable(whole)
    table = read_table(str(tmp_path / "crashed" / "eval_completions.table.jsonl"))
    assert sorted({r["iteration"] for r in table}) == [0, 2, 4]  # each evaluation's completions once
    assert table == read_table(str(tmp_path / "whole" / "eval_completions.table.jsonl"))
    _check_against_the_table([r for r in whole if "eval/reward_mean" in r], table, 3)
    assert read_metrics(str(tmp_path / "crashed" / "metrics.jsonl")) == resumed


def test_eval_bad_input_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import jaxppo.run.parts as parts

    monkeypatch.setattr(parts, "assemble", lambda *a, **k: pytest.fail("a model was loaded"))
    cases = [
        (dict(eval_prompts=[]), r"eval_prompts: no prompts: the prompt list is empty"),
        (dict(eval_reward_fns=[even_length]), r"eval_reward_fns were given without eval_prompts"),
        (dict(eval_prompts=PROMPTS, eval_reward_fns=["not callable"]), r"eval_reward_fns=\['not callable'\] is invalid"),
        (dict(eval_prompts=["word " * 200]), r"eval_prompts: .*longer than"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            small_trainer(tmp_path / "run", **kwargs)
    for field, value, message in [("eval_temperature", -1.0, "eval_temperature=-1.0 is invalid"),
                                  ("eval_generations", 0, "eval_generations=0 is invalid"),
                                  ("eval_every", -2, "eval_every=-2 is invalid"),
                                  ("eval_before_training", "yes", "eval_before_training='yes' is invalid")]:
        with pytest.raises(ValueError, match=message):
            jaxppo.Config.from_settings(**{field: value})


def _weights(directory):
    from safetensors.numpy import load_file

    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    return {f"{f}:{k}": v for f in files for k, v in load_file(os.path.join(directory, f)).items()}


def _same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)


def test_hugging_face_checkpoints_every_n_iterations_and_the_best_by_an_eval_metric(tmp_path):
    out = tmp_path / "run"
    trainer = small_trainer(out, iterations=4, save_hf_every=1, keep_hf=0, eval_prompts=PROMPTS,
                            eval_reward_fns=[even_length], eval_every=1, eval_generations=2, eval_temperature=1.0,
                            best_metric="eval/reward_mean", best_metric_mode="max")
    initial = tmp_path / "initial"
    trainer.export(str(initial))
    history = trainer.train()
    hf = out / "hf"
    assert sorted(os.listdir(hf)) == ["best", "best.json", "iteration_1", "iteration_2", "iteration_3", "iteration_4"]
    assert _same_weights(hf / "iteration_4", out / "final_policy")  # the policy after 4 iterations, as exported
    assert (hf / "iteration_2" / "tokenizer_config.json").is_file()
    values = [r["eval/reward_mean"] for r in history]
    best = json.loads((hf / "best.json").read_text())
    assert best == {"iteration": int(np.argmax(values)), "metric": "eval/reward_mean", "value": max(values),
                    "mode": "max"}
    # The best checkpoint holds the evaluated policy: the one after `iteration` iterations.
    assert _same_weights(hf / "best", initial if best["iteration"] == 0 else hf / f"iteration_{best['iteration']}")
    assert len(set(values)) > 1  # the choice was a choice
    # keep_hf keeps the newest; a later, extended run goes on from the recorded best.
    history = small_trainer(out, iterations=6, save_hf_every=1, keep_hf=2, eval_prompts=PROMPTS,
                            eval_reward_fns=[even_length], eval_every=1, eval_generations=2, eval_temperature=1.0,
                            best_metric="eval/reward_mean").train()
    assert sorted(os.listdir(hf)) == ["best", "best.json", "iteration_5", "iteration_6"]
    values = [r["eval/reward_mean"] for r in history]
    assert json.loads((hf / "best.json").read_text())["value"] == max(values)


def test_a_lora_run_checkpoints_its_peft_adapter_with_the_tokenizer(tmp_path):
    out = tmp_path / "run"
    small_trainer(out, iterations=2, save_hf_every=2, lora=jaxppo.models.LoraConfig(rank=2, alpha=4.0, targets=("c_attn",))).train()
    checkpoint = out / "hf" / "iteration_2"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(os.listdir(checkpoint))
    assert _same_weights(checkpoint, out / "final_adapter")


def test_best_metric_that_no_evaluation_produces_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import jaxppo.run.parts as parts

    monkeypatch.setattr(parts, "assemble", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ValueError, match=r"best_metric='eval/reward_mean' is chosen by an evaluation, and this run "
                                         r"has none: give eval_prompts"):
        small_trainer(tmp_path / "run", best_metric="eval/reward_mean")
    with pytest.raises(ValueError, match=r"best_metric='eval/pass@4' is not a metric this run's evaluation produces; "
                                         r"valid: .*eval/rewards/even_length/mean, eval/pass@1, eval/pass@2"):
        small_trainer(tmp_path / "run", best_metric="eval/pass@4", eval_prompts=PROMPTS, eval_reward_fns=[even_length],
                      eval_generations=2)
    with pytest.raises(ValueError, match=r"best_metric='reward' is invalid: .*starting with 'eval/'"):
        jaxppo.Config.from_settings(best_metric="reward")
    with pytest.raises(ValueError, match=r"best_metric_mode='up' is invalid"):
        jaxppo.Config.from_settings(best_metric_mode="up")


def _tree_digest(root):
    import hashlib

    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def test_resume_from_another_runs_checkpoint_continues_it_exactly_and_leaves_it_untouched(tmp_path):
    source = tmp_path / "source"
    whole = small_trainer(source, iterations=4, checkpoint_every=2, keep_checkpoints=2, sample_every=2,
                          num_samples=1, export_final=False).train()
    before = _tree_digest(source)

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in rows]

    # From one of its checkpoints: the run from iteration 2 equals the source's iterations 2-3.
    branch = small_trainer(tmp_path / "branch", iterations=4, resume_from=str(source / "checkpoints" / "2"),
                           sample_every=2, num_samples=1, export_final=False).train()
    assert comparable(branch) == comparable(whole)
    assert read_table(str(tmp_path / "branch" / "completions.table.jsonl")) == \
        read_table(str(source / "completions.table.jsonl"))
    # From the run directory: its newest checkpoint (4), extended to 5 iterations.
    longer = small_trainer(tmp_path / "longer", iterations=5, resume_from=str(source), sample_every=2, num_samples=1,
                           export_final=False).train()
    assert comparable(longer[:4]) == comparable(whole) and longer[4]["iteration"] == 4
    assert _tree_digest(source) == before  # the source is only read
    with pytest.raises(jaxppo.RunError, match=r"(?s)resume_from='.*source': the output directory '.*source' holds a run "
                                              r"with other settings .*learning_rate: was 0.001, now 0.002"):
        small_trainer(tmp_path / "other", iterations=4, resume_from=str(source), learning_rate=2e-3).train()
    assert not os.path.exists(tmp_path / "other" / "checkpoints" / "4")  # nothing copied
    with pytest.raises(jaxppo.RunError, match=r"resume_from='.*nowhere' is neither a run directory with a readable "
                                              r"checkpoint"):
        small_trainer(tmp_path / "none", resume_from=str(tmp_path / "nowhere")).train()
    with pytest.raises(ValueError, match=r"resume_from is given with resume=False"):
        jaxppo.Config.from_settings(resume_from=str(source), resume=False)


def test_callbacks_steer_the_run_stop_it_resumably_and_ask_for_checkpoints(tmp_path):
    from jaxppo.run import checkpoints

    events = []

    class Steer(jaxppo.Callback):
        def on_train_begin(self, trainer):
            events.append(("begin", trainer.iteration))

        def on_iteration_end(self, trainer, iteration, metrics):
            events.append(("end", iteration))
            return jaxppo.Control(checkpoint=iteration == 0, stop=iteration == 2)

        def on_train_end(self, trainer, history):
            events.append(("train_end", len(history)))

    seen = []
    plain = lambda iteration, metrics: seen.append(iteration)  # noqa: E731 - a callback as since 0.1
    out = tmp_path / "run"
    first = small_trainer(out, iterations=5, checkpoint_every=0, keep_checkpoints=5, export_final=False,
                          callbacks=[Steer(), plain]).train()
    assert [r["iteration"] for r in first] == [0, 1, 2] and seen == [0, 1, 2]
    assert events == [("begin", 0), ("end", 0), ("end", 1), ("end", 2), ("train_end", 3)]
    assert checkpoints.steps(str(out / "checkpoints")) == [1, 3]  # asked for after iteration 0; saved at the stop
    again = small_trainer(out, iterations=5, export_final=False, callbacks=[plain]).train()  # the same command
    whole = small_trainer(tmp_path / "whole", iterations=5, export_final=False).train()

    def comparable(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "eps"} for r in rows]

    assert comparable(again) == comparable(whole) and seen == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match=r"callback <lambda> returned 'stop' after iteration 0; a callback returns "
                                        r"None or a jaxppo.Control"):
        small_trainer(tmp_path / "bad", iterations=1, callbacks=[lambda it, m: "stop"]).train()


def test_a_reward_model_scores_the_evaluation_as_it_scores_training(tmp_path):
    """The run's reward model scores the eval completions too (weighted as in training, its
    own scores in the table): equal to the model applied to each greedy completion, one
    prompt at a time."""
    from jaxppo.models.model import join_sequences

    tokenizer = demo.demo_tokenizer()
    model, params = demo.demo_policy(tokenizer, width=32, layers=1, max_len=40)
    rm = jaxppo.models.Model(model.config, kind="reward")
    rm_params = rm.init(jax.random.key(1))

    def length(prompts, completions):
        return [float(len(c)) for c in completions]

    tc = dict(iterations=1, query_length=32, response_length=6, output_dir=str(tmp_path / "run"),
              progress=False, sample_every=0, plot=False, export_final=False, report_to="jsonl",
              eval_temperature=0.0)
    trainer = jaxppo.Trainer(jaxppo.Config.from_settings(batch_size=16, mini_batch_size=8).replace(**tc), policy=(model, params),
                             tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fns=[(rm, rm_params), length],
                             reward_weights=[2.0, 1.0], eval_prompts=PROMPTS[:6])
    initial = jax.tree.map(jnp.copy, trainer.policy_params())
    line = trainer.train()[0]
    table = read_table(str(tmp_path / "run" / "eval_completions.table.jsonl"))
    spec = trainer.parts.spec
    for row, prompt in zip(table, PROMPTS[:6]):
        ids, mask = jaxppo.models.encode_prompts(tokenizer, [prompt], 32)
        out = generate(spec.policy, initial, ids, mask, jax.random.key(0), response_length=6, greedy=True,
                       stop_token_ids=spec.stop_token_ids, pad_token_id=spec.pad_token_id)
        score = float(rm.apply(rm_params, *join_sequences(jnp.asarray(ids), jnp.asarray(mask), out.tokens,
                                                          out.mask))[0])
        assert row["reward_model"] == pytest.approx(score, abs=1e-4)
        assert row["reward"] == pytest.approx(2.0 * score + len(row["completion"]), abs=2e-4)
    assert line["eval/rewards/reward_model/mean"] == pytest.approx(np.mean([r["reward_model"] for r in table]))
