"""Reference: TRL's `GRPOTrainer` (PyTorch, CPU) at the shapes of `grpo_iteration.py`, on the
same random GPT-2 weights, tokenizer, prompts and reward, split the same way.

    /path/to/venv/bin/python benchmarks/trl_grpo_reference.py    # needs trl==1.12.0, torch==2.13.0
    ... --vocab 384                                              # one vocabulary

Not a project dependency: it exists so that the README's comparison is measured side by
side on one machine. TRL's settings for the same work: per_device_train_batch_size=16,
steps_per_generation=4, num_iterations=4, gradient_accumulation_steps=1, num_generations=4
(16 prompts x 4 = 64 completions per generation batch, 16 optimizer steps on it),
max_completion_length=32 with min_new_tokens=32 (every completion full), dropout off,
temperature 1. The optimizer steps per generation batch are counted at run time and
checked. At vocab 50257 the byte tokenizer decodes the ids it does not know as its unknown
token in both libraries (jaxppo does so itself; here a subclass does).

Split per generation batch: generation = TRL's `_generate`; scoring = the rest of
`_generate_and_score_completions` (old and reference log-probs, rewards, advantages);
update = the remaining time until the next generation batch starts (16 optimizer steps,
metrics and logging).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

from grpo_iteration import CASES, GENERATIONS, PROMPTS, QUERY, RESPONSE, lowercase, print_table  # noqa: E402


def timed(trainer_class, marks):
    """`trainer_class` (TRL's GRPOTrainer) recording, per generation batch, when it starts
    (`starts`, with the optimizer step then in `steps`), how long `_generate` takes (`gen`)
    and when scoring ends (`score_end`)."""

    class Timed(trainer_class):
        def _generate(self, *a, **k):
            t0 = time.perf_counter()
            out = super()._generate(*a, **k)
            marks["gen"].append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, *a, **k):
            marks["starts"].append(time.perf_counter())
            marks["steps"].append(self.state.global_step)
            out = super()._generate_and_score_completions(*a, **k)
            marks["score_end"].append(time.perf_counter())
            return out

    return Timed


def generation_batches(marks, final_step: int, steps_per_batch: int) -> list:
    """Per generation batch marked by `timed` (the training just ended, at optimizer step
    `final_step`): total, generation, scoring and update seconds; each batch's optimizer
    steps checked to be `steps_per_batch`."""
    starts = marks["starts"] + [time.perf_counter()]
    steps = marks["steps"] + [final_step]
    rows = []
    for i in range(len(marks["starts"])):
        assert steps[i + 1] - steps[i] == steps_per_batch, ("optimizer steps per generation batch", steps)
        total = starts[i + 1] - starts[i]
        scoring = marks["score_end"][i] - starts[i] - marks["gen"][i]
        rows.append(dict(total=total, generation=marks["gen"][i], scoring=scoring,
                         update=total - marks["gen"][i] - scoring))
    return rows


def bench(loss_type, beta, vocab, batches, directory, bf16=False):
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from jaxppo import demo

    class Bytes(type(demo.demo_tokenizer())):
        """The byte tokenizer, decoding ids past its 384 (a 50257-row model samples them) as
        its unknown token, as jaxppo's `decode_responses` does; the stock one raises."""

        def _convert_id_to_token(self, index):
            return self.unk_token if index >= self.offset + 256 else super()._convert_id_to_token(index)

    tokenizer = Bytes()
    tokenizer.padding_side = "left"
    marks = {"starts": [], "gen": [], "score_end": [], "steps": []}
    Timed = timed(GRPOTrainer, marks)

    prompts = [demo.DEMO_PROMPTS[i % len(demo.DEMO_PROMPTS)][:QUERY - 1] for i in range(PROMPTS * (batches + 1))]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    steps_per_batch = 16
    args = GRPOConfig(output_dir=f"{directory}/trl-{loss_type}", per_device_train_batch_size=16,
                      steps_per_generation=4, num_iterations=4, gradient_accumulation_steps=1,
                      num_generations=GENERATIONS, max_completion_length=RESPONSE,
                      generation_kwargs={"min_new_tokens": RESPONSE}, temperature=1.0, beta=beta, loss_type=loss_type,
                      disable_dropout=True, learning_rate=1e-5, max_steps=steps_per_batch * batches, report_to=[],
                      save_strategy="no", disable_tqdm=True, logging_steps=10**9, use_cpu=True, seed=0,
                      # float32 against jaxppo's float32 (or bf16 autocast against its bfloat16 compute, with
                      # --bf16), no activation recomputation on either side
                      bf16=bf16, fp16=False, gradient_checkpointing=False)
    policy = transformers.GPT2LMHeadModel.from_pretrained(f"{directory}/policy")
    trainer = Timed(model=policy, reward_funcs=[lowercase], args=args, train_dataset=dataset,
                    processing_class=tokenizer)
    trainer.train()
    rows = generation_batches(marks, trainer.state.global_step, steps_per_batch)
    later = rows[2:] if len(rows) > 3 else rows[1:]
    med = {k: float(np.median([r[k] for r in later])) for k in ("generation", "scoring", "update")}
    return dict(case=f"{loss_type} / beta {beta}", vocab=vocab, **med, total=sum(med.values()),
                first=rows[0]["total"], length=float(RESPONSE))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=[384, 50257])
    parser.add_argument("--batches", type=int, default=6, help="generation batches per case")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (jaxppo: grpo_iteration.py --bf16)")
    args = parser.parse_args()
    import torch
    import trl

    from jaxppo import demo
    from ppo_iteration import build

    torch.set_num_threads(2)
    rows = []
    for vocab in args.vocab:
        with tempfile.TemporaryDirectory() as d:
            build(d, 2, 128, vocab, QUERY + RESPONSE + 8, demo.demo_tokenizer())
            rows += [bench(a, b, vocab, args.batches, d, args.bf16) for a, b in CASES]
    print_table(f"TRL {trl.__version__} GRPOTrainer, torch {torch.__version__}, {torch.get_num_threads()} threads, "
                f"{'bf16 autocast' if args.bf16 else 'float32'}, "
                f"GPT-2 layout 2x128, {PROMPTS} prompts x {GENERATIONS} generations x {RESPONSE} tokens, "
                "16 optimizer steps per generation batch", rows, "first batch")


if __name__ == "__main__":
    main()
