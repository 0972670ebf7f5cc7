"""Check, end to end from the command line on a real model: GRPO on SmolLM2-135M-Instruct (the
sums demo) with `--eval-prompts` (the 64 held-out sums, as a JSONL file), `--report-to
mlflow,wandb` (wandb offline), completion tables and Hugging Face checkpoints every 2
iterations. One run uninterrupted; one killed with SIGKILL after iteration 2's line, then the
same command again. Prints whether the resumed run's metrics (evaluations included) equal
the uninterrupted run's, whether MLflow's and wandb's stores hold each iteration once with
its values, and whether transformers loads the checkpoints.

    jaxppo-fixture                                  # once: the model, from PyPI
    pip install -e '.[test]'                        # wandb, mlflow, transformers with PyTorch
    python benchmarks/watching_kill_resume.py [--iterations 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import print_markdown  # noqa: E402


def command(out, eval_file, iterations):
    return [sys.executable, "-m", "jaxppo", "--demo", "sums", "--iterations", str(iterations), "--output-dir", out,
            "--eval-prompts", eval_file, "--eval-every", "2", "--report-to", "mlflow,wandb", "--sample-every", "2",
            "--save-hf-every", "2", "--best-metric", "eval/reward_mean", "--checkpoint-every", "2", "--no-progress",
            "--scan-layers", "--no-export-final"]


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("eps", "eval/time")} for r in rows]


def stores(out):
    """{backend: [(step, metrics)]} read back from MLflow's client and wandb's files."""
    from jaxppo.tracking.backends import mlflow_history, wandb_files, wandb_history

    uid = json.load(open(os.path.join(out, "trackers.json")))["run_id"]
    _, _, by_step = mlflow_history(out)
    found = {"mlflow": [(s, dict(items), len(items) == len(dict(items))) for s, items in sorted(by_step.items())]}
    rows = [r for path in wandb_files(out, uid) for r in wandb_history(path) if "iteration" in r]
    found["wandb"] = [(int(r["_step"]), r, True) for r in rows]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=4)
    args = parser.parse_args()
    from jaxppo import demo
    from jaxppo.tracking import read_metrics

    root = tempfile.mkdtemp(prefix="jaxppo-watching-")
    eval_file = os.path.join(root, "held_out.jsonl")
    with open(eval_file, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in demo.sums_rows(demo.sum_pairs(0)[1]))
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", HF_HUB_OFFLINE="1")
    whole, killed = os.path.join(root, "whole"), os.path.join(root, "killed")
    t = time.perf_counter()
    subprocess.run(command(whole, eval_file, args.iterations), env=env, check=True, capture_output=True)
    print(f"uninterrupted run: {time.perf_counter() - t:.0f} s")
    proc = subprocess.Popen(command(killed, eval_file, args.iterations), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if re.match(r"^iter\s+2 ", line):
            break
    proc.kill()
    proc.wait()
    print(f"killed after iteration 2's line; logged: {len(read_metrics(os.path.join(killed, 'metrics.jsonl')))} "
          f"lines; checkpoints: {sorted(os.listdir(os.path.join(killed, 'checkpoints')))}")
    subprocess.run(command(killed, eval_file, args.iterations), env=env, check=True, capture_output=True)
    a, b = read_metrics(os.path.join(whole, "metrics.jsonl")), read_metrics(os.path.join(killed, "metrics.jsonl"))
    rows = [["metrics.jsonl equal to the uninterrupted run's (timings aside)", str(comparable(a) == comparable(b))],
            ["evaluations (iteration: eval/reward_mean)",
             ", ".join(f"{r['iteration']}: {r['eval/reward_mean']:.3f}" for r in b if "eval/reward_mean" in r)]]
    for backend, held in stores(killed).items():
        steps = [s for s, _, _ in held]
        same = all(abs(m[k] - r[k]) <= 1e-9 * max(1.0, abs(r[k])) for (s, m, _), r in zip(held, b)
                   for k in r if k in m and isinstance(r[k], float) and not k.startswith("time/")
                   and k not in ("eps", "eval/time"))
        rows.append([f"{backend}: steps held", f"{steps} (each once: {steps == list(range(args.iterations))}, "
                     f"values equal: {same}, no metric twice at a step: {all(ok for _, _, ok in held)})"])
    import transformers

    for name in sorted(os.listdir(os.path.join(killed, "hf"))):
        if name.startswith("iteration_") or name == "best":
            model = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(killed, "hf", name))
            rows.append([f"hf/{name} loads in transformers", f"{type(model).__name__}"])
    rows.append(["hf/best.json", open(os.path.join(killed, "hf", "best.json")).read().strip()])
    print_markdown(["check", "result"], rows)


if __name__ == "__main__":
    main()
