"""Peak memory follows `mini_batch_size`, shown on the trainer's whole update program (PPO:
the policy and the critic, the loss, GAE and whitening over the rollout, the optimizer), not
only on the engine's: its compiled temporaries (`memory_analysis`, nothing runs) stay flat
as the rollout grows at a fixed mini-batch, and grow with the mini-batch."""

import jax

import jaxppo
from jaxppo import demo
from jaxppo.run import compiled
from trainer_setup import small_trainer


def _update_temp_bytes(tmp_path, batch_size, mini_batch_size, accumulation=1, common_prefix=False):
    """The compiled temporaries of the update program a small trainer runs (a GPT-2 policy
    with a value head, 40-token prompts, 6-token responses), lowered with the abstract
    rollout its forward pass will produce."""
    config = jaxppo.Config.from_settings(batch_size=batch_size, mini_batch_size=mini_batch_size, ppo_epochs=2,
                              gradient_accumulation_steps=accumulation, common_prefix=common_prefix)
    prompts = ["Answer: " + p for p in demo.DEMO_PROMPTS] if common_prefix else None
    trainer = small_trainer(tmp_path / f"{batch_size}-{mini_batch_size}-{accumulation}-{common_prefix}", ppo=config,
                            iterations=1, prompts=prompts, max_len=48, query_length=40)
    rollout = compiled.abstract_rollout(trainer.parts.spec, trainer.run, trainer.parts.ref_params,
                                        trainer.parts.reward_params, batch_size, trainer.parts.table.ids.shape[1],
                                        host_scores=True)
    program = trainer.train_step.lower(trainer.run.train, rollout, jax.random.key(0)).compile()
    trainer.close()
    return program.memory_analysis().temp_size_in_bytes


def test_the_trainers_update_memory_follows_the_mini_batch_not_the_batch(tmp_path):
    small = _update_temp_bytes(tmp_path, 16, 4)
    large = _update_temp_bytes(tmp_path, 256, 4)
    # 16x the rollout at the same mini-batch: only per-rollout vectors grow (advantages,
    # returns, whitening, the permutation: a few (B, R) float arrays, about 100 bytes a row).
    assert large <= small * 1.05 + 256 * 6 * 4 * 16, (small, large)
    bigger = _update_temp_bytes(tmp_path, 256, 64)
    assert bigger > 4 * small, (small, bigger)
    # Gradient accumulation: the micro-batch sets the activation memory.
    accumulated = _update_temp_bytes(tmp_path, 256, 64, accumulation=16)
    assert accumulated < bigger / 4, (accumulated, bigger)


def test_the_common_prefix_layout_keeps_memory_following_the_mini_batch(tmp_path):
    small = _update_temp_bytes(tmp_path, 16, 4, common_prefix=True)
    large = _update_temp_bytes(tmp_path, 256, 4, common_prefix=True)
    assert large <= small * 1.05 + 256 * 40 * 4 * 16, (small, large)
    assert _update_temp_bytes(tmp_path, 256, 64, common_prefix=True) > 4 * small
