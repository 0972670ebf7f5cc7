import dataclasses
import importlib
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from jaxppo import Config


def test_derived_counts():
    cfg = Config.from_settings(batch_size=96, mini_batch_size=24, ppo_epochs=3, gradient_accumulation_steps=4)
    assert cfg.batch.num_minibatches == 4
    assert cfg.batch.micro_batch_size == 6
    assert cfg.batch.updates_per_step == 12


def test_frozen_and_hashable_as_static_jit_argument():
    cfg = Config.from_settings(batch_size=8, mini_batch_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch.batch_size = 16
    assert hash(cfg) == hash(Config.from_settings(batch_size=8, mini_batch_size=4))

    f = jax.jit(lambda x, config: x * config.batch.num_minibatches, static_argnums=1)
    assert int(f(jnp.int32(3), cfg)) == 6


def test_replace_revalidates():
    cfg = Config.from_settings(batch_size=8, mini_batch_size=4)
    assert cfg.replace(mini_batch_size=2).batch.num_minibatches == 4
    with pytest.raises(ValueError, match="mini_batch_size"):
        cfg.replace(mini_batch_size=3)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        (dict(batch_size=0), ["batch_size=0", "positive int"]),
        (dict(batch_size=-8), ["batch_size=-8", "positive int"]),
        (dict(batch_size=8.0, mini_batch_size=4), ["batch_size=8.0", "float"]),
        (dict(batch_size=True, mini_batch_size=1), ["batch_size=True", "bool"]),
        (dict(mini_batch_size=0), ["mini_batch_size=0"]),
        (dict(ppo_epochs=0), ["ppo_epochs=0"]),
        (dict(ppo_epochs=2.5), ["ppo_epochs=2.5"]),
        (dict(gradient_accumulation_steps=0), ["gradient_accumulation_steps=0"]),
        (dict(batch_size=10, mini_batch_size=4), ["batch_size=10", "mini_batch_size=4", "[1, 2, 5, 10]"]),
        (
            dict(batch_size=12, mini_batch_size=6, gradient_accumulation_steps=4),
            ["mini_batch_size=6", "gradient_accumulation_steps=4", "[1, 2, 3, 6]"],
        ),
        (dict(cliprange=-0.1), ["cliprange=-0.1", ">= 0"]),
        (dict(cliprange_value=-1), ["cliprange_value=-1"]),
        (dict(vf_coef=float("nan")), ["vf_coef=nan"]),
        (dict(ent_coef=-0.01), ["ent_coef=-0.01"]),
        (dict(kl_coef=-1.0), ["kl_coef=-1.0"]),
        (dict(gamma=1.5), ["gamma=1.5", "[0, 1]"]),
        (dict(lam=-0.1), ["lam=-0.1", "[0, 1]"]),
        (dict(lam="0.9"), ["lam='0.9'"]),
        (dict(whiten_advantages=1), ["whiten_advantages=1", "bool"]),
        (dict(whiten_rewards="yes"), ["whiten_rewards='yes'"]),
        (dict(common_prefix=1), ["common_prefix=1", "None", "True or False"]),
        (dict(share_prompts=0), ["share_prompts=0", "None", "True or False"]),
        (dict(temperature=0.0), ["temperature=0.0", "> 0"]),
        (dict(temperature=float("inf")), ["temperature=inf"]),
        (dict(target_kl=0.0), ["target_kl=0.0", "None"]),
        (dict(target_kl=-1.0), ["target_kl=-1.0"]),
    ],
)
def test_invalid_values_name_field_value_and_valid_range(kwargs, fragments):
    with pytest.raises(ValueError) as err:
        Config.from_settings(**kwargs)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_valid_edge_values_accepted():
    with pytest.warns(UserWarning, match=r"LossConfig.cliprange=0: the ratio is clipped to exactly 1"):
        cfg = Config.from_settings(
            batch_size=1, mini_batch_size=1, cliprange=0, gamma=0, lam=1, ent_coef=0.0, target_kl=0.02, temperature=0.7
        )
    assert cfg.batch.updates_per_step == cfg.batch.ppo_epochs


