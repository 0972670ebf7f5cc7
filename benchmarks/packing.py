"""Benchmark: the update (`train_step`) and the forward pass on packed sequences against the
padded batch, on a long-tailed length mix, back to back in one process.

    python benchmarks/packing.py            # 32 rows, most completions 32 tokens, a tenth 512
    python benchmarks/packing.py --quick    # smaller, for a smoke run

The rows: prompts of 24-32 real tokens (left-padded to 32), responses of 32 tokens, except a
tenth that run to the 512-token budget. Both paths run the same GRPO update (same
mini-batches, same permutation, same number of optimizer updates) on a small Qwen2-layout
model; packing uses the streams the trainer would choose (`jaxppo.update.packing.minibatch_streams`,
stream length Q + R). Each time is the median of `--repeats` calls after one compiling call.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax

import jaxppo
import jaxppo.models as jm
from jaxppo.update import packing
from jaxppo.update.batch import response_outputs
from jaxppo.update.minibatches import minibatch_indices

from rollouts import random_rollout
from tables import median_time, print_markdown


def make_rollout(b, q, r, short, vocab, seed=0):
    rng = np.random.default_rng(seed)
    long_rows = np.zeros(b, bool)
    long_rows[rng.choice(b, max(1, round(b / 10)), replace=False)] = True  # a tenth run to the budget
    lengths = np.where(long_rows, r, short)[:, None]
    pads = rng.integers(0, q // 4 + 1, size=(b, 1))
    rollout = random_rollout(rng, rng.integers(0, vocab, (b, q)), pads, lengths, r, vocab, ref_logprobs=True)
    return rollout, int(long_rows.sum())


def timed(fn, repeats):
    """(median seconds per call, seconds of the first call: compiling included)."""
    return median_time(lambda: jax.block_until_ready(fn()), repeats)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    b, q, r, short = (16, 16, 128, 16) if args.quick else (32, 32, 512, 32)
    cfg = jm.ModelConfig(model_type="qwen2", vocab_size=4096, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         intermediate_size=704, max_position_embeddings=q + r, activation="silu", qkv_bias=True,
                         tie_word_embeddings=True)
    model = jm.Model(cfg, scan_layers=True)
    params = model.init(jax.random.key(0))
    rollout, n_long = make_rollout(b, q, r, short, cfg.vocab_size)
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=b // 2, ppo_epochs=1,
                                            num_generations=4)
    key = jax.random.key(1)
    width = q + r
    lengths = np.asarray(rollout.query_mask).sum(1) + np.asarray(rollout.response_mask).sum(1)
    streams = packing.minibatch_streams(lengths, np.asarray(minibatch_indices(key, config)), config.batch.micro_batch_size,
                                        width)
    packed_config = config.replace(pack_sequences=True, pack_streams=streams)
    state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-5))

    def update(c):
        return lambda: jaxppo.train_step(state, rollout, key, c)[1]["loss/total_avg"]

    batch = {"query_tokens": rollout.query_tokens, "query_mask": rollout.query_mask,
             "response_tokens": rollout.response_tokens, "response_mask": rollout.response_mask}
    score_streams = packing.round_streams(packing.streams_needed(lengths, width), b)
    score_padded = jax.jit(lambda p: response_outputs(model.apply, p, batch, 1.0)[0])
    score_packed = jax.jit(lambda p: packing.response_outputs(model.apply, p, batch, 1.0, score_streams)[0])

    t_update_padded = timed(update(config), args.repeats)
    t_update_packed = timed(update(packed_config), args.repeats)
    t_score_padded = timed(lambda: score_padded(params), args.repeats)
    t_score_packed = timed(lambda: score_packed(params), args.repeats)
    real = float(lengths.sum())
    print(f"\n## packed sequences: {b} rows, Q={q}, R={r}, {n_long} rows of {r} response tokens, the rest {short}; "
          f"{real / (b * width):.1%} of the padded batch is real tokens; GRPO, {config.batch.updates_per_step} updates\n")
    rows = []
    for what, padded_shape, packed_shape, (padded, padded_first), (packed, packed_first) in [
            ("update (train_step)", f"{b // 2} rows x {width}", f"{streams} streams x {width}", t_update_padded,
             t_update_packed),
            ("forward pass", f"{b} rows x {width}", f"{score_streams} streams x {width}", t_score_padded,
             t_score_packed)]:
        rows.append([what, padded_shape, packed_shape, f"{padded:.3f} s", f"{packed:.3f} s", f"{padded / packed:.2f}x",
                     f"{padded_first:.1f} s / {packed_first:.1f} s"])
    print_markdown(["what", "padded shape (per micro-batch)", "packed shape", "padded", "packed", "speed-up",
                    "first call, compiling (padded / packed)"], rows, numeric_from=3)


if __name__ == "__main__":
    main()
