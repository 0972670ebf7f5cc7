"""Benchmark: pipelined iterations (`TrainerConfig.max_staleness`) against the synchronous
loop, with host work comparable to the device's, CPU, back to back in one run.

    python benchmarks/pipeline.py                        # GRPO, 0.3 s reward, k = 0, 1, 2
    python benchmarks/pipeline.py --seeds 3 --iterations 40   # learning curves too
    python benchmarks/pipeline.py --case multiturn --episodes 64 --response 36   # an environment with latency
    python benchmarks/pipeline.py --model ~/.cache/jaxppo/fixtures/smollm2-135m-instruct \
        --episodes 16 --iterations 5 --seeds 1           # a real model (`jaxppo-fixture`)
    python benchmarks/pipeline.py ... --stages           # and where each iteration's time goes

"grpo": GRPO on the demo's tiny GPT-2-layout policy (byte vocabulary), `--episodes` (128)
completions in groups of 4, 32 tokens each, 4 epochs of mini-batches of 16; the reward is
the demo's lowercase count computed after `--reward-seconds` (0.3) of host time per batch
(a stand-in for a sandbox or a judge; on this 2-core CPU about the device's time per
iteration at 128 completions). "multiturn": the same policy in episodes of 3 turns of
`--response / 3` tokens, each environment step taking `--step-seconds` (0.05) on the host
(the environments of a batch step in parallel threads).

Reported per staleness bound k: median seconds per iteration after the first two (which
compile), iterations per second relative to k = 0, the mean reward of the first and last
10 iterations (mean over seeds and the lowest seed's), and the staleness logged. With
`--stages`, each run's stages are timed too (the device's work waited for, so the timing
serialises nothing the lock does not already): per thread, the mean seconds per iteration
after the first two in sampling, host scoring (decoding, rewards), building the rollout
(the forward pass), the update, the parameter snapshot, and the trainer's wait for a batch.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import threading
import tempfile
import time

import jax
import numpy as np

import jaxppo
import jaxppo.run.pipeline as pipelining
import jaxppo.run.iteration as iteration
from jaxppo import demo
from jaxppo.rollout.environments import StepResult
from tables import print_markdown


def slow_lowercase(seconds: float):
    def reward(prompts, completions, **_):
        time.sleep(seconds)  # host work: a sandbox, a judge, a remote call
        return [float(sum(c.isascii() and c.islower() for c in text)) / 8 for text in completions]

    return reward


class Slow:
    """An environment whose every step takes `seconds` on the host; the turn's lowercase
    count is its reward; three turns."""

    seconds = 0.05

    def reset(self, prompt):
        self.turns = 0

    def step(self, completion):
        time.sleep(self.seconds)
        self.turns += 1
        return StepResult(" go on:", sum(c.isascii() and c.islower() for c in completion) / 8, self.turns >= 3)


STAGE_TIMES = []  # (thread, stage, seconds) of the run in progress, with --stages


def time_stages():
    """Wrap the loop's stages with timers (each waits for its device work)."""
    def timed(name, fn, wait=True):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if wait:
                jax.block_until_ready(out)
            STAGE_TIMES.append((threading.current_thread().name, name, time.perf_counter() - start))
            return out
        return wrapper

    iteration.sample = timed("sample", iteration.sample)
    iteration.reward = timed("score (host)", iteration.reward, wait=False)
    iteration.build = timed("build rollout", iteration.build)
    iteration.update = timed("update", iteration.update)
    pipelining.Snapshots.take = timed("snapshot", pipelining.Snapshots.take)
    pipelining.Pipelined.take = timed("wait for a batch", pipelining.Pipelined.take, wait=False)


def stage_rows(k: int, iterations: int) -> list:
    """Mean seconds per iteration of each (thread, stage), after the first two iterations."""
    per = collections.defaultdict(list)
    for thread, name, seconds in STAGE_TIMES:
        per[(thread, name)].append(seconds)
    rows = []
    for (thread, name), times in sorted(per.items()):
        late = times[-(iterations - 2):] if iterations > 2 else times
        rows.append([k, thread, name, f"{statistics.mean(late):.3f}"])
    return rows


