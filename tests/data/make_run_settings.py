"""Record the run settings two small runs write, with an older jaxppo on PYTHONPATH (e.g. a
`git worktree` of it), for the resume tests of tests/test_config.py:

    jaxppo 0.4.0 (commit 589d3d4)          -> tests/data/run_settings_0_4/
    0.5-dev before issue 51 (commit 0e78b78) -> tests/data/run_settings_0_5_dev/

Each uses its version's spellings (truncate_prompts, stop_token_id(s), warmup_ratio,
tensorboard, total_episodes, a reward function alone) where it has them."""
import json
import os
import shutil
import sys

import dataclasses

import jaxppo
from jaxppo import demo

out = sys.argv[1]
tok = demo.demo_tokenizer()
V04 = "stop_token_ids" not in {f.name for f in dataclasses.fields(jaxppo.TrainerConfig)}  # 0.4.0 (its version says 0.4.0 in 0.5-dev too)


def trainer(name, ppo, **tc):
    base = dict(iterations=2, query_length=32, response_length=6, learning_rate=1e-3, output_dir=os.path.join(out, name),
                progress=False, sample_every=0, checkpoint_every=1, export_final=False, plot=False)
    base.update(tc)
    return jaxppo.PPOTrainer(ppo, jaxppo.TrainerConfig(**base), policy=demo.demo_policy(tok, width=32, layers=1, max_len=40),
                             tokenizer=tok, prompts=demo.DEMO_PROMPTS, **REWARDS[name])


REWARDS = {"ppo": dict(reward_fn=demo.lowercase_reward),
           "grpo": dict(reward_fns=[demo.lowercase_reward, demo.lowercase_reward], reward_weights=[1.0, 0.5])}
PPO = dict(truncate_prompts=True, lr_schedule="cosine", tensorboard=False, total_episodes=32)
PPO.update(dict(stop_token_id=5, warmup_updates=1) if V04 else dict(stop_token_ids=(5,), warmup_ratio=0.25))
GRPO = dict(stop_token_id=2, kl_estimator="k3", max_grad_norm=0.5)
if not V04:
    GRPO.update(overlong_prompts="filter", top_p=0.9)
runs = {
    "ppo": trainer("ppo", jaxppo.PPOConfig(batch_size=16, mini_batch_size=8, ppo_epochs=2, kl_coef=0.1), **PPO),
    "grpo": trainer("grpo", jaxppo.PPOConfig.for_algorithm("grpo", batch_size=8, mini_batch_size=4, num_generations=4,
                                                           top_entropy_quantile=0.5), **GRPO),
}
for name, t in runs.items():
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(t.settings(), f, indent=1, sort_keys=True)
    shutil.rmtree(os.path.join(out, name), ignore_errors=True)
print(sorted(os.listdir(out)))
