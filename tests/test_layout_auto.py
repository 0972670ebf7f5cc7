"""scan_layers="auto" (the trainer's and the command's default): scanned layers for deep
checkpoints, unrolled for shallow ones, the layout of the run being resumed kept, a given
(Model, params) pair left as it is."""

import json
import os

import pytest

import jaxppo
from jaxppo import demo
from jaxppo.models import hf as hf_io
from jaxppo.run import assembly
from jaxppo.run.assembly import AUTO_SCAN_MIN_LAYERS, resolve_layout
from jaxppo.run.directory import SETTINGS_FILE


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{layers: directory} of GPT-2-layout checkpoints whose config.json says one layer below
    the auto threshold and one at it (the rule reads the count from config.json before any
    weight loads; the weights are a one-layer model's, never loaded here)."""
    tokenizer = demo.demo_tokenizer()
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for layers in (AUTO_SCAN_MIN_LAYERS - 1, AUTO_SCAN_MIN_LAYERS):
        out[layers] = str(root / f"layers{layers}")
        hf_io.save_pretrained(*demo.demo_policy(tokenizer, width=8, layers=1, max_len=48), out[layers])
        config_file = os.path.join(out[layers], "config.json")
        with open(config_file) as f:
            config = json.load(f)
        config["n_layer"] = layers
        with open(config_file, "w") as f:
            json.dump(config, f)
    return out


def _loop(tmp_path, **settings):
    base = dict(iterations=1, query_length=32, response_length=4, learning_rate=1e-3, output_dir=str(tmp_path),
                progress=False, sample_every=0, checkpoint_every=1, export_final=False, plot=False,
                report_to="jsonl")
    base.update(settings)
    return base


def _tc(tmp_path, **settings):
    return jaxppo.Config.from_settings(**_loop(tmp_path, **settings))


def test_auto_scans_deep_checkpoints_and_keeps_given_models(checkpoints, tmp_path):
    tc = _tc(tmp_path).run
    assert hf_io.layer_count(checkpoints[AUTO_SCAN_MIN_LAYERS]) == AUTO_SCAN_MIN_LAYERS
    assert resolve_layout("auto", checkpoints[AUTO_SCAN_MIN_LAYERS], tc) is True
    assert resolve_layout("auto", checkpoints[AUTO_SCAN_MIN_LAYERS - 1], tc) is False
    pair = demo.demo_policy(demo.demo_tokenizer(), width=8, layers=AUTO_SCAN_MIN_LAYERS)
    assert resolve_layout("auto", pair, tc) is None  # a given model keeps its own layout
    for explicit in (True, False, None):
        assert resolve_layout(explicit, checkpoints[AUTO_SCAN_MIN_LAYERS], tc) is explicit
    with pytest.raises(ValueError, match=r"LayoutConfig.scan_layers='yes' is invalid; valid: True, False, 'auto'"):
        jaxppo.LayoutConfig(scan_layers="yes")


def test_auto_follows_the_saved_settings_of_the_run_it_resumes(checkpoints, tmp_path):
    deep = checkpoints[AUTO_SCAN_MIN_LAYERS]

    def saved(policy):
        (tmp_path / SETTINGS_FILE).write_text(json.dumps({"policy": policy}))

    saved({"path": deep})  # a run made unrolled (as 0.4 made every run): it stays unrolled
    assert resolve_layout("auto", deep, _tc(tmp_path).run) is False
    saved({"path": deep, "scan_layers": True})
    assert resolve_layout("auto", checkpoints[AUTO_SCAN_MIN_LAYERS], _tc(tmp_path).run) is True
    saved({"path": checkpoints[AUTO_SCAN_MIN_LAYERS - 1], "scan_layers": True})  # another policy: the rule
    assert resolve_layout("auto", deep, _tc(tmp_path).run) is True
    saved({"path": deep})
    assert resolve_layout("auto", deep, _tc(tmp_path, resume=False).run) is True  # not resuming: the rule

    # resume_from: the source run's settings, named by its directory or one of its checkpoints
    source = tmp_path / "source"
    (source / "checkpoints" / "3").mkdir(parents=True)
    (source / SETTINGS_FILE).write_text(json.dumps({"policy": {"path": deep}}))
    for named in (source, source / "checkpoints" / "3"):
        assert resolve_layout("auto", deep, _tc(tmp_path / "new", resume_from=str(named)).run) is False
    # a run directory's own settings only, not those of a folder above it
    (source / "runs" / "run").mkdir(parents=True)
    tc = _tc(tmp_path / "other", resume_from=str(source / "runs" / "run")).run
    assert resolve_layout("auto", deep, tc) is True


def test_a_run_made_unrolled_resumes_unrolled_under_the_default(tmp_path, capsys, monkeypatch):
    """Through the trainer: a checkpoint at the threshold loads scanned by default (and the
    run's settings say so); a run of it made with scan_layers=False resumes under the default
    with its own layout, where the other layout's checkpoint would not fit. (The threshold
    lowered to 2 layers here: the rule is the same and two unrolled layers compile fast.)"""
    monkeypatch.setattr(assembly, "AUTO_SCAN_MIN_LAYERS", 2)
    tokenizer = demo.demo_tokenizer()
    deep = str(tmp_path / "two_layers")
    hf_io.save_pretrained(*demo.demo_policy(tokenizer, width=8, layers=2, max_len=48), deep)
    ppo = jaxppo.Config.from_settings(batch_size=4, mini_batch_size=2, ppo_epochs=1, kl_coef=0.0)

    def trainer(out, iterations, **layout):
        return jaxppo.Trainer(ppo.replace(**_loop(out, iterations=iterations), **layout), policy=deep,
                              tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)

    scanned = trainer(tmp_path / "auto", 1)
    assert scanned.parts.models.policy_model.scan_layers
    settings = scanned.settings()  # what run_settings.json records, and a resume compares
    assert settings["policy"]["scan_layers"] is True and settings["policy"]["path"] == deep

    unrolled = trainer(tmp_path / "unrolled", 1, scan_layers=False)
    assert not unrolled.parts.models.policy_model.scan_layers
    first = unrolled.train()
    capsys.readouterr()
    resumed = trainer(tmp_path / "unrolled", 2)  # the default: "auto"
    assert not resumed.parts.models.policy_model.scan_layers
    history = resumed.train()
    assert "resumed from iteration 1" in capsys.readouterr().out  # its checkpoint restored, not refused
    assert [m["iteration"] for m in history] == [0, 1] and history[0] == first[0]
