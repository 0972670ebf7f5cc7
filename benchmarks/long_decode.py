"""Benchmark: what one decode step of the built-in static sampler costs as the response
budget grows, with the tokens actually held kept the same (issue 72: long answers).

    python benchmarks/long_decode.py            # budgets of 1k, 4k and 16k tokens
    python benchmarks/long_decode.py --quick    # 256, 1k, 4k

Every row is cut off after 256 sampled tokens (`max_lengths`, early stop on), so every
call holds and samples the same tokens; only the KV cache's allocated budget
(`response_length`) differs. A step whose cost follows the tokens held would take the same
time at every budget; one that reads the whole allocated cache grows with the budget.
Llama layout, 2 layers, width 128, 4 query and 2 key/value heads, 4 rows of a 64-token
prompt, float32, the one-device CPU (XLA:CPU). Times are the median of three calls after a
warm-up (which compiles); the step time is the call's time over 256 steps (the prefill
included: a 64-token prompt, small beside the steps).
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxppo.models as jm
from jaxppo.rollout.engines.static import generate


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    budgets = (256, 1024, 4096) if args.quick else (1024, 4096, 16384)
    held, q, b = 256, 64, 4
    cfg = jm.ModelConfig(model_type="llama", vocab_size=512, hidden_size=128, num_layers=2, num_heads=4,
                         num_kv_heads=2, intermediate_size=256, max_position_embeddings=q + max(budgets),
                         tie_word_embeddings=False)
    model = jm.Model(cfg)
    params = model.init(jax.random.key(0))
    prompts = jnp.asarray(np.random.default_rng(0).integers(3, 512, (b, q)))
    mask = jnp.ones((b, q), jnp.int32)
    rows = []
    for budget in budgets:
        limit = jnp.full((b,), held, jnp.int32)

        def call(seed):
            out = generate(model, params, prompts, mask, jax.random.key(seed), response_length=budget,
                           max_lengths=limit, early_stop=True)
            return jax.block_until_ready(out)

        start = time.perf_counter()
        out = call(0)
        first = time.perf_counter() - start
        assert int(np.asarray(out.mask).sum(axis=1).max()) == held
        times = []
        for seed in (1, 2, 3):
            start = time.perf_counter()
            call(seed)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        rows.append((budget, first, median, 1000 * median / held))
        print(f"  measured budget {budget}", flush=True)
    print(f"\n## The static sampler, {b} rows of {q} + {held} sampled tokens, budgets of "
          f"{', '.join(str(x) for x in budgets)} tokens\n")
    print("| response budget | first call (s, compiles) | call (s) | per step (ms) |")
    print("| ---: | ---: | ---: | ---: |")
    for budget, first, median, step in rows:
        print(f"| {budget} | {first:.2f} | {median:.3f} | {step:.2f} |")


if __name__ == "__main__":
    main()
