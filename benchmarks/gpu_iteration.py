"""The whole PPO and GRPO iteration on one accelerator, jaxppo and TRL side by side, from
the same random weights (issue 56; the per-program figures are `gpu.py`'s).

    bash benchmarks/gpu_wheels.sh                     # on a machine with the registry: TRL's wheels
    python benchmarks/gpu_iteration.py --out $OUT/jaxppo.json          # jaxppo, on the GPU
    python benchmarks/gpu_iteration.py --side trl --out $OUT/trl.json  # TRL 1.12 (PyTorch), same GPU
    python benchmarks/gpu_iteration.py --tiny [--side trl]             # 2-layer smoke run (CPU)

The two sides run as separate processes (JAX and PyTorch each take the GPU's memory for
themselves), one after the other; `gpu_calls.sh iteration` runs both in one device call
(jaxppo's side first: it writes the weights).
Each side writes the layouts' weights once, or reads them if there already (`--weights`):
a Hugging Face directory per layout with the policy (causal LM) and the reward model
(one-label sequence classifier, also the critic's start), float32, random, and a word-level
tokenizer of the layout's vocabulary (<pad>, <eos>, <unk>, then "t3" ... "t151935", one
word per id, so that text and ids convert both ways exactly). Prompts are `--query` such words, so no row is padded.

The work, both sides: 64 rows of 256 prompt + 256 response tokens (no stop token: every
response has its full length), bf16 compute (TRL: `bf16=True` autocast; jaxppo: bfloat16
compute over float32 master weights), rematerialisation (TRL: gradient checkpointing), one
epoch in mini-batches of 16 (4 optimizer steps; the updates applied are checked on both
sides), temperature 1. PPO: policy, reference, critic (from the reward model) and the
reward model, KL 0.05. GRPO: 8 prompts x G = 8, the reward model as the reward, beta 0.04
(a reference model). Per case: the first iteration (compilation included on jaxppo's
side), then the median of the later iterations, whole and per part (sampling, scoring,
update; jaxppo's sampling waited for and timed at the rollout engine, the rest of its
`time/generation` and `time/scoring` as scoring, `time/update`; TRL's split as
`trl_reference.py` and `trl_grpo_reference.py` mark it), the update's MFU (model FLOPs over the update's time and
--peak-tflops) and the sampler's tokens/s. jaxppo's variants: the defaults, unrolled
layers, the gated MLP differentiated automatically instead of its own backward pass
(`jaxppo.models.gated_mlp.own_backward`), cuDNN attention (NVIDIA GPUs only). A case that
fails is recorded and the rest still run; cases past --budget-s are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import numpy as np  # noqa: E402

import layouts  # noqa: E402

ALGORITHMS = {"ppo": dict(kl=0.05), "grpo": dict(kl=0.04, generations=8)}
VARIANTS = {"defaults": {}, "unrolled layers": dict(scan_layers=False), "autodiff gated MLP": dict(own_backward=False),
            "cudnn attention": dict(attention="cudnn")}


def word_tokenizer(vocab: int):
    """A fast tokenizer whose every id is one word: <pad>, <eos>, <unk>, then "t3" ... (the
    special tokens' names are no word's prefix: the tokenizer matches them inside words)."""
    import tokenizers
    import transformers

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def prepare(config, directory: str) -> dict:
    """The layout's policy, reward model and tokenizer under `directory` (written once)."""
    paths = {name: os.path.join(directory, name) for name in ("policy", "reward", "tokenizer")}
    if all(os.path.isfile(os.path.join(p, "config.json")) or name == "tokenizer" and os.path.isdir(p)
           for name, p in paths.items()):
        return paths
    import jax

    import jaxppo.models as jm
    from jaxppo.models import hf as hf_io

    for name, kind, seed in (("policy", "causal_lm", 0), ("reward", "reward", 1)):
        model = jm.Model(config, kind=kind)
        params = jax.jit(lambda key, m=model: m.init(key, seq_len=2))(jax.random.key(seed))
        hf_io.save_pretrained(model, jax.device_get(params), paths[name])
        del params
    tokenizer = word_tokenizer(config.vocab_size)
    for name in ("tokenizer", "policy", "reward"):
        tokenizer.save_pretrained(paths[name])
    return paths


