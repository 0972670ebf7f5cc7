"""One process of a 2-process CPU trainer (2 devices each, `jax.distributed`) sampling on
vLLM servers (used by test_vllm_server.py).

argv: process_id, coordinator port, output_dir, iterations, the servers' URLs (comma
separated). Prints one line: RESULT <json>."""

import json
import os
import sys

from xla_options import with_devices  # noqa: E402 - the test process's flags, with 2 devices

os.environ["XLA_FLAGS"] = with_devices(os.environ.get("XLA_FLAGS", ""), 2)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jaxppo.sharding import MeshConfig, initialize_distributed  # noqa: E402
from test_vllm_server import trainer_on  # noqa: E402

pid, port, out, iterations, urls = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
initialize_distributed(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 4 and jax.local_device_count() == 2
trainer = trainer_on(out, urls.split(","), iterations=iterations, mesh=MeshConfig(data=2, fsdp=2))
history = trainer.train()
engine = trainer.parts.rollout_engine
print("RESULT " + json.dumps({
    "process": pid, "pushes": engine.pushes, "versions": [int(v) for v in engine.sample_versions],
    "answered": None if engine.pool is None else engine.pool.answered,
    "history": [{k: v for k, v in h.items() if not k.startswith("time/") and k != "eps"} for h in history]}), flush=True)
