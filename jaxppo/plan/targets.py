"""The accelerators a run can be planned for, without having one: a small table of known
targets (NVIDIA H100 and H200 SXM, one or eight; TPU v5e, v5p and v6e slices), a target of
one's own from a TOML or JSON file, and the compiler's device-less devices of a target
(`jax.experimental.topologies`: a TPU topology from the `libtpu` wheel, an NVIDIA GPU from
a target description given to the CUDA plugin).

    target = resolve_target("h200x8")          # or "v5e-16", or "my_target.toml"
    devices = target_devices(target)           # 8 device-less "NVIDIA H200" devices

What a target holds besides its topology is what the plan's arithmetic needs: the memory per
chip a program may use, the chip's peak dense bf16 rate and its memory bandwidth (the
vendors' published figures).
"""

from __future__ import annotations

import dataclasses
import json
import os
__all__ = ["Target", "TARGETS", "resolve_target", "target_devices", "gpu_target_description", "MissingExtra",
           "GPU_MEMORY_FRACTION", "compiler_installed"]

GIB = 2 ** 30

# JAX preallocates this share of a GPU's memory for its buffers by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION); a GPU program must fit in it.
GPU_MEMORY_FRACTION = 0.75


class MissingExtra(RuntimeError):
    """The compiler for a target is not installed (the optional extra that brings it)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator slice.

    Attributes:
      name: how it is asked for (`--target NAME`).
      platform: "cuda" (NVIDIA) or "tpu".
      chips: how many accelerators (GPUs, TPU chips) the slice has.
      topology: the TPU topology name ("v5e:2x4"), or for GPUs the device-less topology's
        "1x1xN" (N GPUs on one host).
      memory_bytes: the memory of one chip (HBM).
      usable_fraction: the share of it a program's buffers may take (GPUs: JAX's default
        preallocation, `GPU_MEMORY_FRACTION`; TPUs: all of it).
      peak_flops: the chip's peak dense bf16 matrix rate, FLOP/s.
      bandwidth: the chip's memory bandwidth, bytes/s.
      device_kind: what the compiler's devices call the chip (checked against the topology).
      sm_count, clock_ghz, l2_bytes: for a GPU, the rest of its target description (what
        XLA:GPU's cost model and fusion heuristics read).
    """

    name: str
    platform: str
    chips: int
    topology: str
    memory_bytes: int
    peak_flops: float
    bandwidth: float
    usable_fraction: float = 1.0
    device_kind: str = ""
    sm_count: int = 0
    clock_ghz: float = 0.0
    l2_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        return int(self.memory_bytes * self.usable_fraction)

    def describe(self) -> str:
        what = "GPU" if self.platform == "cuda" else "chip"
        return (f"{self.name}: {self.chips} x {self.device_kind or self.platform} ({self.memory_bytes / GIB:.1f} GiB per "
                f"{what}, {self.usable_fraction:.0%} usable; {self.peak_flops / 1e12:.0f} TFLOP/s bf16, "
                f"{self.bandwidth / 1e12:.2f} TB/s)")


def _gpu(name, chips, kind, memory, bandwidth, flops=989e12):
    # Hopper SXM: 132 SMs at up to 1.98 GHz, a 50 MiB L2 (NVIDIA's H100/H200 data sheets).
    return Target(name, "cuda", chips, f"1x1x{chips}", memory, flops, bandwidth, GPU_MEMORY_FRACTION, kind,
                  sm_count=132, clock_ghz=1.98, l2_bytes=50 * 2 ** 20)


def _tpu(name, generation, shape, chips, kind, memory_gib, tflops, bandwidth_gbs):
    return Target(name, "tpu", chips, f"{generation}:{shape}", memory_gib * GIB, tflops * 1e12, bandwidth_gbs * 1e9,
                  1.0, kind)


