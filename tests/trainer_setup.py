"""Small PPOTrainer runs shared by the mesh, multi-host and fault tests."""

import os

import pytest

import jaxppo
from jaxppo import demo


def small_trainer(output_dir, iterations=2, mesh=None, reward_fn=demo.lowercase_reward, callbacks=(), prompts=None,
                  ppo=None, lora=None, environment=None, max_len=40, tools=None, reward_fn_on="text", **trainer):
    tokenizer = demo.demo_tokenizer()
    ppo = ppo or jaxppo.PPOConfig(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1)
    settings = dict(iterations=iterations, query_length=32, response_length=6, learning_rate=1e-3,
                    output_dir=str(output_dir), progress=False, sample_every=0, checkpoint_every=1,
                    export_final=True, plot=False, tensorboard=False)
    settings.update(trainer)
    return jaxppo.PPOTrainer(ppo, jaxppo.TrainerConfig(**settings),
                             policy=demo.demo_policy(tokenizer, width=32, layers=1, max_len=max_len),
                             tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS if prompts is None else prompts,
                             reward_fn=reward_fn, reward_fn_on=reward_fn_on, callbacks=callbacks, mesh=mesh,
                             lora=lora, environment=environment,
                             tools=tools)


def run_small(output_dir, iterations=2, mesh=None, **trainer_settings):
    trainer = small_trainer(output_dir, iterations=iterations, mesh=mesh, **trainer_settings)
    return trainer.train(), trainer


def require_devices(n: int):
    """A pytest mark that skips a module needing `n` devices when fewer exist (an inherited
    XLA_FLAGS with a smaller --xla_force_host_platform_device_count), except in CI (the CI
    variable set), where running without them is an error: a mesh test CI never runs must
    not pass as a skip."""
    import jax

    if jax.device_count() >= n:
        return pytest.mark.skipif(False, reason="")
    message = (f"needs {n} devices, found {jax.device_count()}: XLA_FLAGS={os.environ.get('XLA_FLAGS')!r} sets fewer "
               f"(conftest adds --xla_force_host_platform_device_count={n} only when XLA_FLAGS sets no count)")
    if os.environ.get("CI"):
        raise RuntimeError(message)
    return pytest.mark.skip(reason=message)