def run(args, k: int, seed: int, directory: str):
    model = args.model
    tokenizer = jaxppo.models.load_tokenizer(model) if model else demo.demo_tokenizer()
    policy = model or demo.demo_policy(tokenizer, seed=seed)
    groups = args.episodes // 4
    config = jaxppo.Config.for_algorithm("grpo", batch_size=args.episodes, mini_batch_size=min(16, args.episodes),
                                         ppo_epochs=4, num_generations=4)
    settings = dict(iterations=args.iterations, query_length=32 if model else 16, response_length=args.response,
                    learning_rate=args.learning_rate, output_dir=f"{directory}/k{k}-s{seed}", progress=False,
                    export_final=False, plot=False, report_to="jsonl", sample_every=0, overlong_prompts="truncate",
                    log_every=10**9, seed=seed, max_staleness=k, old_logprobs=args.old_logprobs)
    trainer_args = dict(policy=policy, tokenizer=tokenizer, prompts=demo.DEMO_PROMPTS[:max(groups, 1) * 4])
    if args.case == "multiturn":
        Slow.seconds = args.step_seconds
        settings.update(max_turns=3, turn_length=args.response // 3, environment_workers=args.episodes)
        trainer_args.update(environment=Slow, prompts=demo.DEMO_PROMPTS)
    else:
        trainer_args.update(reward_fns=[slow_lowercase(args.reward_seconds)], prompts=demo.DEMO_PROMPTS)
    trainer = jaxppo.Trainer(config.replace(**settings), **trainer_args)
    STAGE_TIMES.clear()
    rows, stamps = [], []
    for _ in range(args.iterations):
        rows.append(trainer.step())
        stamps.append(time.perf_counter())
    trainer.close()
    assert all(r["ppo/updates_applied"] == config.batch.updates_per_step for r in rows)
    seconds = float(statistics.median(np.diff(stamps[1:]))) if len(stamps) > 2 else float("nan")
    rewards = [r["reward"] for r in rows]
    return dict(seconds=seconds, first=float(np.mean(rewards[:10])), last=float(np.mean(rewards[-10:])),
                staleness=max(r.get("rollout/staleness_max", 0) for r in rows))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["grpo", "multiturn"], default="grpo")
    parser.add_argument("--model", default=None, help="a local Hugging Face checkpoint (default: the demo policy)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--reward-seconds", type=float, default=0.3)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--old-logprobs", choices=["auto", "sampler", "recompute"], default="auto",
                        help="TrainerConfig.old_logprobs (auto: the sampler's at k = 0, recomputed at k >= 1)")
    parser.add_argument("--stages", action="store_true", help="time each stage too (see the module's doc)")
    args = parser.parse_args()
    if args.stages:
        time_stages()
    results, breakdown = {k: [] for k in args.staleness}, []
    with tempfile.TemporaryDirectory() as directory:
        for seed in range(args.seeds):  # each seed's k values back to back
            for k in args.staleness:
                results[k].append(run(args, k, seed, directory))
                print(f"seed {seed} k {k}: {results[k][-1]}", flush=True)
                breakdown += stage_rows(k, args.iterations) if args.stages and seed == 0 else []
    base = statistics.median(r["seconds"] for r in results[args.staleness[0]])
    table = []
    for k, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        table.append({"max_staleness": k, "s/iteration": f"{seconds:.3f}", "iterations/s vs k=0": f"{base / seconds:.2f}x",
                      "reward, first 10 (mean / lowest seed)": f"{np.mean([r['first'] for r in runs]):.3f} / "
                                                               f"{min(r['first'] for r in runs):.3f}",
                      "reward, last 10 (mean / lowest seed)": f"{np.mean([r['last'] for r in runs]):.3f} / "
                                                              f"{min(r['last'] for r in runs):.3f}",
                      "staleness max": max(r["staleness"] for r in runs)})
    what = f"{args.model or 'demo policy'}, {args.case}, {args.episodes} episodes, {args.seeds} seed(s), " \
           f"{args.iterations} iterations, old_logprobs {args.old_logprobs}, learning rate {args.learning_rate}"
    print(f"\n{what}\n")
    print_markdown(list(table[0]), [list(row.values()) for row in table])
    if breakdown:
        print("\nwhere the time goes (seed 0; mean s per iteration after the first two)\n")
        print_markdown(["max_staleness", "thread", "stage", "s/iteration"], breakdown)


if __name__ == "__main__":
    main()