# The H100's 80 GB are 84,978,434,048 bytes as the driver reports them; the H200's 141 GB
# 150,754,820,096. TPU names count chips for v5e and v6e, TensorCores for v5p (v5p-8: 4 chips).
TARGETS = {t.name: t for t in [
    _gpu("h100", 1, "NVIDIA H100 80GB HBM3", 84978434048, 3.35e12),
    _gpu("h100x8", 8, "NVIDIA H100 80GB HBM3", 84978434048, 3.35e12),
    _gpu("h200", 1, "NVIDIA H200", 150754820096, 4.8e12),
    _gpu("h200x8", 8, "NVIDIA H200", 150754820096, 4.8e12),
    _tpu("v5e-4", "v5e", "2x2", 4, "TPU v5 lite", 16, 197, 819),
    _tpu("v5e-8", "v5e", "2x4", 8, "TPU v5 lite", 16, 197, 819),
    _tpu("v5e-16", "v5e", "4x4", 16, "TPU v5 lite", 16, 197, 819),
    _tpu("v5p-8", "v5p", "2x2x1", 4, "TPU v5", 95, 459, 2765),
    _tpu("v5p-16", "v5p", "2x2x2", 8, "TPU v5", 95, 459, 2765),
    _tpu("v6e-8", "v6e", "2x4", 8, "TPU v6 lite", 32, 918, 1640),
    _tpu("v6e-16", "v6e", "4x4", 16, "TPU v6 lite", 32, 918, 1640),
]}
_ALIASES = {"h100x1": "h100", "h200x1": "h200"}

_FILE_KEYS = {"name", "platform", "chips", "topology", "memory_gib", "peak_tflops", "bandwidth_gbs", "usable_fraction",
              "device_kind", "sm_count", "clock_ghz", "l2_mib"}


def resolve_target(text: str) -> Target:
    """The target `text` names: a known one (`TARGETS`; "h200x1" is "h200"), or a TOML or
    JSON file describing one (keys: platform "cuda" or "tpu", chips, memory_gib,
    peak_tflops, bandwidth_gbs; a TPU's topology such as "v5e:2x4"; optional name,
    usable_fraction, device_kind, and for a GPU sm_count, clock_ghz, l2_mib). A `ValueError`
    naming what would be valid otherwise."""
    key = str(text).strip().lower()
    key = _ALIASES.get(key, key)
    if key in TARGETS:
        return TARGETS[key]
    if os.path.isfile(text):
        return _target_from_file(text)
    raise ValueError(f"--target {text!r} is not a known target ({', '.join(TARGETS)}) nor a target file (.toml or "
                     ".json with platform, chips, memory_gib, peak_tflops, bandwidth_gbs and, for a TPU, topology)")


def _target_from_file(path: str) -> Target:
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".json"):
            d = json.loads(raw)
        else:
            import tomllib

            d = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"target file {path!r} does not parse ({err}); give TOML, or JSON ending in .json") from None
    if not isinstance(d, dict):
        raise ValueError(f"target file {path!r} must hold one table of keys, got {type(d).__name__}")
    unknown = sorted(set(d) - _FILE_KEYS)
    missing = sorted({"platform", "chips", "memory_gib", "peak_tflops", "bandwidth_gbs"} - set(d))
    if unknown or missing:
        raise ValueError(f"target file {path!r}: " + "; ".join(
            ([f"unknown keys {unknown}"] if unknown else []) + ([f"missing keys {missing}"] if missing else []))
            + f" (valid keys: {', '.join(sorted(_FILE_KEYS))})")
    platform, chips = d["platform"], d["chips"]
    if platform not in ("cuda", "tpu"):
        raise ValueError(f"target file {path!r}: platform={platform!r} is invalid: 'cuda' (NVIDIA GPUs) or 'tpu'")
    if not isinstance(chips, int) or isinstance(chips, bool) or chips < 1:
        raise ValueError(f"target file {path!r}: chips={chips!r} is invalid: a positive int")
    if platform == "tpu" and not isinstance(d.get("topology"), str):
        raise ValueError(f"target file {path!r}: a TPU target needs topology, a name such as 'v5e:2x4'")
    for k in ("memory_gib", "peak_tflops", "bandwidth_gbs"):
        if not isinstance(d[k], (int, float)) or isinstance(d[k], bool) or d[k] <= 0:
            raise ValueError(f"target file {path!r}: {k}={d[k]!r} is invalid: a positive number")
    fraction = d.get("usable_fraction", GPU_MEMORY_FRACTION if platform == "cuda" else 1.0)
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"target file {path!r}: usable_fraction={fraction!r} is invalid: a number in (0, 1]")
    topology = d.get("topology") if platform == "tpu" else f"1x1x{chips}"
    return Target(d.get("name", os.path.basename(path)), platform, chips, topology, int(d["memory_gib"] * GIB),
                  float(d["peak_tflops"]) * 1e12, float(d["bandwidth_gbs"]) * 1e9, float(fraction),
                  d.get("device_kind", ""), int(d.get("sm_count", 132)), float(d.get("clock_ghz", 1.98)),
                  int(d.get("l2_mib", 50) * 2 ** 20))


