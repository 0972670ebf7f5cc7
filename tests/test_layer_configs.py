"""Every setting in the one config its concern names (`jaxppo.Config` composes them), and the
layers' views of them: the loss reads `Config.objective`, `train_step` `Config.update`, the
mini-batch loop `Config.batch`. Each concern validates its own settings (errors name the
concern), the rules that span two are checked by the config (errors name both), and a
setting the loss does not read leaves its view, and the compiled loss, as they were."""

import dataclasses
import re

import pytest

import jaxppo
from jaxppo.config.legacy import PPO_FIELDS, TRAINER_FIELDS
from jaxppo.config.renamed import DEPRECATED
from jaxppo.config.settings import CONCERNS, SETTINGS
from jaxppo.update import UpdateConfig
from jaxppo.update.objective import Objective, loss_for

CONFIG = jaxppo.Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4)


def test_every_setting_is_in_exactly_one_concern_and_no_concern_is_large():
    counts = {}
    for concern, cls in CONCERNS.items():
        for f in dataclasses.fields(cls):
            counts.setdefault(f.name, []).append(concern)
        # A concern a reader takes in at once: about 20 settings at most (the rule since 0.5).
        assert len(dataclasses.fields(cls)) <= 20, (cls.__name__, len(dataclasses.fields(cls)))
    assert all(len(c) == 1 for c in counts.values()), {n: c for n, c in counts.items() if len(c) > 1}
    assert len(dataclasses.fields(jaxppo.Config)) == len(CONCERNS) <= 13  # 13 since LoRA became settings (0.5)
    # Every setting of 0.4's two flat configs has a place (its own name) or a translation.
    assert set(PPO_FIELDS) | set(TRAINER_FIELDS) <= set(SETTINGS) | set(DEPRECATED)
    assert not set(DEPRECATED) & set(SETTINGS)
    # The Trainer keywords that are settings now sit with their concern.
    assert {SETTINGS[n] for n in ("dtype", "scan_layers", "remat", "mesh", "logits_chunk_size")} == {"layout"}
    assert SETTINGS["prompt_column"] == SETTINGS["chat_template"] == "data"
    assert SETTINGS["transformation"] == "optimizer"
    assert {SETTINGS[n] for n in ("lora_rank", "lora_alpha", "lora_targets", "lora_init")} == {"lora"}
    assert {SETTINGS[n] for n in ("mesh_data", "mesh_fsdp", "mesh_tensor")} == {"layout"}


def test_the_concerns_group_what_a_user_looks_for():
    expect = {"temperature": "sampling", "top_p": "sampling", "top_k": "sampling", "stop_tokens": "sampling",
              "kl_coef": "kl", "adaptive_kl_target": "kl", "kl_horizon": "kl", "kl_estimator": "kl", "kl_loss_coef": "kl",
              "overlong_penalty_factor": "rewards", "score_clip": "rewards", "missing_eos_penalty": "rewards",
              "share_prompts": "layout", "common_prefix": "layout", "pack_sequences": "layout",
              "learning_rate": "optimizer", "warmup_updates": "optimizer", "batch_size": "batch",
              "cliprange": "loss", "advantage_estimator": "advantages", "output_dir": "run", "eval_every": "evaluation",
              "query_length": "data", "max_turns": "environment"}
    assert {n: SETTINGS[n] for n in expect} == expect



def test_every_setting_is_described_where_it_lives_and_in_the_help():
    """Each concern's docstring describes each of its settings (the docs' table of settings
    and `jaxppo --help` read it), and describes nothing it does not hold."""
    from jaxppo.cli import build_parser
    from jaxppo.config.fields import describe

    help_text = " ".join(build_parser().format_help().split())
    for cls in CONCERNS.values():
        described = describe(cls)
        assert set(described) == set(cls.names()), cls.__name__
        assert all(len(text.split()) >= 3 for text in described.values()), cls.__name__
    words = " ".join(describe(CONCERNS["optimizer"])["warmup_updates"].split())
    assert f"--warmup-updates N|FRACTION {words}" in help_text
    assert describe(CONCERNS["optimizer"])["adam_beta2"] == describe(CONCERNS["optimizer"])["adam_eps"]  # one entry, two names

