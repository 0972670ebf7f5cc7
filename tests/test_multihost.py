"""Two processes x 4 CPU devices through jax.distributed (gloo collectives on loopback):
the trainer's multi-host path trains like one device, checkpoints across processes with
orbax, resumes, and exports once."""

import json
import os
import socket
import subprocess
import sys

import pytest

from trainer_setup import run_small

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port():
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


def _run_two_processes(out, iterations):
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), port, str(out),
                               str(iterations)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for i in range(2)]
    results = []
    for p in procs:
        output, _ = p.communicate(timeout=600)
        assert p.returncode == 0 or _teardown_abort(p.returncode, output), output[-3000:]
        line = [l for l in output.splitlines() if l.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    return results


@pytest.mark.slow
def test_two_process_trainer_matches_single_device_and_resumes(tmp_path):
    single, _ = run_small(tmp_path / "single", iterations=3)
    first = _run_two_processes(tmp_path / "multi", iterations=2)
    assert [r["iteration"] for r in first] == [2, 2]
    assert first[0]["history"] == first[1]["history"]  # every process sees the same metrics
    for a, b in zip(single[:2], first[0]["history"]):
        assert a["objective/scores"] == b["objective/scores"]
        assert a["ppo/updates_applied"] == b["ppo/updates_applied"] == 4
        assert a["loss/total_avg"] == pytest.approx(b["loss/total_avg"], rel=1e-4, abs=1e-6)
    assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["1", "2"]
    assert os.path.isfile(tmp_path / "multi" / "final_policy" / "model.safetensors")
    # Both processes restore the sharded checkpoint and continue to iteration 3.
    second = _run_two_processes(tmp_path / "multi", iterations=3)
    assert [r["iteration"] for r in second] == [3, 3]
    assert len(second[0]["history"]) == 3
    b = second[0]["history"][2]
    assert b["objective/scores"] == single[2]["objective/scores"]
    assert b["loss/total_avg"] == pytest.approx(single[2]["loss/total_avg"], rel=1e-4, abs=1e-6)