def gpu_target_description(target: Target) -> str:
    """XLA's GPU target description (a `GpuTargetConfig` in protobuf text) of a Hopper-class
    `target`: what the CUDA plugin compiles for when there is no GPU to ask."""
    if target.platform != "cuda":
        raise ValueError(f"{target.name} is not a GPU target")
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=49152,
                shared_memory_per_core=233472, threads_per_core_limit=2048, core_count=target.sm_count,
                fpus_per_core=128, block_dim_limit_x=2 ** 31 - 1, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=int(target.bandwidth), l2_cache_size=target.l2_bytes,
                clock_rate_ghz=target.clock_ghz, device_memory_size=target.memory_bytes,
                shared_memory_per_block_optin=232448)
    lines = [f"  {k}: {v}" for k, v in info.items()]
    lines += ["  cuda_compute_capability { major: 9 }", "  registers_per_core_limit: 65536",
              "  registers_per_block_limit: 65536"]
    return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\nplatform_name: \"CUDA\"\n"
            f"device_description_str: \"{target.device_kind or 'NVIDIA GPU'}\"\n")


_EXTRA = {"cuda": ("plan-gpu", "the CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt) and ptxas (nvidia-cuda-nvcc-cu12)"),
          "tpu": ("plan-tpu", "libtpu")}


def target_devices(target: Target) -> list:
    """The compiler's device-less devices of `target` (`jax.experimental.topologies`), in
    the topology's order. `MissingExtra` (naming the extra to install) when the target's
    compiler is not installed."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to check against
    # Compiling opens no chip: libtpu's one-process lock (held by any other process that loaded
    # it, such as a second plan) is not needed.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    extra, what = _EXTRA[target.platform]
    if not compiler_installed(target.platform):
        raise MissingExtra(f"planning for {target.name} compiles with {what}, which is not installed: "
                           f"pip install 'jaxppo[{extra}]'")
    try:
        if target.platform == "tpu":
            topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
        else:
            topology = topologies.get_topology_desc(platform="cuda", topology=target.topology,
                                                    target_config=gpu_target_description(target))
    except Exception as err:  # the plugin's own error: a topology it does not know, a broken install
        raise ValueError(f"the compiler refused target {target.name} (topology {target.topology!r}): "
                         f"{str(err).splitlines()[0][:300]}") from None
    devices = list(topology.devices)
    if len(devices) != target.chips:
        raise ValueError(f"target {target.name}: topology {target.topology!r} has {len(devices)} devices, the target "
                         f"says {target.chips} chips; make them agree")
    return devices


def compiler_installed(platform: str) -> bool:
    """Whether the distributions the compiler of `platform` ("cuda" or "tpu") needs are installed."""
    import importlib.metadata

    names = ("libtpu",) if platform == "tpu" else ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12")
    try:
        for name in names:
            importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
