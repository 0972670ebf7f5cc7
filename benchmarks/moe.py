"""Benchmark: mixtures of experts (`jaxppo.models.moe`). Three sections, each a table and raw
rows (`--json`):

    python benchmarks/moe.py --section learn     # GRPO on the demo task, routing replay on/off
    python benchmarks/moe.py --section speed     # the update's tokens/s: MoE vs dense of equal active size
    python benchmarks/moe.py --section memory    # the Qwen3-30B-A3B layout's update, compiled ahead of time
    python benchmarks/moe.py --section memory --target v5p-8   # ... for a TPU target (jaxppo[plan-tpu])
    python benchmarks/moe.py --section memory --target h200x8 --gradient-accumulation-steps 2

learn: a tiny Qwen3-MoE layout (2 layers, 8 experts, 2 per token, width 32) over the demo's
byte vocabulary trained with GRPO (G = 8, batch 32 in two mini-batches, lr 1e-2) on the
demo reward (lowercase letters in a 12-token response), with routing replay and without;
per run the reward every 5 iterations, `moe/routing_mismatch` (the share of (token, layer)
pairs whose experts the update's router picks differently from the rollout's forward pass),
and the importance ratio's distance from 1, the approximate KL and the clip fraction,
averaged over the mini-batches (the first of each iteration is on-policy either way: the
same float32 forward as the forward pass).

speed: `train_step` (GRPO, 1 epoch, mini-batch 16 rows of 64 + 64 tokens) on this CPU for a
Qwen3-MoE layout (4 layers, width 256, 16 experts of 256, 2 per token) against the dense
Qwen3 layout of the same active size (one MLP of 512), and the same MoE with XLA's own
`ragged_dot` (what XLA:CPU expands into a product with every expert) instead of jaxppo's
blocked product. Median of 3 calls after one.

memory: the update, scoring and sampling programs of a GRPO run (G = 8, batch 64 of 256 +
256 tokens, mini-batch 16, bf16 compute with float32 master weights, remat, scanned layers,
the LM head 128 positions at a time) at the Qwen3-30B-A3B layout (48 layers, 128 experts, 8
per token, from its config.json; random weights, abstract: nothing allocated), compiled on
8 host CPU devices (fsdp = 8) by `jaxppo.plan`, or for a GPU/TPU target. What it predicts:
the compiler's allocation per device for these programs; what not: the time, and (on the
host CPU) the GPU compiler's own temporaries.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

if "--section" in sys.argv and sys.argv[sys.argv.index("--section") + 1] == "memory":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxppo  # noqa: E402
import jaxppo.models as jm  # noqa: E402
from jaxppo import demo  # noqa: E402
from tables import median_time, print_markdown  # noqa: E402

GIB = 2 ** 30


def _tiny_moe(tokenizer) -> jm.Model:
    return jm.Model(jm.ModelConfig(
        model_type="qwen3_moe", vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False, qk_norm=True,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id))


def learn(iterations: int, seed: int):
    tokenizer = demo.demo_tokenizer()
    rows = []
    for replay in (False, True):
        model = _tiny_moe(tokenizer)
        with tempfile.TemporaryDirectory() as out:
            settings = jaxppo.Config.for_algorithm(
                "grpo", batch_size=32, mini_batch_size=16, ppo_epochs=1, num_generations=8, routing_replay=replay,
                share_prompts=False,  # the plain layout both ways: the routing is recorded and compared
                iterations=iterations, query_length=32, response_length=12, learning_rate=1e-2, seed=seed,
                output_dir=out, progress=False, sample_every=0, checkpoint_every=0, export_final=False, plot=False,
                report_to="jsonl")
            trainer = jaxppo.Trainer(settings, policy=(model, model.init(jax.random.key(seed + 1))), tokenizer=tokenizer,
                                     prompts=demo.DEMO_PROMPTS, reward_fns=demo.lowercase_reward)
            start = time.perf_counter()
            history = [trainer.step() for _ in range(iterations)]
            seconds = time.perf_counter() - start
        rows.append({"routing_replay": replay, "updates": int(trainer.state.step), "seconds": seconds,
                     **{key: [h[metric] for h in history] for key, metric in (
                         ("scores", "objective/scores"), ("mismatch", "moe/routing_mismatch"),
                         ("ratio", "val/ratio"), ("approxkl", "policy/approxkl_avg"),
                         ("clipfrac", "policy/clipfrac_avg"))}})
    table = []
    for r in rows:
        s = r["scores"]
        curve = " / ".join(f"{np.mean(s[i:i + 5]):.2f}" for i in range(0, len(s), 5))
        table.append(["on" if r["routing_replay"] else "off", r["updates"], curve, f"{np.mean(r['mismatch']):.3f}",
                      f"{np.mean(np.abs(np.asarray(r['ratio']) - 1)):.2e}", f"{np.mean(r['approxkl']):.2e}",
                      f"{np.mean(r['clipfrac']):.3f}", f"{r['seconds']:.1f}"])
    print_markdown(["routing replay", "updates", "reward, mean per 5 iterations", "routing mismatch (mean)",
                    "mean abs(ratio - 1)", "approx KL (mean)", "clip fraction (mean)", "s"], table)
    return rows


def _speed_configs():
    common = dict(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                  max_position_embeddings=256, tie_word_embeddings=False, qk_norm=True, eos_token_ids=(2,))
    moe = jm.ModelConfig(model_type="qwen3_moe", intermediate_size=512, num_experts=16, num_experts_per_tok=2,
                         moe_intermediate_size=256, **common)
    dense = jm.ModelConfig(model_type="qwen3", intermediate_size=512, **common)
    return {"moe 16x256 top-2": moe, "dense 512": dense}


def speed(repeats: int):
    from jaxppo.models import moe as moe_module

    b, q, r = 32, 64, 64
    rng = np.random.default_rng(0)
    rollout = dict(query_tokens=jnp.asarray(rng.integers(3, 4096, (b, q))), query_mask=jnp.ones((b, q), jnp.int32),
                   response_tokens=jnp.asarray(rng.integers(3, 4096, (b, r))),
                   response_mask=jnp.ones((b, r), jnp.int32), logprobs=jnp.full((b, r), -8.0, jnp.float32),
                   values=None, rewards=jnp.asarray(rng.normal(size=(b, r)), jnp.float32))
    config = jaxppo.Config.for_algorithm("grpo", batch_size=b, mini_batch_size=16, ppo_epochs=1, num_generations=8,
                                         kl_loss_coef=0.0)
    rows = []
    variants = [(name, c, False) for name, c in _speed_configs().items()] + [
        ("moe 16x256 top-2, XLA ragged_dot", _speed_configs()["moe 16x256 top-2"], True)]
    original = moe_module.grouped_matmul
    for name, c, ragged in variants:
        moe_module.grouped_matmul = jax.lax.ragged_dot if ragged else original
        try:
            model = jm.Model(c, scan_layers=True)
            params = model.init(jax.random.key(0))
            state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-4))
            batch = jaxppo.RolloutBatch(**rollout)
            step = jax.jit(lambda s, k: jaxppo.train_step(s, batch, k, config))
            seconds, first = median_time(lambda: jax.block_until_ready(step(state, jax.random.key(1))), repeats)
        finally:
            moe_module.grouped_matmul = original
        total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        rows.append({"model": name, "params": total, "seconds": seconds, "first_s": first,
                     "tokens_per_s": b * (q + r) / seconds})
    print_markdown(["model", "params", "update s (median)", "first call s", "tokens/s"],
                   [[x["model"], f"{x['params'] / 1e6:.1f}M", f"{x['seconds']:.3f}", f"{x['first_s']:.1f}",
                     f"{x['tokens_per_s']:.0f}"] for x in rows])
    return rows


def _qwen3_30b_a3b(root: str) -> str:
    from transformers import Qwen3MoeConfig

    d = os.path.join(root, "qwen3-30b-a3b")
    Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                   num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                   num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
                   architectures=["Qwen3MoeForCausalLM"]).save_pretrained(d)
    return d


def memory(target_name: str, accumulation: int = 1):
    from jaxppo.plan import plan_run, resolve_target
    from jaxppo.run.parts import Inputs

    settings = dict(batch_size=64, mini_batch_size=16, ppo_epochs=1, query_length=256, response_length=256,
                    num_generations=8, dtype="bfloat16", remat=True, logits_chunk_size=128, scan_layers=True,
                    gradient_accumulation_steps=accumulation)
    config = jaxppo.Config.for_algorithm("grpo", **settings)
    with tempfile.TemporaryDirectory() as root:
        inputs = Inputs(policy=_qwen3_30b_a3b(root), tokenizer=None, prompts=None)
        if target_name == "host8":  # 8 host CPU devices, with H200's memory and rates (for the floor)
            h200 = resolve_target("h200x8")
            target = dataclasses.replace(h200, name="host8 (H200 figures)", platform="cpu")
            plan = plan_run(config, inputs, target, devices=jax.devices()[:8])
        else:
            plan = plan_run(config, inputs, resolve_target(target_name))
    print(plan.text())
    rows = [{"program": p.name, "compile_s": p.compile_s, "refused": p.refused,
             "total_gib": None if p.memory is None else p.total / GIB,
             "peak_gib": None if p.memory is None else p.memory.peak / GIB,
             "arguments_gib": None if p.memory is None else p.memory.arguments / GIB,
             "temporaries_gib": None if p.memory is None else p.memory.temporaries / GIB,
             "flops": p.work.flops, "floor_s": p.lower_bound_s} for p in plan.programs]
    return {"target": target_name, "gradient_accumulation_steps": accumulation, "mesh": plan.mesh_axes,
            "fits": plan.fits, "programs": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("learn", "speed", "memory"), required=True)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", default="host8", help="host8 (8 host CPU devices) or a jaxppo plan target")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, help="memory: micro-batches per update")
    parser.add_argument("--json", help="write the raw rows here")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices, "
          f"{time.strftime('%Y-%m-%d')}")
    if args.section == "learn":
        raw = learn(args.iterations, args.seed)
    elif args.section == "speed":
        raw = speed(args.repeats)
    else:
        raw = memory(args.target, args.gradient_accumulation_steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
