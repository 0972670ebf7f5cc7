import os
import sys

# Eight host devices for the sharding tests; set before anything imports jax. Single-device
# code runs on device 0 as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{name: (directory, torch model)} of tiny random Hugging Face checkpoints."""
    import hf_models

    root = tmp_path_factory.mktemp("hf")
    return {name: (str(root / name), hf_models.build(name, str(root / name))) for name in hf_models.NAMES}


@pytest.fixture(autouse=True)
def _no_persistent_compilation_cache_in_the_test_process():
    """`jaxppo.cli.main` turns on jax's persistent compilation cache for its process; tests
    that call it in-process pass `--compilation-cache none`, so the test process never
    writes every later program to a cache on disk (slow, and outside the test's files)."""
    import jax

    before = jax.config.jax_compilation_cache_dir
    yield
    assert jax.config.jax_compilation_cache_dir == before, (
        f"a test left jax's persistent compilation cache on ({jax.config.jax_compilation_cache_dir}); call "
        "jaxppo.cli.main with --compilation-cache none in-process")


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