def prompt_texts(vocab: int, rows: int, query: int):
    rng = np.random.default_rng(0)
    return [" ".join(f"t{i}" for i in rng.integers(3, vocab, query)) for _ in range(rows)]


def settings(args, algorithm: str) -> dict:
    """What both sides run: rows, prompts per iteration, generations per prompt."""
    g = ALGORITHMS[algorithm].get("generations", 1)
    return dict(rows=args.batch, prompts=args.batch // g, generations=g, query=args.query, response=args.response,
                mini=args.mini_batch, kl=ALGORITHMS[algorithm]["kl"])


def summarise(config, s: dict, rows: list, critic: bool, peak_tflops: float) -> dict:
    """First iteration, medians of the later ones (whole and per part), MFU, tokens/s."""
    later = rows[1:] or rows
    med = {k: float(np.median([r[k] for r in later])) for k in ("total", "generation", "scoring", "update")}
    out = {"first_iteration_s": rows[0]["total"], "iterations": len(rows), **{f"{k}_s": v for k, v in med.items()}}
    flops = layouts.train_flops(config, s["rows"], s["query"], s["response"], trunks=2 if critic else 1)
    out["update_mfu"] = flops / med["update"] / (peak_tflops * 1e12)
    out["sampler_tokens_per_s"] = s["rows"] * s["response"] / med["generation"]
    return out


def jaxppo_case(config, paths, args, algorithm: str, variant: dict) -> dict:
    import jax

    import jaxppo
    from jaxppo.models.gated_mlp import own_backward
    from jaxppo.models.tokenizer import load_tokenizer

    s = settings(args, algorithm)
    extra = {k: v for k, v in variant.items() if k != "own_backward"}
    if extra.get("attention") == "cudnn" and jax.default_backend() != "gpu":
        return {"skipped": "cuDNN attention needs an NVIDIA GPU"}
    kl = dict(kl_coef=s["kl"]) if algorithm == "ppo" else dict(kl_loss_coef=s["kl"], num_generations=s["generations"])
    config_ = jaxppo.Config.for_algorithm(algorithm, batch_size=s["rows"], mini_batch_size=s["mini"], ppo_epochs=1,
                                          **kl)
    tokenizer = load_tokenizer(paths["tokenizer"])
    with tempfile.TemporaryDirectory() as out, own_backward(variant.get("own_backward", True)):
        tc = dict(iterations=args.iterations, query_length=s["query"], response_length=s["response"],
                  output_dir=out, progress=False, sample_every=0, report_to="jsonl", plot=False, export_final=False,
                  checkpoint_every=0, learning_rate=1e-6, temperature=1.0, stop_tokens=(), dtype="bfloat16",
                  remat=True, logits_chunk_size=128, **extra)
        trainer = jaxppo.Trainer(config_.replace(**tc), policy=paths["policy"], tokenizer=tokenizer,
                                 prompts=prompt_texts(config.vocab_size, s["prompts"] * args.iterations, s["query"]),
                                 reward_model=paths["reward"])
        engine, sampled = trainer.parts.rollout_engine, []
        sample = engine.sample

        def waited(*a, **k):  # the samples waited for, so that sampling is timed apart from scoring
            start = time.perf_counter()
            out = jax.block_until_ready(sample(*a, **k))
            sampled.append(time.perf_counter() - start)
            return out

        engine.sample = waited
        rows = []
        for _ in range(args.iterations):
            start, sampled[:] = time.perf_counter(), []
            m = trainer.step()
            total = time.perf_counter() - start
            assert int(m["ppo/updates_applied"]) == s["rows"] // s["mini"], m["ppo/updates_applied"]
            before_update = m["time/generation"] + m["time/scoring"]  # sampling, then scoring
            rows.append(dict(total=total, generation=sum(sampled), scoring=before_update - sum(sampled),
                             update=m["time/update"]))
        trainer.close()
    return summarise(config, s, rows, algorithm == "ppo", args.peak_tflops)


