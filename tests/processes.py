"""Helpers for tests that start processes: a free port on localhost, and a worker script
run as the two processes of a `jax.distributed` job on CPU devices."""

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _teardown_abort(returncode, output):
    """jax's coordination service can abort (SIGABRT in grpc's server destructor, called from
    `DistributedRuntimeService::Shutdown` at interpreter exit) after all the work is done; it
    is rare and outside jaxppo. Accepted only when the process had already printed its result,
    and only with that signature; everything the test checks is still checked."""
    return (returncode == -6 and "DistributedRuntimeService::Shutdown" in output
            and any(line.startswith("RESULT ") for line in output.splitlines()))


def run_two_processes(worker: str, *args, timeout: float = 600) -> list:
    """Run tests/`worker` as processes 0 and 1 (argv: process id, the coordinator's port,
    `args`); each must succeed and print one `RESULT <json>` line: the two results."""
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, worker), str(i), port, *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    results = []
    for p in procs:
        output, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0 or _teardown_abort(p.returncode, output), output[-3000:]
        line = [l for l in output.splitlines() if l.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    return results
