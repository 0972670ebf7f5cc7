"""Profile: where `train_step`'s time goes at a real model's shape, op by op.

    jaxppo-fixture                               # once: SmolLM2-135M-Instruct
    python benchmarks/profile_update.py          # both layer layouts, each group's prompt once
    python benchmarks/profile_update.py --every-row --layouts unrolled

The update of `benchmarks/update_efficiency.py` (GRPO, 32 rows = 4 prompts x 8, 48-token
prompts, 24-token responses, one epoch of 2 mini-batches, float32) is compiled, run once,
then run once under `jax.profiler.trace`. Every XLA operation the trace records on the CPU
client's threads is matched to its instruction in the compiled HLO and put in a class:

- phase, from the instruction's JAX name stack: "forward" (inside `jvp`), "backward"
  (inside `transpose`), "optimizer and rest" (everything else: the optimizer's update,
  gradient clipping, the loop's bookkeeping);
- kind: "matmul" (a fusion or op containing a dot), "copy/transpose" (copies and
  transposes XLA inserts around them), "vocabulary-wide" (elementwise work or reductions
  over a (..., V) array: the log-softmax, the entropy), "other".

The table gives each class's seconds (summed over the threads that ran it, so the total
can exceed the wall time on several cores) and share; then the largest operations that are
not matmuls, with their shapes.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import tempfile
import time

import jax
import optax

import jaxppo
import jaxppo.models as jm
from jaxppo.models.fixtures import fixture_dir, is_prepared

from shared_prompts import make_rollout
from tables import print_markdown

CONTAINERS = ("while", "conditional", "call")


def instructions(hlo: str) -> dict:
    """{instruction name: (opcode, shape, JAX op_name, called computation's text)} from the
    compiled HLO text."""
    bodies, current = {}, None
    for line in hlo.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    out = {}
    for lines in bodies.values():
        for line in lines:
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
            if not m:
                continue
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            op_name = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = (m.group(3), m.group(2), op_name.group(1) if op_name else "",
                               "\n".join(bodies.get(calls.group(1), [])) if calls else "")
    return out


def classify(info, vocab: int):
    """(phase, kind) of one instruction, or None for a container (while, cond, call)."""
    opcode, shape, op_name, body = info
    if opcode in CONTAINERS:
        return None
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "optimizer and rest"
    if opcode in ("dot", "convolution") or " dot(" in body or " convolution(" in body:
        kind = "matmul"
    elif opcode in ("copy", "transpose") or "copy" in body.split("(")[0] or " transpose(" in body or (
            opcode == "fusion" and re.search(r"= \S+ copy\(", body)):
        kind = "copy/transpose"
    elif re.search(rf"[\[,]{vocab}[\],]", shape) or re.search(rf"\[[\d,]*{vocab}\]", body):
        kind = "vocabulary-wide"
    else:
        kind = "other"
    return phase, kind


def profile(compiled, args, vocab: int):
    """Seconds per (phase, kind) and per non-matmul instruction, from one traced run."""
    info = instructions(compiled.as_text())
    jax.block_until_ready(compiled(*args)[0].params)  # warm
    directory = tempfile.mkdtemp()
    with jax.profiler.trace(directory):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args)[0].params)
        wall = time.perf_counter() - start
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)[0])
    classes, ops = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:  # the CPU client's and Eigen's threads
                continue
            for event in line.events:
                if event.name in info and (c := classify(info[event.name], vocab)) is not None:
                    classes[c] += event.duration_ns / 1e9
                    if c[1] != "matmul":
                        ops[event.name] += event.duration_ns / 1e9
    return wall, classes, ops, info


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--layouts", nargs="+", default=["unrolled", "scanned"], choices=["unrolled", "scanned"])
    parser.add_argument("--every-row", action="store_true", help="run every row (no shared prompts)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    path = args.model or fixture_dir()
    if args.model is None and not is_prepared(path):
        raise SystemExit(f"no prepared model in {path}: run `jaxppo-fixture` first, or pass --model DIR")
    prompts, g, q, r = 4, 8, 48, 24
    config = jaxppo.Config.for_algorithm("grpo", batch_size=prompts * g, mini_batch_size=16, ppo_epochs=1,
                                            num_generations=g, kl_loss_coef=0.0, share_prompts=not args.every_row)
    for layout in args.layouts:
        model, params = jm.from_pretrained(path, scan_layers=layout == "scanned")
        vocab = model.config.vocab_size
        rollout = make_rollout(prompts, g, q, r, vocab)
        state = jaxppo.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-6))
        key = jax.random.key(0)
        compiled = jaxppo.train_step.lower(state, rollout, key, config).compile()
        wall, classes, ops, info = profile(compiled, (state, rollout, key), vocab)
        total = sum(classes.values())
        print(f"\n## {layout} layers, {'every row' if args.every_row else 'each prompt once'}: one train_step "
              f"{wall:.2f} s wall, {total:.2f} s of operations summed over threads\n")
        rows = [[phase, kind, f"{seconds:.3f}", f"{seconds / total:.1%}"]
                for (phase, kind), seconds in sorted(classes.items(), key=lambda kv: -kv[1])]
        print_markdown(["phase", "kind", "seconds", "share"], rows)
        print("\nlargest operations that are not matmuls:\n")
        top = [[name, info[name][1][:40], "/".join(classify(info[name], vocab)), f"{seconds:.3f}",
                info[name][2].split("/")[-1][:40]] for name, seconds in ops.most_common(args.top)]
        print_markdown(["operation", "shape", "class", "seconds", "JAX op"], top)


if __name__ == "__main__":
    main()