def trl_case(config, paths, args, algorithm: str) -> dict:
    """TRL 1.12's PPOTrainer or GRPOTrainer on the same weights, tokenizer and prompts."""
    import torch
    import transformers

    s = settings(args, algorithm)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(paths["tokenizer"])
    tokenizer.padding_side = "left"
    texts = prompt_texts(config.vocab_size, s["prompts"] * (args.iterations + 1), s["query"])
    common = dict(bf16=device == "cuda", fp16=False, gradient_checkpointing=True, report_to=[], save_strategy="no",
                  disable_tqdm=True, logging_steps=10**9, learning_rate=1e-6, seed=0, use_cpu=device == "cpu")
    with tempfile.TemporaryDirectory() as out:
        if algorithm == "ppo":
            rows = _trl_ppo(paths, tokenizer, texts, s, args.iterations, common, out)
        else:
            rows = _trl_grpo(paths, tokenizer, texts, s, args.iterations, common, out)
    return summarise(config, s, rows, algorithm == "ppo", args.peak_tflops)


def _trl_ppo(paths, tokenizer, texts, s, iterations, common, out):
    import datasets
    import torch
    import transformers
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    from trl_reference import marking_generation

    marks, rows = {}, []
    ppo_trainer.batch_generation = marking_generation(ppo_trainer.batch_generation, marks)

    class Clock(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.clear()
            marks["begin"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            end = time.perf_counter()
            rows.append(dict(total=end - marks["begin"], generation=marks["generation_end"] - marks["generation_start"],
                             scoring=marks["update_start"] - marks["generation_end"], update=end - marks["update_start"]))
            marks.clear()
            marks["begin"] = end

    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    dataset = datasets.Dataset.from_dict({"input_ids": ids})
    load = lambda path: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # noqa: E731
    score = lambda: transformers.AutoModelForSequenceClassification.from_pretrained(  # noqa: E731
        paths["reward"], num_labels=1, dtype=torch.float32)  # float32 master weights, bf16 autocast
    args = PPOConfig(output_dir=out, per_device_train_batch_size=s["rows"], gradient_accumulation_steps=1,
                     num_mini_batches=s["rows"] // s["mini"], num_ppo_epochs=1, total_episodes=s["rows"] * iterations,
                     response_length=s["response"], temperature=1.0, stop_token=None, kl_coef=s["kl"],
                     local_rollout_forward_batch_size=s["rows"], num_sample_generations=0, **common)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=load(paths["policy"]),
                         ref_model=load(paths["policy"]), reward_model=score(), value_model=score(),
                         train_dataset=dataset, eval_dataset=dataset, callbacks=[Clock()])
    accumulate = trainer.accelerator.accumulate

    def first_accumulate_marks_update(*a, **k):
        marks.setdefault("update_start", time.perf_counter())
        return accumulate(*a, **k)

    trainer.accelerator.accumulate = first_accumulate_marks_update
    trainer.train()
    assert len(rows) == iterations, rows
    return rows


def _trl_grpo(paths, tokenizer, texts, s, iterations, common, out):
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from trl_grpo_reference import generation_batches, timed

    marks = {"starts": [], "gen": [], "score_end": [], "steps": []}
    steps = s["rows"] // s["mini"]
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=s["mini"], steps_per_generation=steps,
                      num_iterations=1, gradient_accumulation_steps=1, num_generations=s["generations"],
                      max_completion_length=s["response"], generation_kwargs={"min_new_tokens": s["response"]},
                      temperature=1.0, beta=s["kl"], disable_dropout=True, max_steps=steps * iterations, **common)
    reward = transformers.AutoModelForSequenceClassification.from_pretrained(paths["reward"], num_labels=1,
                                                                             dtype=torch.float32)
    policy = transformers.AutoModelForCausalLM.from_pretrained(paths["policy"], dtype=torch.float32)
    trainer = timed(GRPOTrainer, marks)(model=policy,
                                        reward_funcs=[reward], reward_processing_classes=[tokenizer], args=args,
                                        train_dataset=datasets.Dataset.from_dict({"prompt": texts}),
                                        processing_class=tokenizer)
    trainer.train()
    return generation_batches(marks, trainer.state.global_step, steps)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=("jaxppo", "trl"), default="jaxppo")
    p.add_argument("--tiny", action="store_true", help="2 layers, vocab 1024, 8 rows of 16 + 16 tokens (CPU)")
    p.add_argument("--layouts", default="qwen2.5-0.5b,qwen3-1.7b")
    p.add_argument("--algorithms", default="ppo,grpo")
    p.add_argument("--variants", default=",".join(VARIANTS), help="jaxppo's variants (comma separated)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mini-batch", type=int, default=16)
    p.add_argument("--query", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--budget-s", type=float, default=400.0, help="skip the cases left once this much time passed")
    p.add_argument("--weights", default=os.path.join(tempfile.gettempdir(), "jaxppo-gpu-weights"))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.side == "trl":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the weights are written with JAX; the GPU is torch's
    t0 = time.perf_counter()
    if args.tiny:
        args.batch, args.mini_batch, args.query, args.response, args.iterations = 16, 8, 16, 16, 2
    results = {"side": args.side, "versions": _versions(args.side), "settings": vars(args), "cases": {}}
    print(json.dumps(results["versions"]), flush=True)
    cases = [(layout, algorithm, variant)  # the defaults at every layout first, then each variant
             for variant in (args.variants.split(",") if args.side == "jaxppo" else ["TRL"])
             for layout in args.layouts.split(",") for algorithm in args.algorithms.split(",")]
    for layout, algorithm, variant in cases:
        name = f"{layout} {algorithm} {variant}"
        if time.perf_counter() - t0 > args.budget_s:
            results["cases"][name] = {"skipped": "time budget"}
            continue
        config = layouts.LAYOUTS[layout](layers=2) if args.tiny else layouts.LAYOUTS[layout]()
        if args.tiny:
            config = type(config)(**{**config.__dict__, "vocab_size": 1024})
        try:
            paths = prepare(config, os.path.join(args.weights, layout + ("-tiny" if args.tiny else "")))
            out = jaxppo_case(config, paths, args, algorithm, VARIANTS[variant]) if args.side == "jaxppo" else \
                trl_case(config, paths, args, algorithm)
        except Exception as err:  # recorded; the other cases still run
            traceback.print_exc()
            out = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
        results["cases"][name] = out
        print(name, json.dumps(out), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    _table(results)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


def _versions(side: str) -> dict:
    import platform

    out = {"python": platform.python_version()}
    if side == "jaxppo":
        import jax

        out.update(jax=jax.__version__, device=jax.devices()[0].device_kind, backend=jax.default_backend())
    else:
        import torch
        import transformers
        import trl

        out.update(torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
                   trl=trl.__version__, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    return out


def _table(results: dict) -> None:
    from tables import print_markdown

    rows = []
    for name, out in results["cases"].items():
        if "total_s" in out:
            rows.append([results["side"], name, f'{out["first_iteration_s"]:.1f}', f'{out["total_s"]:.2f}',
                         f'{out["generation_s"]:.2f}', f'{out["scoring_s"]:.2f}', f'{out["update_s"]:.2f}',
                         f'{100 * out["update_mfu"]:.1f}', f'{out["sampler_tokens_per_s"]:.0f}'])
        else:
            rows.append([results["side"], name] + [str(out)[:60]] + [""] * 6)
    print_markdown(["side", "case", "first (s)", "iteration (s)", "sampling (s)", "scoring (s)", "update (s)",
                    "update MFU %", "sampler tokens/s"], rows)


if __name__ == "__main__":
    sys.exit(main())