def test_the_views_read_each_setting_from_its_concern_unchanged():
    objective = CONFIG.objective
    sources = {"temperature": CONFIG.sampling, "num_generations": CONFIG.batch}
    for f in dataclasses.fields(Objective):
        if f.name == "uses_critic":
            continue
        owner = sources.get(f.name) or getattr(CONFIG, SETTINGS[f.name])
        assert getattr(objective, f.name) == getattr(owner, f.name), f.name
    assert objective.uses_critic is False and jaxppo.Config().objective.uses_critic is True  # the estimator's
    update = CONFIG.update
    assert isinstance(update, UpdateConfig) and update.batch is CONFIG.batch and update.objective == objective


@pytest.mark.parametrize("change,loss_changes", [
    (dict(kl_coef=0.3), False),
    (dict(learning_rate=1e-3), False),
    (dict(output_dir="elsewhere", iterations=3), False),
    (dict(cliprange_high=0.28), True),
    (dict(temperature=0.7), True),
    (dict(kl_loss_coef=0.01), True),
])
def test_a_setting_the_loss_does_not_read_leaves_its_compiled_loss_as_it_was(change, loss_changes):
    other = CONFIG.replace(**change)
    assert (other.objective != CONFIG.objective) is loss_changes
    assert (loss_for(print, other) is loss_for(print, CONFIG)) is not loss_changes


@pytest.mark.parametrize("concern,field,value,fragment", [
    ("loss", "cliprange", -1.0, "a finite real number >= 0"),
    ("loss", "loss_aggregation", "sum", "one of 'token_mean'"),
    ("layout", "pack_streams", 2, "None unless pack_sequences=True"),
    ("rewards", "overlong_buffer", 3, "None while overlong_penalty_factor is 0"),
    ("kl", "kl_coef", float("nan"), "a finite real number >= 0"),
    ("batch", "target_kl", 0.0, "None (no early stopping)"),
    ("sampling", "top_p", 1.5, "(0, 1]"),
    ("optimizer", "warmup_updates", 1.5, "an int >= 0 (updates) or a float in [0, 1)"),
    ("run", "keep_checkpoints", 0, "a positive int"),
])
def test_each_concern_checks_its_settings_and_names_itself(concern, field, value, fragment):
    cls = CONCERNS[concern]
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}=.* is invalid.*{re.escape(fragment)}"):
        cls(**{field: value})
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}=.* is invalid"):  # by name, through the Config
        CONFIG.replace(**{field: value})


@pytest.mark.parametrize("settings,names", [
    (dict(batch_size=8, mini_batch_size=4, num_generations=3), ("BatchConfig.batch_size", "num_generations=3")),
    (dict(advantage_estimator="grpo", num_generations=1), ("BatchConfig.num_generations=1", "'grpo'")),
    (dict(importance_ratio="sequence"), ("LossConfig.importance_ratio", "AdvantageConfig.advantage_estimator='gae'")),
    (dict(response_length=8, overlong_penalty_factor=1.0, overlong_buffer=9),
     ("RewardConfig.overlong_buffer=9", "SamplingConfig.response_length=8")),
    (dict(sampler_devices=1), ("LayoutConfig.sampler_devices=1", "SamplingConfig.max_staleness")),
    (dict(inflight_updates="keep", max_staleness=1), ("SamplingConfig.inflight_updates='keep'", "num_slots")),
    (dict(dynamic_sampling=True), ("RewardConfig.dynamic_sampling=True", "BatchConfig.num_generations=1")),
    (dict(advantage_estimator="rloo", num_generations=2, shared_trunk=True), ("AdvantageConfig.shared_trunk=True",)),
    (dict(mask_truncated_completions=True, stop_tokens=()), ("RewardConfig.mask_truncated_completions",
                                                              "SamplingConfig.stop_tokens=()")),
])
def test_rules_across_concerns_are_checked_in_one_place_naming_each_setting(settings, names):
    with pytest.raises(ValueError) as raised:
        jaxppo.Config.from_settings(**settings)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


def test_settings_by_name_and_by_concern_build_the_same_config():
    by_name = jaxppo.Config.from_settings(batch_size=32, mini_batch_size=8, cliprange=0.1, top_p=0.9, seed=3)
    by_concern = jaxppo.Config(batch=jaxppo.BatchConfig(batch_size=32, mini_batch_size=8),
                               loss=jaxppo.LossConfig(cliprange=0.1), sampling={"top_p": 0.9}, run={"seed": 3})
    assert by_name == by_concern and hash(by_name) == hash(by_concern)
    assert by_name.replace(loss=jaxppo.LossConfig(cliprange=0.3)).loss.cliprange == 0.3
    assert by_name.replace(cliprange=0.3) == by_name.replace(loss=by_name.loss.replace(cliprange=0.3))
    settings = by_name.settings()
    assert len(settings) == len(SETTINGS) and settings["top_p"] == 0.9
    assert jaxppo.Config.from_settings(settings) == by_name  # the flat view round-trips


