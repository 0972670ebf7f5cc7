"""Benchmark: a multi-turn iteration against a single-turn one at the same total tokens,
CPU, back to back in one run.

    python benchmarks/multiturn.py                 # 64 episodes, 4 turns of 16 tokens
    python benchmarks/multiturn.py --turns 2 --turn-length 32

Both runs train the demo's tiny GPT-2-layout policy (byte vocabulary) with GRPO on 64
completions per iteration and the same response budget R = turns * turn_length +
(turns - 1) * observation bytes. The single-turn run samples R tokens at once; the
multi-turn run samples `turns` turns of `turn_length` tokens, a scripted environment
answering each with a fixed observation of `--observation` bytes, so both rollouts hold
the same number of tokens (a random byte policy almost never emits the stop token, so
every turn runs to its length). Reported: median seconds per iteration (after the first,
which compiles) and its parts: sampling (with the environment's steps), scoring and the
update. The multi-turn run re-prefills the whole context every turn (no KV cache kept
between turns) and steps the environments on the host between turns: that is the cost
measured here.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jaxppo
from jaxppo import demo
from tables import print_markdown


class Scripted:
    """Answers every turn with the same observation; ends after `turns` turns (the
    trainer's max_turns)."""

    observation = " ok"

    def reset(self, prompt):
        pass

    def step(self, completion):
        return jaxppo.StepResult(self.observation, float(sum(c.islower() for c in completion)), False)


def run(args, multiturn: bool, output_dir: str):
    tok = demo.demo_tokenizer()
    budget = args.turns * args.turn_length + (args.turns - 1) * len(Scripted.observation)
    ppo = jaxppo.PPOConfig.for_algorithm("grpo", batch_size=64, mini_batch_size=16, ppo_epochs=1, num_generations=8)
    tc = jaxppo.TrainerConfig(iterations=args.iterations, query_length=32, response_length=budget,
                              turn_length=args.turn_length if multiturn else None, max_turns=args.turns,
                              learning_rate=1e-4, output_dir=output_dir, progress=False, sample_every=0,
                              export_final=False, plot=False, tensorboard=False)
    kwargs = dict(environment=Scripted) if multiturn else dict(reward_fn=demo.lowercase_reward)
    trainer = jaxppo.Trainer(ppo, tc, policy=demo.demo_policy(tok, max_len=32 + budget + args.turn_length),
                             tokenizer=tok, prompts=demo.DEMO_PROMPTS, **kwargs)
    history = trainer.train()[1:]  # the first iteration compiles
    tokens = statistics.mean(h["completions/mean_length"] for h in history)
    parts = {name: statistics.median(h[key] for h in history)
             for name, key in (("sampling", "time/generation"), ("scoring", "time/scoring"), ("update", "time/update"),
                               ("environment", "time/environment")) if key in history[0]}
    parts.setdefault("environment", 0.0)
    total = statistics.median(h["time/generation"] + h["time/scoring"] + h["time/update"] for h in history)
    return budget, tokens, total, parts, (history[0].get("env/turns_mean") if multiturn else 1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-length", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(args, name == "multi-turn", f"{tmp}/{i}")
                   for i, name in enumerate(("single-turn", "multi-turn"))}
    base = results["single-turn"][2]
    for name, (budget, tokens, total, parts, turns) in results.items():
        rows.append([name, f"{turns:.1f}", budget, f"{tokens:.1f}", f"{parts['sampling']:.3f}", f"{parts['environment']:.3f}",
                     f"{parts['scoring']:.3f}", f"{parts['update']:.3f}", f"{total:.3f}", f"{total / base:.2f}x"])
    print_markdown(["run", "turns", "budget R", "tokens per row", "sampling s", "of which environment s", "scoring s", "update s",
                    "iteration s", "vs single-turn"], rows)


if __name__ == "__main__":
    main()