def test_legal_settings_that_are_almost_surely_mistakes_warn_and_the_seed_fits_the_key():
    """A learning rate above 1 and a clip range of 0 are accepted with a warning; seeds
    span what jax.random.key keeps (32 bits): 2**32 - 1 is valid, 2**32 (which the key would
    cut to 0, repeating seed 0's run) is refused; so is an infinite learning rate."""
    import warnings

    import jax

    with pytest.warns(UserWarning, match=r"learning_rate=3.0 is above 1"):
        Config.from_settings(learning_rate=3.0)
    with pytest.warns(UserWarning, match=r"critic_learning_rate=2.0 is above 1"):
        Config.from_settings(critic_learning_rate=2.0)
    with pytest.warns(UserWarning, match=r"LossConfig.cliprange=1.0: the ratio's lower clip 1 - 1.0 is <= 0.* the "
                                         r"lower clip is gone"):
        Config.from_settings(cliprange=1.0)
    with pytest.warns(UserWarning, match=r"LossConfig.cliprange_low=1.0: .*the lower clip is gone"):
        Config.from_settings(cliprange_low=1.0, cliprange_high=0.28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.from_settings(learning_rate=1e-5, seed=2**32 - 1)
        Config.from_settings(cliprange=0.2)
        Config.from_settings(cliprange=0.99)
        Config.from_settings(cliprange=1.5, cliprange_low=0.2)  # the lower clip is cliprange_low's
    assert (jax.random.key_data(jax.random.key(2**32)) == jax.random.key_data(jax.random.key(0))).all()
    with pytest.raises(ValueError, match=r"seed=4294967296 \(--seed\) is invalid: .* repeat the run of seed 0"):
        Config.from_settings(seed=2**32)
    with pytest.raises(ValueError, match=r"learning_rate=inf is invalid: learning_rate must be a finite number > 0"):
        Config.from_settings(learning_rate=float("inf"))


# ---------------------------------------------------------------- run directories of before the concerns

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "run_settings_0_5_dev")
LOOP = dict(iterations=2, query_length=32, response_length=6, learning_rate=1e-3, progress=False, sample_every=0,
            checkpoint_every=1, export_final=False, plot=False)


def _same_run(name, output_dir, version="0_5_dev", **changes):
    """Today's trainer of the run whose settings `tests/data/make_run_settings.py`
    recorded with the flat configs of 0.4.0 or of 0.5-dev (their 0.4 spellings in today's:
    `overlong_prompts`, `stop_tokens`, `warmup_updates` as a fraction, `report_to`,
    `iterations`)."""
    import jaxppo
    from jaxppo import demo

    tok = demo.demo_tokenizer()
    if version == "0_4":
        if name == "ppo":
            config = Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1,
                                          overlong_prompts="truncate", stop_tokens=(5,), warmup_updates=1,
                                          lr_schedule="cosine", report_to="jsonl", **LOOP)
            rewards = dict(reward_fns=demo.lowercase_reward)
        else:
            config = Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4,
                                          top_entropy_quantile=0.5, stop_tokens=(2,), kl_estimator="k3",
                                          max_grad_norm=0.5, **LOOP)
            rewards = dict(reward_fns=[demo.lowercase_reward, demo.lowercase_reward], reward_weights=[1.0, 0.5])
    elif name == "ppo":
        config = Config.from_settings(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1, overlong_prompts="truncate",
                                      stop_tokens=("eos", 5), warmup_updates=0.25, lr_schedule="cosine",
                                      report_to="jsonl", **LOOP)
        rewards = dict(reward_fns=demo.lowercase_reward)
    else:
        config = Config.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4,
                                      top_entropy_quantile=0.5, stop_tokens=(2,), overlong_prompts="filter", top_p=0.9,
                                      kl_estimator="k3", max_grad_norm=0.5, **LOOP)
        rewards = dict(reward_fns=[demo.lowercase_reward, demo.lowercase_reward], reward_weights=[1.0, 0.5])
    config = config.replace(output_dir=str(output_dir), **changes)
    return jaxppo.Trainer(config, policy=demo.demo_policy(tok, width=32, layers=1, max_len=40), tokenizer=tok,
                          prompts=demo.DEMO_PROMPTS, **rewards)


@pytest.mark.parametrize("version", ["0_4", "0_5_dev"])
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_a_run_directory_of_before_the_concerns_resumes_and_a_changed_setting_is_named(tmp_path, name, version):
    """run_settings.json as 0.4.0 and 0.5-dev wrote it (flat "ppo" and "trainer" sections,
    0.4's spellings: truncate_prompts, stop_token_id(s), warmup_ratio, total_episodes, a
    reward function given alone; 0.4 without the settings added since) against today's
    settings of the same run: nothing differs, so the run resumes; a setting changed since
    is named by its concern, the old value read through the old spelling."""
    import shutil

    from jaxppo.errors import RunError
    from jaxppo.run.directory import SETTINGS_FILE, check_settings

    data = os.path.join(os.path.dirname(DATA), f"run_settings_{version}")
    shutil.copyfile(os.path.join(data, f"{name}.json"), tmp_path / SETTINGS_FILE)
    check_settings(str(tmp_path), _same_run(name, tmp_path, version).settings(), write=False)
    with pytest.raises(RunError) as raised:
        check_settings(str(tmp_path), _same_run(name, tmp_path, version, learning_rate=2e-3, top_p=0.5).settings(),
                       write=False)
    assert "OptimizerConfig.learning_rate: was 0.001, now 0.002" in str(raised.value)
    assert ("SamplingConfig.top_p: was 0.9, now 0.5" if (name, version) == ("grpo", "0_5_dev") else
            "SamplingConfig.top_p: was 1.0 (the default), now 0.5") in str(raised.value)


