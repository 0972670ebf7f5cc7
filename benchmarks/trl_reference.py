"""Reference: TRL's `PPOTrainer` (PyTorch) at the shapes of `ppo_iteration.py`, on the same
random GPT-2 weights, tokenizer and prompts, split the same way.

    pip install "trl==1.12.0" accelerate datasets   # 1.12 is the last TRL with PPOTrainer
    python benchmarks/trl_reference.py              # small and medium shapes
    python benchmarks/trl_reference.py --quick      # small shape only

Not a project dependency: this script exists so that the speed comparison in the README is
measured side by side on the same machine instead of quoted.

TRL's loop runs one optimizer step per mini-batch when `per_device_train_batch_size` equals
the rollout batch and `gradient_accumulation_steps` is 1 (`num_mini_batches` = 4 gives
mini-batches of 16): 4 epochs x 4 mini-batches = 16 steps per iteration, as in jaxppo.
No stop token, so every response has its full length in both libraries.

Split, by timestamps inside TRL's iteration: generation = TRL's `batch_generation`;
scoring = from its end to the first optimizer micro-batch (log-probs of the sampled tokens,
reference log-probs, values, reward model, KL-shaped rewards, GAE); update = from there to
the end of the iteration (the PPO epochs, plus metrics and logging). Total also counts the
data loading before generation.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402


def marking_generation(fn, marks: dict):
    """`fn` (TRL's `batch_generation`) that writes its start and end times into `marks`."""
    def wrapper(*args, **kwargs):
        marks["generation_start"] = time.perf_counter()
        out = fn(*args, **kwargs)
        marks["generation_end"] = time.perf_counter()
        return out
    return wrapper


def bench(name, layers, width, response_length, vocab, iterations, jax_temperature):
    import datasets
    import torch
    import transformers
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    from jaxppo import demo
    from jaxppo.models import encode_prompts
    from ppo_iteration import build

    tokenizer = demo.demo_tokenizer()
    marks = {}
    ppo_trainer.batch_generation = marking_generation(ppo_trainer.batch_generation, marks)
    rows = []

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.clear()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            end = time.perf_counter()
            rows.append(dict(total=end - marks["begin"],
                             generation=marks["generation_end"] - marks["generation_start"],
                             scoring=marks["update_start"] - marks["generation_end"],
                             update=end - marks["update_start"]))
            marks.clear()
            marks["begin"] = end

    with tempfile.TemporaryDirectory() as d:
        build(d, layers, width, vocab, 16 + response_length, tokenizer)
        ids, _ = encode_prompts(tokenizer, list(demo.DEMO_PROMPTS) * 8, 16, truncate=True)
        dataset = datasets.Dataset.from_dict({"input_ids": np.asarray(ids).tolist()})
        policy = transformers.GPT2LMHeadModel.from_pretrained(f"{d}/policy")
        ref = transformers.GPT2LMHeadModel.from_pretrained(f"{d}/policy")
        reward = transformers.GPT2ForSequenceClassification.from_pretrained(f"{d}/rm")
        value = transformers.GPT2ForSequenceClassification.from_pretrained(f"{d}/rm")
        args = PPOConfig(output_dir=f"{d}/trl", per_device_train_batch_size=64, gradient_accumulation_steps=1,
                         num_mini_batches=4, num_ppo_epochs=4, total_episodes=64 * iterations,
                         response_length=response_length, temperature=jax_temperature, stop_token=None,
                         local_rollout_forward_batch_size=64, num_sample_generations=0, report_to=[],
                         save_strategy="no", disable_tqdm=True, logging_steps=10**9, learning_rate=1e-5,
                         use_cpu=True, seed=0,
                         # float32 against jaxppo's float32, no activation recomputation on either side
                         bf16=False, fp16=False, gradient_checkpointing=False)
        trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                             value_model=value, train_dataset=dataset, eval_dataset=dataset, callbacks=[Clock()])
        accumulate = trainer.accelerator.accumulate

        def first_accumulate_marks_update(*a, **k):  # the first micro-batch of an iteration starts the update
            marks.setdefault("update_start", time.perf_counter())
            return accumulate(*a, **k)

        trainer.accelerator.accumulate = first_accumulate_marks_update
        trainer.train()
    later = rows[2:] if len(rows) > 3 else rows[1:]
    med = {k: float(np.median([r[k] for r in later])) for k in ("generation", "scoring", "update", "total")}
    return dict(name=name, layers=layers, width=width, response=response_length, first=rows[0]["total"], **med)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocab", type=int, default=384, help="vocabulary size (384: the byte tokenizer's)")
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    import torch
    import trl

    import jaxppo
    from ppo_iteration import print_table, shapes

    temperature = jaxppo.Config().sampling.temperature
    rows = [bench(n, l, w, r, args.vocab, args.iterations, temperature) for n, l, w, r in shapes(args.quick)]
    print_table(f"TRL {trl.__version__} PPOTrainer, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                f"GPT-2 layout, vocab {args.vocab}, batch 64, mini-batch 16, 4 epochs (16 steps), 16-token prompts",
                rows, "first iteration")


if __name__ == "__main__":
    main()
