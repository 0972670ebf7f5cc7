"""Two processes x 4 CPU devices through jax.distributed (gloo collectives on loopback):
the trainer's multi-host path trains like one device, checkpoints across processes with
orbax, resumes, and exports once."""

import os

import pytest

from processes import run_two_processes
from trainer_setup import run_small


def _run_two_processes(out, iterations):
    return run_two_processes("multihost_worker.py", out, iterations)


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


def test_work_for_process_zero_alone_reaches_every_process():
    """`on_process_zero`: the function runs on process 0 alone and every process gets its
    value (process 1's own differs, so only a broadcast gives it); its error is raised on
    every process with its type and message (a type outside the built-in errors as a
    RuntimeError elsewhere). `gather_to_process_zero`: a sharded array whole on process 0,
    None on the others."""
    results = run_two_processes("collectives_worker.py")
    expected = [[0, 10, 20], [30, 40, 50]]
    for r in results:
        assert r["shared"] == [expected, 2.5]
        assert r["nothing"] is None
    assert results[0]["ran"] == [0, "again"] and results[1]["ran"] == []
    refused = ["ConnectionError", "http://127.0.0.1:1 refused the connection"]
    assert results[0]["errors"] == [refused, ["KeyError", "'odd'"]]
    assert results[1]["errors"] == [[refused[0], "(on process 0) " + refused[1]], ["RuntimeError", "(on process 0) 'odd'"]]
    full = [[4 * i + j for j in range(4)] for i in range(8)]
    assert results[0]["gathered"] == {"w": full, "local": [1.0, 1.0, 1.0]}
    assert results[1]["gathered"] == {"w": None, "local": None}
