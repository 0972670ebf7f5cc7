"""jaxppo's vLLM plugin: the weight-transfer backend "jaxppo-files", loaded inside vLLM's
own processes (its API server, engine core and workers) through vLLM's plugin entry point
(`vllm.general_plugins`, declared in jaxppo's package metadata). Nothing here runs in the
trainer's process, and nothing in it imports JAX.

vLLM (0.32) takes new weights through its weight-transfer engines: the trainer calls the
server's `/start_weight_update`, then `/update_weights` with a payload the backend reads,
then `/finish_weight_update` with a version label that vLLM attaches to every token sampled
afterwards. Its own backends move CUDA tensors (NCCL, CUDA IPC); "jaxppo-files" moves a
safetensors file: the trainer writes the policy's tensors under their Hugging Face names to
a directory the server can read (on one host a tmpfs such as /dev/shm, which is shared
memory; across hosts a shared filesystem), the payload names the file, and each worker
loads it through the model's own weight loaders inside vLLM's layerwise reload (the way
its NCCL backend loads checkpoint-format weights). It works on CPUs and GPUs alike.

A server takes the backend with `--weight-transfer-config '{"backend": "jaxppo-files"}'`
(`jaxppo serve` passes it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

BACKEND = "jaxppo-files"

__all__ = ["BACKEND", "register"]


def register() -> None:
    """vLLM's entry point: register the backend (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "FilesWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass


try:
    from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                       WeightTransferUpdateInfo)
except ImportError:  # imported where vLLM is absent (the docs): the names above stay defined
    WeightTransferEngine = WeightTransferInitInfo = WeightTransferUpdateInfo = None

if WeightTransferEngine is not None:

    @dataclass
    class FilesInitInfo(WeightTransferInitInfo):
        """The directory the trainer writes its weight files to."""

        directory: str

    @dataclass
    class FilesUpdateInfo(WeightTransferUpdateInfo):
        """One weight file (safetensors, Hugging Face names), relative to the directory."""

        file: str

    class FilesWeightTransferEngine(WeightTransferEngine[FilesInitInfo, FilesUpdateInfo]):
        """Loads the trainer's weight files into the worker's model (vLLM's layerwise
        reload around the model's `load_weights`)."""

        init_info_cls = FilesInitInfo
        update_info_cls = FilesUpdateInfo
        supports_draft_weight_update = False

        directory = None

        def init_transfer_engine(self, init_info: FilesInitInfo) -> None:
            if not os.path.isdir(init_info.directory):
                raise ValueError(f"jaxppo-files: the weight directory {init_info.directory!r} does not exist on "
                                 "this server's host (across hosts it must be a shared filesystem)")
            self.directory = init_info.directory

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info: FilesUpdateInfo) -> None:
            from safetensors import safe_open

            if self.directory is None:
                raise RuntimeError("jaxppo-files: /update_weights before /init_weight_transfer_engine")
            path = os.path.join(self.directory, os.path.basename(update_info.file))
            with safe_open(path, framework="pt", device="cpu") as f:
                self.model.load_weights((name, f.get_tensor(name)) for name in f.keys())

        def shutdown(self) -> None:
            self.directory = None
