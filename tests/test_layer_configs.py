"""`PPOConfig` composes the configs of the layers that read its fields: `engine`
(`EngineConfig`), `loss` (`LossConfig`), `update` (`UpdateConfig`, what `train_step` reads)
and `rollout` (`RolloutConfig`). Each layer's config validates its own fields; the
composition passes every field through unchanged, and a setting one layer reads changes no
other layer's config."""

import dataclasses
import re

import pytest

from jaxppo import LossConfig, PPOConfig, UpdateConfig
from jaxppo.algorithms import ESTIMATORS
from jaxppo.rollout.sampling import RolloutConfig
from jaxppo.update.engine import EngineConfig
from jaxppo.update.objective import loss_for

CONFIG = PPOConfig.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4)
ENGINE_FIELDS = ("batch_size", "mini_batch_size", "ppo_epochs", "gradient_accumulation_steps", "target_kl")
# Read by the estimators and by the run (the adaptive entropy coefficient), not by a layer's config.
ESTIMATOR_FIELDS = {f for e in ESTIMATORS.values() for f in e.config_fields} | {"advantage_estimator"}
RUN_FIELDS = {"entropy_target", "entropy_coef_step"}


def _fields(cls):
    return {f.name for f in dataclasses.fields(cls)} - {"owner", "uses_critic", "skip_nonfinite"}


def test_every_field_reaches_the_layer_that_reads_it_unchanged():
    layers = {"engine": CONFIG.engine, "loss": CONFIG.loss, "rollout": CONFIG.rollout}
    for name, layer in layers.items():
        for field in _fields(type(layer)):
            assert getattr(layer, field) == getattr(CONFIG, field), (name, field)
    assert CONFIG.loss.uses_critic is False and PPOConfig().loss.uses_critic is True  # the estimator's
    update = CONFIG.update
    assert isinstance(update, UpdateConfig) and update.engine == CONFIG.engine and update.loss == CONFIG.loss
    # Every PPOConfig field is read somewhere: by a layer's config, an estimator or the run.
    covered = set().union(*(_fields(type(v)) for v in layers.values())) | ESTIMATOR_FIELDS | RUN_FIELDS
    assert {f.name for f in dataclasses.fields(PPOConfig)} <= covered


@pytest.mark.parametrize("change,changed", [
    (dict(kl_coef=0.3), {"rollout"}),
    (dict(overlong_penalty_factor=1.0, overlong_buffer=2), {"rollout"}),
    (dict(cliprange_high=0.28), {"loss"}),
    (dict(ppo_epochs=2), {"engine"}),
    (dict(temperature=0.7), {"loss", "rollout"}),
    (dict(grpo_scale="none"), set()),  # the estimator's own
])
def test_a_setting_changes_only_the_layers_that_read_it(change, changed):
    other = CONFIG.replace(**change)
    differ = {name for name in ("engine", "loss", "rollout") if getattr(other, name) != getattr(CONFIG, name)}
    assert differ == changed
    if "loss" not in changed:  # the loss bound for the engine is the same object: nothing retraces for it
        assert loss_for(print, other) is loss_for(print, CONFIG)


@pytest.mark.parametrize("cls,field,value,fragment", [
    (LossConfig, "cliprange", -1.0, "a finite real number >= 0"),
    (LossConfig, "loss_aggregation", "sum", "one of 'token_mean'"),
    (LossConfig, "pack_streams", 2, "None unless pack_sequences=True"),
    (RolloutConfig, "overlong_buffer", 3, "None while overlong_penalty_factor is 0"),
    (RolloutConfig, "kl_coef", float("nan"), "a finite real number >= 0"),
    (EngineConfig, "target_kl", 0.0, "None (no early stopping)"),
])
def test_each_layers_config_checks_its_fields_and_ppo_config_names_itself(cls, field, value, fragment):
    extra = dict(batch_size=8, mini_batch_size=4) if cls is EngineConfig else {}
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{field}=.* is invalid: .*{re.escape(fragment)}"):
        cls(**extra, **{field: value})
    with pytest.raises(ValueError, match=rf"^PPOConfig\.{field}=.* is invalid"):
        CONFIG.replace(**{field: value})
