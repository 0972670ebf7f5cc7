"""How the tests compile, set before jax is imported (conftest imports this first); the
processes the tests start inherit it.

- Eight host devices for the sharding tests (single-device code runs on device 0 as before),
  unless XLA_FLAGS already sets a device count.
- XLA:CPU's quick code generation, unless XLA_FLAGS already chooses:
  `--xla_backend_optimization_level=0` (LLVM without its optimisation passes) and
  `--xla_cpu_use_fusion_emitters=false` (XLA's loop emitters instead of its MLIR fusion
  emitters). The tests' programs are tiny, so their time is compiling: the fault tests'
  update compiles in about a quarter of the time (0.6 s instead of 2.5 s) and runs about
  three times slower (14 ms instead of 5 ms). The HLO programs, their fusion and layouts
  are the same; only the machine code differs, so what the tests assert about jaxppo's
  results holds as at the defaults (runs and benchmarks use the defaults). jaxlib 0.11 and
  newer have no fusion-emitter flag (it aborts at start as unknown), so it is set only
  for older jaxlibs (the installed version read from its metadata, before jax loads).
- A persistent compilation cache for this process (a temporary directory, removed at exit;
  `JAX_COMPILATION_CACHE_DIR` set already wins): a module recompiles the programs an
  earlier module compiled (the in-memory caches are cleared after each module, see
  conftest), and those come from disk. Its size limit turns on jax's file lock, so the
  processes a test starts (they inherit it) can share it safely.
"""

import atexit
import os
import shutil
import tempfile
from importlib import metadata


def _jaxlib_minor() -> tuple:
    # (not jaxppo.version.release: importing jaxppo imports jax, before XLA_FLAGS is set)
    return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])


QUICK_CODEGEN = ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_minor() < (0, 11) else ())


def with_devices(flags: str, count: int) -> str:
    """`flags` with the host device count set to `count` (and the tests' code generation
    kept), for a process the tests start."""
    kept = [f for f in flags.split() if "xla_force_host_platform_device_count" not in f]
    return " ".join(kept + ([f"--xla_force_host_platform_device_count={count}"] if count > 1 else []))


_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _flags and "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " " + " ".join(QUICK_CODEGEN)
os.environ["XLA_FLAGS"] = _flags.strip()

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxppo-test-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))  # a limit: jax then locks the directory
