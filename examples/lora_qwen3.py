"""GRPO with LoRA on a local Qwen3 checkpoint and a reward function.

Only the low-rank adapters are trained: the base weights stay frozen (held in --dtype, no
gradient, no optimizer state), the reference policy is the same weights with the adapters
switched off (no second copy of the model), checkpoints hold the adapters and their
optimizer state, and the run ends by writing `final_policy/` (adapters merged: a plain
Hugging Face checkpoint) and `final_adapter/` (PEFT's format, for `PeftModel.from_pretrained`
on the base checkpoint).

    python examples/lora_qwen3.py --model /ckpt/Qwen3-1.7B --prompts prompts.jsonl

The prompts may be plain strings or chat messages (rendered with the checkpoint's chat
template). The reward here is a stand-in, `concise_answer` (readable text, not too many
words); replace it with your verifier (it is called as `f(prompts, completions,
**columns)` with the dataset's other columns).

Settings for a Qwen3 1.7B-8B checkpoint on one 80 GB GPU (or `--mesh-fsdp N` over N
devices, TPUs alike):

    python examples/lora_qwen3.py --model /ckpt/Qwen3-8B --prompts prompts.jsonl \\
        --lora-rank 16 --lora-alpha 32 --lora-targets all-linear \\
        --dtype bfloat16 --scan-layers --remat full --logits-chunk-size 256 \\
        --batch-size 64 --num-generations 8 --mini-batch-size 16 --gradient-accumulation-steps 4 \\
        --query-length 256 --response-length 512 --learning-rate 1e-5 --iterations 300 \\
        --checkpoint-every 20 --output-dir runs/lora_qwen3

LoRA wants a larger learning rate than full fine-tuning (1e-5 to 1e-4 rather than 1e-6).
`--lora-init DIR` starts from an existing PEFT adapter instead of fresh ones.
"""

import sys

import jaxppo
import jaxppo.models as jm
from jaxppo.cli import resolve

DEFAULTS = ["--algorithm", "grpo", "--learning-rate", "1e-5", "--batch-size", "16", "--num-generations", "4",
            "--mini-batch-size", "8"]


def concise_answer(prompts, completions):
    """A stand-in reward: the share of the completion's characters that are letters or
    spaces (readable text), less 0.1 per word beyond 8."""
    def score(text):
        readable = sum(ch.isalpha() or ch == " " for ch in text) / max(1, len(text))
        return readable - 0.1 * max(0, len(text.split()) - 8)

    return [score(c) for c in completions]


def main(argv=None):
    argv = list(argv or [])
    lora_given = any(a.startswith(("--lora-rank", "--lora-init")) for a in argv)
    config, extras = resolve(DEFAULTS + ([] if lora_given else ["--lora-rank", "8"]) + argv)
    if extras["model"] is None or extras["prompts"] is None:
        raise SystemExit("give --model DIR (a local Qwen3 checkpoint with its tokenizer) and --prompts FILE")
    tokenizer = jm.load_tokenizer(extras["model"])
    # --lora-rank, --lora-init, ... are settings: `config.lora` holds them
    trainer = jaxppo.Trainer(config, policy=extras["model"], tokenizer=tokenizer, prompts=extras["prompts"],
                             reward_fns=[concise_answer])
    return trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