def test_no_two_settings_are_the_same_words_reordered_and_the_old_names_translate():
    """Near-twins confuse (`target_kl`, the early stop, beside `kl_target`, the adaptive
    controller's, before 0.5): no two settings are the same words in another order.
    `skip_nonfinite` (updates, beside `skip_nonfinite_scores`) is `skip_nonfinite_updates`.
    The old names translate, with a warning, and a record that holds them compares equal."""
    from jaxppo.config.record import comparable

    words = {name: tuple(name.split("_")) for name in SETTINGS}
    reordered = [(a, b) for a in SETTINGS for b in SETTINGS if a < b and sorted(words[a]) == sorted(words[b])]
    assert not reordered, reordered
    assert "skip_nonfinite" not in SETTINGS and {"skip_nonfinite_updates", "skip_nonfinite_scores"} <= set(SETTINGS)
    # The check finds what it looks for (the names as 0.4 had them).
    assert sorted("target_kl".split("_")) == sorted("kl_target".split("_"))
    with pytest.warns(DeprecationWarning, match="kl_target -> adaptive_kl_target"):
        config = jaxppo.Config.from_settings(kl_target=0.3, skip_nonfinite=False)
    assert config.kl.adaptive_kl_target == 0.3 and config.batch.skip_nonfinite_updates is False
    with pytest.raises(ValueError, match="disagree"):
        jaxppo.Config.from_settings(kl_target=0.3, adaptive_kl_target=0.2)
    assert comparable({"trainer": {"kl_target": 0.5}}) == comparable({"kl": {"adaptive_kl_target": 0.5}})


def test_old_spellings_translate_where_settings_come_in_not_in_replace():
    """0.4's spellings (and 0.5's renames) are read where settings enter a run (`from_settings`,
    `for_algorithm`; the command and `--config` files go through `from_settings`), each with a
    warning; `Config.replace`, on the core path, takes the current names only and says which
    one to use."""
    with pytest.warns(DeprecationWarning, match="warmup_ratio -> warmup_updates"):
        config = jaxppo.Config.for_algorithm("grpo", warmup_ratio=0.1, batch_size=8, mini_batch_size=8,
                                           num_generations=4)
    assert config.optimizer.warmup_updates == 0.1 and config.loss.cliprange == 0.2
    with pytest.raises(ValueError, match=r"Config.replace\(kl_target=...\): 'kl_target' is a name before 0.5; give "
                                         r"adaptive_kl_target"):
        config.replace(kl_target=0.3)
    with pytest.raises(ValueError, match=r"'total_episodes' is a name before 0.5; give iterations"):
        config.replace(total_episodes=64)
    assert config.replace(adaptive_kl_target=0.3).kl.adaptive_kl_target == 0.3


def test_num_generations_is_a_batch_shape_and_estimators_read_it_through_their_view():
    """`num_generations` (rows = prompts x generations) is `BatchConfig`'s; an estimator is
    handed an `EstimatorConfig`: the advantage settings by name and the group size."""
    import copy
    import pickle

    from jaxppo.algorithms.base import EstimatorConfig

    config = jaxppo.Config.for_algorithm("grpo", batch_size=16, mini_batch_size=8, num_generations=4, grpo_eps=1e-3)
    assert config.batch.num_generations == 4 and not hasattr(config.advantages, "num_generations")
    assert config.prompts_per_batch == 4
    view = EstimatorConfig(config.advantages, config.batch.num_generations)
    assert (view.num_generations, view.grpo_eps, view.grpo_scale) == (4, 1e-3, "group")
    assert hash(view) == hash(copy.deepcopy(view)) and pickle.loads(pickle.dumps(view)) == view
    with pytest.raises(AttributeError):
        view.no_such_setting
    with pytest.raises(ValueError, match=r"BatchConfig.batch_size=16 is not a multiple of BatchConfig.num_generations=3"):
        jaxppo.BatchConfig(batch_size=16, mini_batch_size=8, num_generations=3)
