"""The NCCL weight transport of `rollout_engine="vllm-server"` (`weight_sync="nccl"`): the
policy's weights broadcast from the trainer's GPU into each server's GPUs, the way vLLM's
RLHF examples do it, without going through files.

UNTESTED: written against vLLM 0.32's trainer-side NCCL engine
(`vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine`) and its
HTTP client, but never run: it needs NVIDIA GPUs, and no GPU was lent while it was built.
The file transport ("files") is the tested one, on CPUs and GPUs.

How it works: per server, one NCCL group of the trainer (rank 0) and the server's workers
(ranks 1..), opened once through the server's `/init_weight_transfer_engine` (the server
started with `--weight-transfer-config '{"backend": "nccl"}'`, `jaxppo serve
--weight-sync nccl`); each push hands the trainer's arrays to torch on the GPU through
DLPack (Hugging Face names and layouts, LoRA merged, scanned layers unstacked) and vLLM's
engine broadcasts them while the server receives, then the version label is set and the
prefix cache reset. The trainer's process needs vLLM and a CUDA build of torch beside JAX,
and must be reachable from the servers at `JAXPPO_WEIGHT_SYNC_ADDRESS` (default: this
host's address) on a free port per server.
"""

from __future__ import annotations

import os
import socket

__all__ = ["NCCLTransport"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class NCCLTransport:
    """Full weights by NCCL broadcast into each server (see the module's docstring)."""

    name = "nccl"

    def __init__(self, model):
        self.model, self.engines = model, {}
        self.address = os.environ.get("JAXPPO_WEIGHT_SYNC_ADDRESS") or socket.gethostbyname(socket.gethostname())

    def _source(self, params):
        """vLLM's `WeightSource` over the policy's tensors, on the GPU through DLPack."""
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        from jaxppo.rollout.engines.vllm.inprocess import hf_weights

        tensors = [(name, tensor.contiguous()) for name, tensor in hf_weights(self.model, params)]

        class Source(WeightSource):
            def metadata(self):
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in tensors]

            def __iter__(self):
                return iter(tensors)

        return Source()

    def rejoin(self, urls) -> None:
        """Servers back after a failure: a new NCCL group with each."""
        for url in urls:
            self.engines.pop(url, None)

    def push(self, pool, params, version: int) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.nccl_engine import (NCCLTrainerInitInfo,
                                                                  NCCLTrainerWeightTransferEngine)

        source = self._source(params)

        def send(server):
            engine = self.engines.get(server.url)
            if engine is None:
                workers = int(server.call("/get_world_size")["world_size"])
                info = NCCLTrainerInitInfo(rank=0, master_address=self.address, master_port=_free_port(),
                                           world_size=1 + workers)
                client = HTTPVLLMWeightSyncClient(server.url, timeout=server.timeout)
                engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)
                self.engines[server.url] = engine
            engine.source = source
            engine.send_weights()
            server.call("/update_weight_version", {"new_version": str(version)})
            server.call("/reset_prefix_cache", {})

        pool.each(send)

    def request_fields(self, version: int) -> dict:
        return {}

    def expected_label(self, version: int) -> str:
        return str(version)
