"""Benchmark: what watching a run costs. (1) Evaluation during training on a real model:
GRPO on SmolLM2-135M-Instruct (`jaxppo-fixture`), the sums demo's settings (4 prompts x 8
completions of up to 16 tokens, 2 updates per iteration), 64 held-out sums as eval prompts,
evaluated at every iteration; seconds per evaluation beside seconds per iteration. (2) The
trackers: a metrics line of a real run (about 60 numbers) and a completions table of 2 rows
logged per iteration to each tracker alone, and to all of them; seconds per iteration and
to start.

    jaxppo-fixture                                  # once: the model, from PyPI
    pip install -e '.[wandb,mlflow,trackio]'
    python benchmarks/watching.py [--iterations 5] [--eval-generations 1] [--part eval|trackers|both]

wandb runs offline (`WANDB_MODE=offline`), MLflow on its SQLite store in the run directory,
trackio on a temporary local database: nothing leaves the machine. Printed as tables.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tables import print_markdown  # noqa: E402


def eval_cost(iterations: int, generations: int):
    import jaxppo
    from jaxppo import demo
    from jaxppo.models import fixtures
    from jaxppo.models.tokenizer import load_tokenizer

    directory = fixtures.fixture_dir()
    if not fixtures.is_prepared(directory):
        raise SystemExit(f"run `jaxppo-fixture` first ({directory} is not prepared)")
    train, held_out = demo.sum_pairs(0)
    ppo = jaxppo.Config.for_algorithm("grpo", **demo.DEMO_SUMS_PPO)
    out = tempfile.mkdtemp(prefix="jaxppo-watching-")
    tc = dict(iterations=iterations, query_length=64, response_length=16, learning_rate=1e-5,
              output_dir=out, progress=False, sample_every=0, plot=False, export_final=False,
              report_to="jsonl", eval_every=1, eval_generations=generations,
              eval_temperature=0.0 if generations == 1 else 1.0)
    trainer = jaxppo.Trainer(ppo.replace(**tc, scan_layers=True), policy=directory, tokenizer=load_tokenizer(directory),
                             prompts=demo.sums_rows(train), reward_fns=[demo.sums_reward],
                             eval_prompts=demo.sums_rows(held_out))
    times, last = [], time.perf_counter()

    def clock(iteration, metrics):
        nonlocal last
        now = time.perf_counter()
        times.append(now - last)
        last = now

    trainer.add_callback(clock)
    history = trainer.train()
    rows = []
    for m, whole in zip(history, times):
        iteration = whole - m["eval/time"]
        rows.append([m["iteration"], f"{m['eval/time']:.2f}", f"{iteration:.2f}", f"{m['eval/time'] / iteration:.2f}",
                     f"{m['eval/reward_mean']:.3f}"])
    print(f"\nEvaluation of {len(held_out)} prompts x {generations} ({'greedy' if generations == 1 else 'T=1'}), "
          f"{ppo.prompts_per_batch} prompts x {ppo.batch.num_generations} per iteration, SmolLM2-135M-Instruct:\n")
    print_markdown(["iteration", "eval s", "iteration s (without eval)", "eval / iteration", "eval reward"], rows)
    steady = rows[1:]
    if steady:
        e, i = statistics.median(float(r[1]) for r in steady), statistics.median(float(r[2]) for r in steady)
        print(f"\nmedian over iterations 1-{len(rows) - 1}: eval {e:.2f} s, iteration {i:.2f} s ({e / i:.2f}x)")


def tracker_cost(iterations: int):
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="jaxppo-trackio-"))
    from jaxppo.run.logger import Logger

    metrics = {"iteration": 0, "episode": 32, **{f"group{g}/metric{i}": 0.123 * i + g for g in range(6)
                                                   for i in range(10)}}
    columns = ["prompt", "completion", "reward", "sums_reward", "length", "stopped"]
    table = [["What is 13 + 29?", "13 + 29 = 42", 1.0, 1.0, 9, True]] * 2
    rows = []
    for backends in (["jsonl"], ["jsonl", "tensorboard"], ["jsonl", "wandb"], ["jsonl", "mlflow"],
                     ["jsonl", "trackio"], ["jsonl", "tensorboard", "wandb", "mlflow", "trackio"]):
        out = tempfile.mkdtemp(prefix="jaxppo-trackers-")
        t0 = time.perf_counter()
        logger = Logger(out, report_to=backends, config={"batch_size": 32})
        started = time.perf_counter() - t0
        per = []
        for it in range(iterations):
            t = time.perf_counter()
            logger.log_table(it, "completions", columns, table)
            logger.log({**metrics, "iteration": it, "episode": 32 * (it + 1)}, echo=False)
            per.append(time.perf_counter() - t)
        t = time.perf_counter()
        logger.close()
        finished = time.perf_counter() - t
        rows.append([",".join(backends), f"{started:.2f}", f"{1000 * statistics.median(per):.1f}",
                     f"{finished:.2f}"])
    print(f"\nTrackers: a line of {len(metrics)} numbers and a 2-row table per iteration, {iterations} iterations:\n")
    print_markdown(["report_to", "start s", "per iteration ms (median)", "finish s"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--eval-generations", type=int, default=1)
    parser.add_argument("--part", choices=("eval", "trackers", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("trackers", "both"):
        tracker_cost(max(args.iterations, 20))
    if args.part in ("eval", "both"):
        eval_cost(args.iterations, args.eval_generations)


if __name__ == "__main__":
    main()
