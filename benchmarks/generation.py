"""Benchmark: tokens per second of jaxppo's jitted KV-cache sampler vs transformers' PyTorch
`generate` on the same weights, CPU, side by side in one run.

    python benchmarks/generation.py            # small and medium shapes
    python benchmarks/generation.py --quick    # a smaller smoke run

Both sample (temperature 1, no top-k/top-p) exactly `new_tokens` tokens per row (no stop
token), from the same random GPT-2-layout checkpoint, built locally and loaded by both.
Times are medians over repeats after one warm-up call (which includes jaxppo's compile;
the compile time is reported separately).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo.models as jm


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
        out = jm.generate(model, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed),
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2's by default)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    if args.quick:
        shapes = [("small", 2, 128, 64, 16, 8)]
    else:
        shapes = [("small", 2, 128, 64, 16, 32), ("medium", 4, 512, 64, 16, 64)]
    rows = [bench_shape(n, l, w, args.vocab, b, p, t, args.repeats) for n, l, w, b, p, t in shapes]
    print(f"\n## sampling throughput, CPU ({torch.get_num_threads()} torch threads), GPT-2 layout, vocab {args.vocab}\n")
    print("| shape | layers | width | prompts x tokens | new tokens | jaxppo (tok/s) | transformers (tok/s) | speed-up | jaxppo compile (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['name']} | {r['layers']} | {r['width']} | {r['batch']} x {r['prompt']} | {r['new']} | "
              f"{r['jax_tps']:.0f} | {r['torch_tps']:.0f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} |")


if __name__ == "__main__":
    main()
