"""One process of a 2-process CPU run of the trainer (used by test_multihost.py).

argv: process_id, coordinator port, output_dir, iterations. Prints one line: RESULT <json>."""

import json
import os
import sys

from xla_options import with_devices  # noqa: E402 - the test process's flags, with 4 devices

os.environ["XLA_FLAGS"] = with_devices(os.environ.get("XLA_FLAGS", ""), 4)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from jaxppo.sharding import MeshConfig, initialize_distributed  # noqa: E402
from trainer_setup import run_small  # noqa: E402

pid, port, out, iterations = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
initialize_distributed(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
assert jax.device_count() == 8 and jax.local_device_count() == 4
history, trainer = run_small(out, iterations=iterations, mesh=MeshConfig(data=2, fsdp=4))
print("RESULT " + json.dumps({"process": pid, "iteration": trainer.iteration,
                               "history": [{k: v for k, v in h.items() if not k.startswith("time/") and k != "eps"}
                                           for h in history]}), flush=True)
