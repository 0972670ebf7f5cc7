"""Benchmark: a multi-turn iteration against a single-turn one at the same total tokens,
CPU, back to back in one run.

    python benchmarks/multiturn.py                 # 64 episodes, 4 turns of 16 tokens
    python benchmarks/multiturn.py --turns 2 --turn-length 32
    python benchmarks/multiturn.py --model ~/.cache/jaxppo/fixtures/smollm2-135m-instruct \
        --episodes 16 --iterations 4         # a real model (`jaxppo-fixture`), its fast tokenizer

Both runs train the demo's tiny GPT-2-layout policy (byte vocabulary) with GRPO on 64
completions per iteration and the same response budget R = turns * turn_length +
(turns - 1) * observation bytes. The single-turn run samples R tokens at once; the
multi-turn run samples `turns` turns of `turn_length` tokens, a scripted environment
answering each with a fixed observation of `--observation` bytes, so both rollouts hold
the same number of tokens (a random byte policy almost never emits the stop token, so
every turn runs to its length; with `--model` the stop token is one the model does not
emit, for the same reason). Reported: median seconds per iteration (after the first,
which compiles) and its parts: sampling (with the environment's steps), scoring and the
update. The multi-turn run is measured twice: keeping each row's KV cache between turns
(`turn_cache`, the default: a turn feeds only its new tokens) and prefilling the whole
context again every turn (`--no-turn-cache`); both step the environments on the host
between turns.
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


def run(args, multiturn: bool, output_dir: str, turn_cache: bool = True):
    if args.model:
        from jaxppo.models.tokenizer import load_tokenizer

        tok = load_tokenizer(args.model)
        stop = {"stop_tokens": (len(tok) - 1,)}  # a token the model does not emit: every turn runs to its length
    else:
        tok, stop = demo.demo_tokenizer(), {}
    observation = len(tok(Scripted.observation, add_special_tokens=False)["input_ids"])
    budget = args.turns * args.turn_length + (args.turns - 1) * observation
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=args.episodes, mini_batch_size=args.episodes // 4,
                                         ppo_epochs=1, num_generations=8)
    tc = dict(iterations=args.iterations, query_length=32, response_length=budget, **stop,
              turn_length=args.turn_length if multiturn else None, max_turns=args.turns,
              turn_cache=turn_cache, learning_rate=1e-4, output_dir=output_dir, progress=False, sample_every=0,
              export_final=False, plot=False, report_to="jsonl")
    kwargs = dict(environment=Scripted) if multiturn else dict(reward_fns=demo.lowercase_reward)
    policy = args.model or demo.demo_policy(tok, max_len=32 + budget + args.turn_length)
    trainer = jaxppo.Trainer(ppo.replace(**tc), policy=policy,
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
    parser.add_argument("--episodes", type=int, default=64, help="completions per iteration (groups of 8)")
    parser.add_argument("--model", default=None, help="a local checkpoint directory instead of the demo's policy")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(args, name != "single-turn", f"{tmp}/{i}", name != "multi-turn, re-prefill")
                   for i, name in enumerate(("single-turn", "multi-turn, cache kept", "multi-turn, re-prefill"))}
    base = results["single-turn"][2]
    for name, (budget, tokens, total, parts, turns) in results.items():
        rows.append([name, f"{turns:.1f}", budget, f"{tokens:.1f}", f"{parts['sampling']:.3f}", f"{parts['environment']:.3f}",
                     f"{parts['scoring']:.3f}", f"{parts['update']:.3f}", f"{total:.3f}", f"{total / base:.2f}x"])
    print_markdown(["run", "turns", "budget R", "tokens per row", "sampling s", "of which environment s", "scoring s", "update s",
                    "iteration s", "vs single-turn"], rows)


if __name__ == "__main__":
    main()
