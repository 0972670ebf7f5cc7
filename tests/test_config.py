import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxppo import PPOConfig


def test_derived_counts():
    cfg = PPOConfig(batch_size=96, mini_batch_size=24, ppo_epochs=3, gradient_accumulation_steps=4)
    assert cfg.num_minibatches == 4
    assert cfg.micro_batch_size == 6
    assert cfg.updates_per_step == 12


def test_frozen_and_hashable_as_static_jit_argument():
    cfg = PPOConfig(batch_size=8, mini_batch_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch_size = 16
    assert hash(cfg) == hash(PPOConfig(batch_size=8, mini_batch_size=4))

    f = jax.jit(lambda x, config: x * config.num_minibatches, static_argnums=1)
    assert int(f(jnp.int32(3), cfg)) == 6


def test_replace_revalidates():
    cfg = PPOConfig(batch_size=8, mini_batch_size=4)
    assert cfg.replace(mini_batch_size=2).num_minibatches == 4
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
        PPOConfig(**kwargs)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_valid_edge_values_accepted():
    with pytest.warns(UserWarning, match=r"PPOConfig.cliprange=0: the ratio is clipped to exactly 1"):
        cfg = PPOConfig(
            batch_size=1, mini_batch_size=1, cliprange=0, gamma=0, lam=1, ent_coef=0.0, target_kl=0.02, temperature=0.7
        )
    assert cfg.updates_per_step == cfg.ppo_epochs


def test_legal_settings_that_are_almost_surely_mistakes_warn_and_the_seed_fits_the_key():
    """A learning rate above 1 and a clip range of 0 are accepted with a warning; seeds
    span what jax.random.key keeps (32 bits): 2**32 - 1 is valid, 2**32 (which the key would
    cut to 0, repeating seed 0's run) is refused; so is an infinite learning rate."""
    import warnings

    import jax

    from jaxppo import TrainerConfig

    with pytest.warns(UserWarning, match=r"learning_rate=3.0 is above 1"):
        TrainerConfig(learning_rate=3.0)
    with pytest.warns(UserWarning, match=r"critic_learning_rate=2.0 is above 1"):
        TrainerConfig(critic_learning_rate=2.0)
    with pytest.warns(UserWarning, match=r"PPOConfig.cliprange=1.0: the ratio's lower clip 1 - 1.0 is <= 0.* the "
                                         r"lower clip is gone"):
        PPOConfig(cliprange=1.0)
    with pytest.warns(UserWarning, match=r"PPOConfig.cliprange_low=1.0: .*the lower clip is gone"):
        PPOConfig(cliprange_low=1.0, cliprange_high=0.28)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainerConfig(learning_rate=1e-5, seed=2**32 - 1)
        PPOConfig(cliprange=0.2)
        PPOConfig(cliprange=0.99)
        PPOConfig(cliprange=1.5, cliprange_low=0.2)  # the lower clip is cliprange_low's
    assert (jax.random.key_data(jax.random.key(2**32)) == jax.random.key_data(jax.random.key(0))).all()
    with pytest.raises(ValueError, match=r"seed=4294967296 \(--seed\) is invalid: .* repeat the run of seed 0"):
        TrainerConfig(seed=2**32)
    with pytest.raises(ValueError, match=r"learning_rate=inf is invalid: learning_rate must be a finite number > 0"):
        TrainerConfig(learning_rate=float("inf"))
