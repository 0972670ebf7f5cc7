"""Benchmark: PPO with a critic and a reward model on a real pretrained model, jaxppo against
TRL 1.12's `PPOTrainer` (the last TRL that ships it), side by side on one machine.

    jaxppo-fixture --score-head                                       # once: the model and its score head
    python benchmarks/real_model_ppo_vs_trl.py --side jaxppo          # jaxppo's trainer (its CLI)
    python benchmarks/real_model_ppo_vs_trl.py --side trl             # TRL 1.12's PPOTrainer (trl==1.12.0)
    python benchmarks/real_model_ppo_vs_trl.py --side jaxppo --mini-batch-size 4 -- --scan-layers

Models (both sides): SmolLM2-135M-Instruct (`jaxppo-fixture`) as the policy and the reference;
the same checkpoint with a fixed-seed sequence-classification head
(`jaxppo-fixture --score-head`) as the reward model and as the critic's initialisation.

Settings (both): float32, no activation recomputation; 32 chat-template prompts per
iteration ("What is a + b?" from the sums demo, 38 to 40 tokens with SmolLM2's default
system prompt; jaxppo pads them to 40, TRL to the longest of each batch), one completion
each of at most 24 tokens, ending at `<|im_end|>`; temperature 1; `mini_batch_size` 8 (4
optimizer updates per iteration, one epoch); KL coefficient 0.05 (k1, in the rewards);
clip 0.2, value clip 0.2, value coefficient 0.1, gamma 1, lambda 0.95, advantages whitened,
rewards not; Adam (eps 1e-8), learning rate 3e-6 constant, gradients clipped at norm 1.
TRL: per_device_train_batch_size=32, num_mini_batches=4, gradient_accumulation_steps=1,
num_ppo_epochs=1, local_rollout_forward_batch_size=32, stop_token="eos". TRL pads with
`<|endoftext|>`: its PPOTrainer finds padding by comparing tokens with the pad token, and
SmolLM2's pad token is its EOS `<|im_end|>`, which every chat prompt contains.
Arguments after `--` go to the `jaxppo` command. jaxppo compiles into an empty cache of its
own unless `-- --compilation-cache DIR` is given: its first iteration is a cold start.

Each side prints one row per iteration: generation, scoring (old log-probs, reference,
values, the reward model, KL-shaped rewards, GAE), update, the whole iteration, the
optimizer updates applied, the reward model's mean score of the iteration's samples (the
learning curve); then the first iteration, medians over iterations 2 to N, and the peak
resident memory of the process that trained. `--json FILE` also writes the rows.
Splits: jaxppo's own `time/...` metrics; TRL's `batch_generation` (generation), from its
end to the first optimizer micro-batch (scoring), from there to the iteration's end (update).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from tables import print_markdown, side_by_side_args  # noqa: E402

BATCH, RESPONSE, QUERY, LR, KL, EPS = 32, 24, 40, 3e-6, 0.05, 1e-8


POOL = 10  # iterations' worth of prompts written whatever --iterations is


def prompt_rows(iterations):
    """`BATCH * max(iterations, POOL)` prompts: a run of 2 iterations and one of 5 draw the
    same prompts in their first two (the order prompts are drawn in depends on the set's
    size, so a set sized by --iterations made runs of different lengths sample differently)."""
    from jaxppo import demo

    train, _ = demo.sum_pairs()
    order = np.random.default_rng(0).permutation(len(train))
    count = BATCH * max(iterations, POOL)
    return [{"messages": r["prompt"]} for r in demo.sums_rows([train[i] for i in order[:count]])]


def blocked_stages():
    """Time jaxppo's stages apart (`--split`): each waits for its device work before the next
    starts, so sampling, scoring and the update are each their own (jaxppo overlaps them
    otherwise: without text rewards the host does not wait for sampling, and its own
    `time/...` split counts sampling under scoring or the update)."""
    import jax

    from jaxppo.run import iteration

    marks, build, update = [], iteration.build, iteration.update

    def build_rollout(spec, params, ref_params, reward_params, batch, gen, *a, **k):
        jax.block_until_ready(gen)
        t = time.perf_counter()
        built = jax.block_until_ready(build(spec, params, ref_params, reward_params, batch, gen, *a, **k))
        marks.append({"sampled": t, "scored": time.perf_counter()})
        return built

    def blocked_update(*a, **k):
        out = jax.block_until_ready(update(*a, **k))
        marks[-1]["updated"] = time.perf_counter()
        return out

    iteration.build, iteration.update = build_rollout, blocked_update
    return marks


def jaxppo_rows(model, scorer, iterations, mini_batch_size, extra, split=False):
    with tempfile.TemporaryDirectory() as out:
        prompts = os.path.join(out, "prompts.jsonl")
        with open(prompts, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in prompt_rows(iterations))
        run = os.path.join(out, "run")
        command = [sys.executable, "-m", "jaxppo", "--algorithm", "ppo", "--model", model, "--reward-model", scorer,
                   "--critic", scorer, "--prompts", prompts, "--output-dir", run, "--iterations", str(iterations),
                   "--batch-size", str(BATCH), "--mini-batch-size", str(mini_batch_size), "--ppo-epochs", "1",
                   "--query-length", str(QUERY), "--response-length", str(RESPONSE), "--temperature", "1",
                   "--kl-coef", str(KL), "--kl-estimator", "k1", "--cliprange", "0.2", "--cliprange-value", "0.2",
                   "--vf-coef", "0.1", "--gamma", "1", "--lam", "0.95", "--whiten-advantages",
                   "--no-whiten-rewards", "--learning-rate", str(LR), "--adam-eps", str(EPS),
                   "--max-grad-norm", "1", "--lr-schedule", "constant", "--sample-every", "0", "--no-plot",
                   "--report-to", "jsonl", "--no-progress", "--no-export-final", "--seed", "0", *extra]
        if "--compilation-cache" not in extra:  # a cold start: an empty cache of its own
            command += ["--compilation-cache", os.path.join(out, "xla")]
        print("$", " ".join(command), flush=True)
        start = time.perf_counter()
        if split:
            from jaxppo import cli

            marks = blocked_stages()
            cli.main(command[3:])
        else:
            subprocess.run(command, check=True)
        print(f"whole command: {time.perf_counter() - start:.0f} s", flush=True)
        peak = resource.getrusage(resource.RUSAGE_SELF if split else resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        with open(os.path.join(run, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    rows = [dict(generation=m["time/generation"], scoring=m["time/scoring"], update=m["time/update"],
                 updates=int(m["ppo/updates_applied"]), score=m["objective/scores"]) for m in metrics]
    if split:  # each stage from the end of the one before (the iteration's start: the last one's end)
        ends = [start + 0.0] + [m["updated"] for m in marks]
        for row, m, begin in zip(rows, marks, ends):
            row.update(generation=m["sampled"] - begin, scoring=m["scored"] - m["sampled"],
                       update=m["updated"] - m["scored"])
        rows[0]["note"] = "first row from the command's start"
    return rows, peak


def trl_rows(model, scorer, iterations, mini_batch_size):
    import datasets
    import torch
    import transformers
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    torch.set_num_threads(os.cpu_count())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    tokenizer.pad_token = "<|endoftext|>"  # not the EOS (see the module's docstring)
    ids = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in prompt_rows(iterations)]
    ids = [i["input_ids"] if isinstance(i, dict) or hasattr(i, "keys") else i for i in ids]
    dataset = datasets.Dataset.from_dict({"input_ids": ids})
    marks, rows, steps = {}, [], [0]

    from trl_reference import marking_generation

    ppo_trainer.batch_generation = marking_generation(ppo_trainer.batch_generation, marks)

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.clear()
            marks["begin"] = time.perf_counter()

    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32)
    value = transformers.AutoModelForSequenceClassification.from_pretrained(scorer, dtype=torch.float32)
    # TRL 1.12: rollout batch = per_device_train_batch_size * gradient_accumulation_steps; each of
    # its num_mini_batches mini-batches is one optimizer step when gradient_accumulation_steps is 1.
    args = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=BATCH,
                     gradient_accumulation_steps=1, num_mini_batches=BATCH // mini_batch_size, num_ppo_epochs=1,
                     total_episodes=BATCH * iterations, response_length=RESPONSE, temperature=1.0,
                     stop_token="eos", kl_coef=KL, kl_estimator="k1", cliprange=0.2, cliprange_value=0.2,
                     vf_coef=0.1, gamma=1.0, lam=0.95, whiten_rewards=False, learning_rate=LR, adam_epsilon=EPS,
                     max_grad_norm=1.0, lr_scheduler_type="constant", local_rollout_forward_batch_size=BATCH,
                     num_sample_generations=0, report_to=[], save_strategy="no", disable_tqdm=True,
                     logging_steps=1, use_cpu=True, seed=0, bf16=False, fp16=False, gradient_checkpointing=False)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset, eval_dataset=dataset, callbacks=[Clock()])
    step = trainer.optimizer.step

    def counted_step(*a, **k):  # an optimizer step that changes the weights (accelerate's sync point)
        steps[0] += int(trainer.accelerator.sync_gradients)
        return step(*a, **k)

    trainer.optimizer.step = counted_step
    accumulate = trainer.accelerator.accumulate

    def first_accumulate_marks_update(*a, **k):  # the first micro-batch of an iteration starts the update
        marks.setdefault("update_start", time.perf_counter())
        return accumulate(*a, **k)

    trainer.accelerator.accumulate = first_accumulate_marks_update
    log = trainer.log

    def end_of_iteration(logs, *a, **k):  # TRL logs once per iteration, at its end
        out = log(logs, *a, **k)
        end = time.perf_counter()
        rows.append(dict(generation=marks["generation_end"] - marks["generation_start"],
                         scoring=marks["update_start"] - marks["generation_end"],
                         update=end - marks["update_start"], updates=steps[0], score=logs["objective/scores"],
                         whole=end - marks["begin"]))
        steps[0] = 0
        marks.clear()
        marks["begin"] = time.perf_counter()
        return out

    trainer.log = end_of_iteration
    trainer.train()
    return rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main():
    def add(parser):
        parser.add_argument("--score-model", default=None,
                            help="the reward model's and critic's directory (default: jaxppo-fixture --score-head's)")
        parser.add_argument("--mini-batch-size", type=int, default=8)
        parser.add_argument("--json", default=None, help="also write the rows to this file")
        parser.add_argument("--split", action="store_true",
                            help="jaxppo: train in this process and time each stage apart, waiting for its device "
                                 "work (sampling, scoring, the update no longer overlap)")

    args, extra = side_by_side_args(__doc__.splitlines()[0], add, "jaxppo-fixture --score-head")
    if args.score_model is None:
        from jaxppo.models.fixtures import score_head_dir

        args.score_model = score_head_dir(args.model)
    if not args.score_model or not os.path.isdir(args.score_model):
        raise SystemExit(f"no score-head checkpoint in {args.score_model}: run `jaxppo-fixture --score-head` first")
    if args.side == "jaxppo":
        rows, peak = jaxppo_rows(args.model, args.score_model, args.iterations, args.mini_batch_size, extra,
                                 args.split)
    else:
        rows, peak = trl_rows(args.model, args.score_model, args.iterations, args.mini_batch_size)
    table = []
    for i, r in enumerate(rows, 1):
        r.setdefault("whole", r["generation"] + r["scoring"] + r["update"])
        table.append([i, f"{r['generation']:.2f}", f"{r['scoring']:.2f}", f"{r['update']:.2f}", f"{r['whole']:.2f}",
                      r["updates"], f"{r['score']:.3f}"])
    later = rows[1:] or rows
    med = {k: float(np.median([r[k] for r in later])) for k in ("generation", "scoring", "update", "whole")}
    table.append([f"median 2-{len(rows)}" if len(rows) > 1 else "(one iteration)", f"{med['generation']:.2f}", f"{med['scoring']:.2f}",
                  f"{med['update']:.2f}", f"{med['whole']:.2f}", "", ""])
    label = f"{args.side}{' --split' if args.split else ''}{' ' + ' '.join(extra) if extra else ''}"
    print(f"\n## {label}: SmolLM2-135M-Instruct PPO (critic, reward model), float32, batch {BATCH}, "
          f"mini-batch {args.mini_batch_size}, {os.cpu_count()} CPU threads; peak resident memory {peak:.2f} GiB\n")
    print_markdown(["iteration", "generation s", "scoring s", "update s", "whole s", "updates applied",
                    "reward-model score"], table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(side=label, mini_batch_size=args.mini_batch_size, peak_rss_gib=peak, rows=rows,
                           median=med, first=rows[0]["whole"]), f, indent=1)


if __name__ == "__main__":
    main()