def test_the_0_4_configs_still_build_the_same_run_with_a_warning_naming_the_new_places(tmp_path):
    """`PPOConfig(...)` and `TrainerConfig(...)` with 0.4's fields, and `Trainer(ppo, tc,
    reward_fn=...)`: each warns (naming `Config` and the concerns the settings went to) and
    the run is the one today's spelling builds, the same settings to the byte."""
    import jaxppo
    from jaxppo import demo

    with pytest.warns(DeprecationWarning, match=r"jaxppo.PPOConfig is deprecated since 0.5 .*Config.batch, Config.kl"):
        ppo = jaxppo.PPOConfig(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1)
    with pytest.warns(DeprecationWarning, match=r"jaxppo.TrainerConfig is deprecated since 0.5 .*Config.data"):
        tc = jaxppo.TrainerConfig(truncate_prompts=True, stop_token_ids=(5,), warmup_ratio=0.25, lr_schedule="cosine",
                                  tensorboard=False, total_episodes=32, output_dir=str(tmp_path),
                                  **{k: v for k, v in LOOP.items() if k != "iterations"})
    assert ppo.batch_size == 16 and ppo.updates_per_step == 4 and tc.truncate_prompts and tc.overlong == "truncate"
    tok = demo.demo_tokenizer()
    with pytest.warns(DeprecationWarning) as said:
        old = jaxppo.Trainer(ppo, tc, policy=demo.demo_policy(tok, width=32, layers=1, max_len=40), tokenizer=tok,
                             prompts=demo.DEMO_PROMPTS, reward_fn=demo.lowercase_reward)
    text = " ".join(str(w.message) for w in said)
    assert "Trainer(ppo_config, trainer_config, ...) is deprecated" in text and "reward_fns=f" in text
    assert old.config == _same_run("ppo", tmp_path).config
    assert json.dumps(old.settings(), sort_keys=True) == json.dumps(_same_run("ppo", tmp_path).settings(),
                                                                    sort_keys=True)
    with pytest.warns(DeprecationWarning, match=r"dtype -> Config.layout.dtype.*prompt_column -> "
                                                r"Config.data.prompt_column"):
        moved = jaxppo.Trainer(_same_run("ppo", tmp_path).config, policy=demo.demo_policy(tok, width=32, layers=1,
                                                                                           max_len=40),
                               tokenizer=tok, prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward,
                               dtype="float32", prompt_column="prompt")
    assert moved.config == old.config
    with pytest.warns(DeprecationWarning, match=r"jaxppo.PPOTrainer is deprecated .*use jaxppo.Trainer"):
        assert isinstance(jaxppo.PPOTrainer(moved.config, policy=demo.demo_policy(tok, width=32, layers=1, max_len=40),
                                            tokenizer=tok, prompts=demo.DEMO_PROMPTS,
                                            reward_fns=demo.lowercase_reward), jaxppo.Trainer)


def test_moved_names_warn_with_their_new_path_and_the_namespace_holds_entry_points():
    """The top of `jaxppo` holds the user's entry points; the names that lived there in 0.4
    and 0.5-dev still resolve, each with a `DeprecationWarning` naming its new path."""
    import jaxppo
    from jaxppo.deprecations import MOVED

    for old, target in MOVED["jaxppo"].items():
        module, name = target.split(":")
        with pytest.warns(DeprecationWarning, match=rf"jaxppo.{old} is deprecated since jaxppo 0.5 .* use "
                                                    rf"{re.escape(module)}.{name}"):
            got = getattr(jaxppo, old)
        assert got is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        jaxppo.nothing_here
    entry = {"Trainer", "Config", "train_step", "TrainState", "RolloutBatch", "algorithms", "Callback", "Control",
             "StepResult", "RunError"}
    assert entry <= set(jaxppo.__all__) and len(jaxppo.__all__) <= 30
    assert not set(jaxppo.__all__) & set(MOVED["jaxppo"])



@pytest.mark.parametrize("old, names, new", [
    ("jaxppo.update.engine", {"BatchConfig": "BatchConfig", "update_epochs": "update_epochs"}, "jaxppo.update.minibatches"),
    ("jaxppo.run.stages", {"select_prompts": "select_prompts", "score": "reward", "build_rollout": "build",
                           "update": "update"}, "jaxppo.run.iteration"),
    ("jaxppo.rollout.sampling", {"RolloutSpec": "RolloutSpec"}, "jaxppo.rollout.spec"),
    ("jaxppo.rollout.scoring", {"finish_rollout": "finish_rollout"}, "jaxppo.rollout.forward"),
])
def test_renamed_modules_still_import_with_a_warning_naming_the_new_one(old, names, new):
    """The modules 0.5 renamed (`engine`, `stages`, `sampling`, `scoring` each meant two
    things) import for one more release, warning with the new module's name, and give the
    new module's objects under their old names."""
    import sys

    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated since 0.5 .*{re.escape(new)}"):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    for name, new_name in names.items():
        assert getattr(module, name) is getattr(target, new_name)

def test_importing_jaxppo_starts_no_optional_backend():
    """In a fresh interpreter, `import jaxppo` loads neither vLLM's engine module nor any
    tracker's or PyTorch's package."""
    import subprocess
    import sys

    code = ("import sys, jaxppo; print(sorted(m for m in ('jaxppo.rollout.engines.vllm.inprocess', 'vllm', 'torch', 'wandb', 'mlflow', "
            "'trackio') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
