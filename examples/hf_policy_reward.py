"""Fine-tune a local Hugging Face policy against a local Hugging Face reward model.

Both are directories on disk (config.json + safetensors, plus the tokenizer files for the
policy); nothing is downloaded. The critic starts as a copy of the reward model (TRL's
default); the reference is a frozen copy of the initial policy.

On a GPU or TPU, install JAX for it first (`pip install 'jaxppo[cuda12]'` or
`pip install 'jaxppo[tpu]'`); the same script then runs there. Settings that suit a
~1B-parameter policy on one 80 GB GPU:

    python examples/hf_policy_reward.py --model /ckpt/policy --reward-model /ckpt/rm \\
        --prompts prompts.jsonl --dtype bfloat16 --scan-layers --remat full --logits-chunk-size 128 \\
        --batch-size 256 --mini-batch-size 32 --gradient-accumulation-steps 4 --ppo-epochs 4 --query-length 128 --response-length 128 \\
        --learning-rate 1e-6 --critic-learning-rate 1e-5 --kl-coef 0.05 --missing-eos-penalty 1.0 \\
        --iterations 500 --checkpoint-every 25 --output-dir runs/rlhf

`--gradient-accumulation-steps` splits each mini-batch (still one optimizer update per
mini-batch) when activations do not fit; `--dtype bfloat16` computes in bf16 (trained
parameters and Adam states stay float32; the frozen reference and reward model are held in
bf16); `--scan-layers` runs the blocks as one scan (compile time independent of depth, and
what makes `--remat full` effective); `--logits-chunk-size` applies the LM head a chunk of
response positions at a time (README: "Real model sizes").
"""

import sys

import jaxppo
import jaxppo.models as jm
from jaxppo.cli import resolve


def main(argv=None):
    config, extras = resolve(argv)  # every setting (dtypes, layers, remat, ...) is in `config`, as the flags set it
    if extras["model"] is None or extras["reward_model"] is None or extras["prompts"] is None:
        raise SystemExit("give --model DIR, --reward-model DIR and --prompts FILE (all local)")
    tokenizer = jm.load_tokenizer(extras["model"])
    trainer = jaxppo.Trainer(config, policy=extras["model"], reward_model=extras["reward_model"], tokenizer=tokenizer,
                             prompts=extras["prompts"])
    return trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
