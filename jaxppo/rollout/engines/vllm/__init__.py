"""vLLM's rollout engines (the `vllm` extra; nothing here imports vLLM until an engine is
built):

- `inprocess`: `VLLMEngine` ("vllm"), vLLM in this process, its weights loaded in memory;
- `server`: `VLLMServerEngine` ("vllm-server"), running vLLM servers, and `jaxppo serve`;
- `pool`: the servers' pool (requests spread over them; a failing server dropped);
- `plugin`: the weight-transfer backend vLLM loads in its own processes;
- `nccl`: weights broadcast between GPUs (untested)."""
