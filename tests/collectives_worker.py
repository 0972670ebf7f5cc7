"""One process of a 2-process CPU run (2 devices each) of `jaxppo.sharding`'s helpers for
work only process 0 does (used by test_multihost.py).

argv: process_id, coordinator port. Prints one line: RESULT <json>."""

import json
import os
import sys

from xla_options import with_devices  # noqa: E402 - the test process's flags, with 2 devices

os.environ["XLA_FLAGS"] = with_devices(os.environ.get("XLA_FLAGS", ""), 2)

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxppo.sharding import (MeshConfig, gather_to_process_zero, initialize_distributed, make_mesh,  # noqa: E402
                             on_process_zero)

pid, port = int(sys.argv[1]), sys.argv[2]
initialize_distributed(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
result = {"process": pid}
ran = []


def work():  # what only process 0 may do; its value differs by process, so a broadcast shows
    ran.append(pid)
    return np.arange(6, dtype=np.int32).reshape(2, 3) * (10 + pid), np.float32(2.5 + pid)


shared = on_process_zero(work, (np.zeros((2, 3), np.int32), np.zeros((), np.float32)))
result["shared"] = [shared[0].tolist(), float(shared[1])]
result["ran"] = ran
result["nothing"] = on_process_zero(lambda: ran.append("again"))
for error in (ConnectionError("http://127.0.0.1:1 refused the connection"), KeyError("odd")):
    def fail(error=error):
        raise error
    try:
        on_process_zero(fail, np.zeros((1,), np.int32))
    except Exception as exc:  # noqa: BLE001 - what each process raises is the result
        result.setdefault("errors", []).append([type(exc).__name__, str(exc)])

mesh = make_mesh(MeshConfig(data=1, fsdp=4))
full = np.arange(32, dtype=np.float32).reshape(8, 4)
tree = {"w": jax.make_array_from_callback(full.shape, NamedSharding(mesh, P("fsdp")), lambda i: full[i]),
        "local": np.ones(3, np.float32)}
gathered = gather_to_process_zero(tree)
result["gathered"] = {k: None if v is None else np.asarray(v).tolist() for k, v in gathered.items()}
print("RESULT " + json.dumps(result), flush=True)
