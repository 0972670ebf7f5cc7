"""Benchmark: tokens per second of jaxppo's jitted KV-cache sampler vs transformers' PyTorch
`generate` on the same weights, CPU, side by side in one run.

    python benchmarks/generation.py            # small and medium shapes
    python benchmarks/generation.py --quick    # a smaller smoke run
    python benchmarks/generation.py --early-stop   # jaxppo alone: early stop vs all steps
    python benchmarks/generation.py --layouts --vocab 1024   # jaxppo alone: unrolled vs scanned layers
    python benchmarks/generation.py --shared-prefix --vocab 1024   # jaxppo alone: G = 8 with shared prefixes vs without
    python benchmarks/generation.py --continuous --vocab 1024   # jaxppo alone: continuous batching vs static, long tail

With --early-stop, every fourth token id is a stop token, so most rows stop early (a row
lasts 4 tokens on average); jaxppo's sampler runs with `early_stop=True` (decoding ends once
every row has stopped) and `early_stop=False` (all steps), alternating, on the same keys:
the outputs are identical, the time is not.

Both sample (temperature 1, no top-k/top-p) exactly `new_tokens` tokens per row (no stop
token), from the same random GPT-2-layout checkpoint, built locally and loaded by both.
Times are medians over repeats after one warm-up call (which includes jaxppo's compile;
the compile time is reported separately).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate
from tables import print_markdown


def build_checkpoint(directory, layers, width, vocab, positions):
    import torch
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                                     n_positions=positions, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def bench_shape(name, layers, width, vocab, batch, prompt_len, new_tokens, repeats):
    import torch

    with tempfile.TemporaryDirectory() as directory:
        torch_model = build_checkpoint(directory, layers, width, vocab, prompt_len + new_tokens)
        model, params = jm.from_pretrained(directory)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, size=(batch, prompt_len))
    mask = np.ones_like(ids)

    def run_jax(seed):
        out = generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed),
                          response_length=new_tokens, stop_token_ids=())
        jax.block_until_ready(out.tokens)

    start = time.perf_counter()
    run_jax(0)
    compile_s = time.perf_counter() - start
    jax_times = []
    for i in range(repeats):
        start = time.perf_counter()
        run_jax(i + 1)
        jax_times.append(time.perf_counter() - start)

    torch_ids, torch_mask = torch.tensor(ids), torch.tensor(mask)
    torch_model.generation_config.eos_token_id = None

    def run_torch():
        with torch.no_grad():
            out = torch_model.generate(input_ids=torch_ids, attention_mask=torch_mask, do_sample=True, top_k=0,
                                       top_p=1.0, temperature=1.0, max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, pad_token_id=0)
        assert out.shape[1] == prompt_len + new_tokens

    run_torch()
    torch_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_torch()
        torch_times.append(time.perf_counter() - start)

    n_tokens = batch * new_tokens
    t_jax, t_torch = float(np.median(jax_times)), float(np.median(torch_times))
    return dict(name=name, layers=layers, width=width, vocab=vocab, batch=batch, prompt=prompt_len, new=new_tokens,
                jax_tps=n_tokens / t_jax, torch_tps=n_tokens / t_torch, speedup=t_torch / t_jax, compile_s=compile_s)


def alternate(run, repeats, flags=(False, True)):
    """{flag: [seconds]}: `run(seed, flag)` timed `repeats` times for each flag (False and
    True unless given), alternating, seeds 1, 2, ... (the same keys for each)."""
    times = {flag: [] for flag in flags}
    for i in range(repeats):
        for flag in flags:
            start = time.perf_counter()
            run(i + 1, flag)
            times[flag].append(time.perf_counter() - start)
    return times


def bench_early_stop(name, layers, width, vocab, batch, prompt_len, new_tokens, repeats):
    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint(directory, layers, width, vocab, prompt_len + new_tokens)
        model, params = jm.from_pretrained(directory)
    rng = np.random.default_rng(0)
    ids, mask = jnp.asarray(rng.integers(1, vocab, size=(batch, prompt_len))), jnp.ones((batch, prompt_len), jnp.int32)
    stops = tuple(range(0, vocab, 4))

    def run(seed, early):
        out = generate(model, params, ids, mask, jax.random.key(seed), response_length=new_tokens,
                          stop_token_ids=stops, pad_token_id=1, early_stop=early)
        jax.block_until_ready(out.tokens)
        return out

    run(0, True), run(0, False)  # compile both
    times = {True: [], False: []}
    real = []
    for i in range(repeats):
        for early in (True, False):
            start = time.perf_counter()
            out = run(i + 1, early)
            times[early].append(time.perf_counter() - start)
        real.append(int(np.asarray(out.mask).sum()))
        longest = int(np.asarray(out.mask).sum(1).max())
    t_early, t_full = float(np.median(times[True])), float(np.median(times[False]))
    tokens = float(np.mean(real))
    return dict(name=name, layers=layers, width=width, batch=batch, new=new_tokens, mean_len=tokens / batch,
                longest=longest, early_tps=tokens / t_early, full_tps=tokens / t_full, speedup=t_full / t_early)


def bench_layouts(name, layers, width, vocab, batch, prompt_len, new_tokens, repeats):
    """jaxppo alone: the same checkpoint with unrolled layers, with scanned layers (whose KV
    cache is one stacked array), and scanned with `hoist_layers` (each layer's weights
    sliced out once per call, not at every decode step), alternating on the same keys."""
    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint(directory, layers, width, vocab, prompt_len + new_tokens)
        models = {scan: jm.from_pretrained(directory, scan_layers=scan) for scan in (False, True)}
    model, params = models[True]
    models["hoisted"] = (dataclasses.replace(model, hoist_layers=True), params)
    rng = np.random.default_rng(0)
    ids, mask = jnp.asarray(rng.integers(1, vocab, size=(batch, prompt_len))), jnp.ones((batch, prompt_len), jnp.int32)

    def run(seed, layout):
        model, params = models[layout]
        out = generate(model, params, ids, mask, jax.random.key(seed), response_length=new_tokens,
                          stop_token_ids=())
        return np.asarray(jax.block_until_ready(out.tokens))

    first = {layout: run(0, layout) for layout in models}  # also compiles each
    assert np.array_equal(first["hoisted"], first[False])  # the hoisted sampler decodes as the unrolled layout
    times = alternate(run, repeats, flags=(False, True, "hoisted"))
    n = batch * new_tokens
    cache_mib = 2 * layers * batch * (prompt_len + new_tokens) * width * 4 / 2**20
    return dict(name=name, layers=layers, width=width, batch=batch, prompt=prompt_len, new=new_tokens,
                cache_mib=cache_mib, unrolled=n / float(np.median(times[False])),
                scanned=n / float(np.median(times[True])), hoisted=n / float(np.median(times["hoisted"])))


def bench_shared_prefix(name, layers, width, vocab, prompts, g, prompt_len, new_tokens, repeats):
    """jaxppo alone: `prompts` prompts x G completions each, the prompt prefilled once per
    group and its KV cache shared (`num_generations=G`) vs prefilled for every row,
    alternating on the same keys (same tokens, checked)."""
    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint(directory, layers, width, vocab, prompt_len + new_tokens)
        model, params = jm.from_pretrained(directory, scan_layers=True)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.repeat(rng.integers(1, vocab, size=(prompts, prompt_len)), g, axis=0))
    mask = jnp.ones(ids.shape, jnp.int32)

    def run(seed, shared):
        out = generate(model, params, ids, mask, jax.random.key(seed), response_length=new_tokens,
                          stop_token_ids=(), num_generations=g if shared else 1)
        return np.asarray(jax.block_until_ready(out.tokens))

    assert np.array_equal(run(0, False), run(0, True))  # also compiles both
    times = alternate(run, repeats)
    n = prompts * g * new_tokens
    return dict(name=name, layers=layers, width=width, prompts=prompts, g=g, prompt=prompt_len, new=new_tokens,
                unshared=n / float(np.median(times[False])), shared=n / float(np.median(times[True])))


def bench_continuous(name, layers, width, vocab, requests, slots, prompt_len, short, long, long_share, repeats):
    """jaxppo alone: a long-tailed length mix (each request's budget `short` tokens, or
    `long` for a `long_share` of them; no stop token), the static sampler (early stop on:
    it runs until the longest row ends) against the continuous sampler with
    `slots` slots, alternating on the same keys (same tokens, checked)."""
    from jaxppo.rollout.engines.continuous import generate_continuous

    with tempfile.TemporaryDirectory() as directory:
        build_checkpoint(directory, layers, width, vocab, prompt_len + long)
        model, params = jm.from_pretrained(directory, scan_layers=True)
    rng = np.random.default_rng(0)
    ids, mask = jnp.asarray(rng.integers(1, vocab, size=(requests, prompt_len))), jnp.ones((requests, prompt_len),
                                                                                          jnp.int32)
    budgets = np.full(requests, short)
    budgets[rng.permutation(requests)[: int(round(long_share * requests))]] = long
    budgets = jnp.asarray(budgets)

    def run(seed, engine):
        kw = dict(response_length=long, stop_token_ids=(), max_lengths=budgets)
        out = (generate_continuous(model, params, ids, mask, jax.random.key(seed), num_slots=slots, **kw) if engine
               else generate(model, params, ids, mask, jax.random.key(seed), **kw))
        return np.asarray(jax.block_until_ready(out.tokens))

    assert np.array_equal(run(0, False), run(0, True))  # also compiles both
    times = alternate(run, repeats)
    n = int(np.asarray(budgets).sum())
    return dict(name=name, layers=layers, width=width, requests=requests, slots=slots, prompt=prompt_len,
                mix=f"{1 - long_share:.0%} x {short}, {long_share:.0%} x {long}", tokens=n,
                static=n / float(np.median(times[False])), engine=n / float(np.median(times[True])))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2's by default)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--early-stop", action="store_true", help="jaxppo with and without early stop")
    parser.add_argument("--layouts", action="store_true", help="jaxppo with unrolled and with scanned layers")
    parser.add_argument("--shared-prefix", action="store_true", help="jaxppo, G = 8: shared prefixes vs not")
    parser.add_argument("--continuous", action="store_true", help="jaxppo: continuous batching vs static, long tail")
    args = parser.parse_args()
    if args.continuous:
        shapes = [("long tail", 2, 128, 64, 16, 16, 32, 512, 0.1)]
        rows = [bench_continuous(n, l, w, args.vocab, b, s, q, a, z, f, args.repeats) for n, l, w, b, s, q, a, z, f
                in shapes]
        print(f"\n## jaxppo sampling, continuous batching vs static, CPU, GPT-2 layout, vocab {args.vocab}\n")
        print_markdown(["shape", "layers", "width", "requests", "slots", "prompt tokens", "budgets", "tokens",
                        "static (tok/s)", "continuous (tok/s)", "continuous / static"],
                       [[r["name"], r["layers"], r["width"], r["requests"], r["slots"], r["prompt"], r["mix"],
                         r["tokens"], f"{r['static']:.0f}", f"{r['engine']:.0f}", f"{r['engine'] / r['static']:.2f}"]
                        for r in rows])
        return
    if args.shared_prefix:
        shapes = [("256-token prompts", 4, 256, 4, 8, 256, 32), ("256-token prompts, longer responses", 4, 256, 4, 8,
                                                                  256, 128)]
        rows = [bench_shared_prefix(n, l, w, args.vocab, p, g, q, t, args.repeats) for n, l, w, p, g, q, t in shapes]
        print(f"\n## jaxppo sampling, G completions per prompt, shared prefixes, CPU, GPT-2 layout, vocab {args.vocab}\n")
        print_markdown(["shape", "layers", "width", "prompts x G", "prompt tokens", "new tokens",
                        "prefill per row (tok/s)", "shared prefix (tok/s)", "shared / per row"],
                       [[r["name"], r["layers"], r["width"], f"{r['prompts']} x {r['g']}", r["prompt"], r["new"],
                         f"{r['unshared']:.0f}", f"{r['shared']:.0f}", f"{r['shared'] / r['unshared']:.2f}"]
                        for r in rows])
        return
    if args.layouts:
        shapes = [("long cache", 8, 256, 32, 512, 32), ("decode-heavy", 4, 512, 32, 64, 128)]
        rows = [bench_layouts(n, l, w, args.vocab, b, p, t, args.repeats) for n, l, w, b, p, t in shapes]
        print(f"\n## jaxppo sampling, unrolled vs scanned layers (plain and hoisted), CPU, GPT-2 layout, "
              f"vocab {args.vocab}\n")
        print_markdown(["shape", "layers", "width", "prompts x tokens", "new tokens", "KV cache (MiB)",
                        "unrolled (tok/s)", "scanned (tok/s)", "scanned, hoisted (tok/s)", "scanned / unrolled",
                        "hoisted / scanned"],
                       [[r["name"], r["layers"], r["width"], f"{r['batch']} x {r['prompt']}", r["new"],
                         f"{r['cache_mib']:.0f}", f"{r['unrolled']:.0f}", f"{r['scanned']:.0f}", f"{r['hoisted']:.0f}",
                         f"{r['scanned'] / r['unrolled']:.2f}", f"{r['hoisted'] / r['scanned']:.2f}"] for r in rows])
        return
    if args.early_stop:
        shapes = [("small", 2, 128, 64, 16, 32), ("medium", 4, 512, 64, 16, 64)]
        rows = [bench_early_stop(n, l, w, args.vocab, b, p, t, args.repeats) for n, l, w, b, p, t in shapes]
        print(f"\n## jaxppo sampling with early stop, CPU, GPT-2 layout, vocab {args.vocab}, every 4th token a stop\n")
        print_markdown(["shape", "layers", "width", "rows", "max new tokens", "mean length", "longest row",
                        "early stop (real tok/s)", "all steps (real tok/s)", "speed-up"],
                       [[r["name"], r["layers"], r["width"], r["batch"], r["new"], f"{r['mean_len']:.1f}", r["longest"],
                         f"{r['early_tps']:.0f}", f"{r['full_tps']:.0f}", f"{r['speedup']:.2f}x"] for r in rows])
        return
    import torch

    if args.quick:
        shapes = [("small", 2, 128, 64, 16, 8)]
    else:
        shapes = [("small", 2, 128, 64, 16, 32), ("medium", 4, 512, 64, 16, 64)]
    rows = [bench_shape(n, l, w, args.vocab, b, p, t, args.repeats) for n, l, w, b, p, t in shapes]
    print(f"\n## sampling throughput, CPU ({torch.get_num_threads()} torch threads), GPT-2 layout, vocab {args.vocab}\n")
    print_markdown(["shape", "layers", "width", "prompts x tokens", "new tokens", "jaxppo (tok/s)",
                    "transformers (tok/s)", "speed-up", "jaxppo compile (s)"],
                   [[r["name"], r["layers"], r["width"], f"{r['batch']} x {r['prompt']}", r["new"], f"{r['jax_tps']:.0f}",
                     f"{r['torch_tps']:.0f}", f"{r['speedup']:.2f}x", f"{r['compile_s']:.1f}"] for r in rows])


if __name__ == "__main__":
    main()
