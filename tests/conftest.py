import os
import sys

import xla_options  # noqa: F401 - sets XLA_FLAGS (and the test cache) before anything imports jax

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The trackers' tests (tests/test_trackers.py) run wandb offline, its runs under each run
# directory, and trackio on a database of the session's own (trackio reads TRACKIO_DIR
# once, when first imported): nothing leaves the machine or lands in the home directory.
os.environ["WANDB_MODE"] = "offline"
os.environ["WANDB_SILENT"] = "true"
os.environ["TRACKIO_DIR"] = __import__("tempfile").mkdtemp(prefix="jaxppo-tests-trackio-")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (directory, torch model)} of tiny random Hugging Face checkpoints."""
    import hf_models

    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), hf_models.build(name, str(root / name))) for name in hf_models.NAMES}


@pytest.fixture(autouse=True)
def _the_test_process_keeps_its_compilation_cache():
    """`jaxppo.cli.main` points jax's persistent compilation cache at the run's directory;
    tests that call it in-process give no `--compilation-cache`, so it takes the test
    process's own (`JAX_COMPILATION_CACHE_DIR`, a temporary directory: tests/xla_options.py)
    and nothing is written outside the test's files."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    assert jax.config.jax_compilation_cache_dir == before, (
        f"a test moved jax's persistent compilation cache to {jax.config.jax_compilation_cache_dir!r}; call "
        "jaxppo.cli.main in-process without --compilation-cache")


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs_after_each_module():
    """Drop jax's compiled programs after each test module. Each executable XLA:CPU compiles
    holds its own memory mappings; the whole suite in one process compiles enough of them to
    reach the kernel's per-process mapping limit (vm.max_map_count), after which LLVM fails
    with "Cannot allocate memory" and the process aborts."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each holds a few GB of compiled programs
    and test models; the suite's largest files set its length beyond that)."""
    return max(1, min(os.cpu_count() or 1, 4))
