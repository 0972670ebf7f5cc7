"""A small PPOTrainer run shared by the mesh and multi-host tests."""

import jaxppo
from jaxppo import demo


def run_small(output_dir, iterations=2, mesh=None):
    tokenizer = demo.demo_tokenizer()
    ppo = jaxppo.PPOConfig(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1)
    tc = jaxppo.TrainerConfig(iterations=iterations, query_length=32, response_length=6, learning_rate=1e-3,
                              output_dir=str(output_dir), progress=False, sample_every=0, checkpoint_every=1,
                              export_final=True, plot=False, tensorboard=False)
    trainer = jaxppo.PPOTrainer(ppo, tc, policy=demo.demo_policy(tokenizer, width=32, layers=1, max_len=40),
                                tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS, reward_fn=demo.lowercase_reward,
                                mesh=mesh)
    return trainer.train(), trainer
