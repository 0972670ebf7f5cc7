"""How completions are sampled (`SamplingConfig`: temperature, filters, stops, the response
budget, the rollout engine and how far sampling may run ahead of the update) and how
multi-turn episodes run (`EnvironmentConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

from jaxppo.config.fields import Concern, check_bools, check_counts, check_real, setting
from jaxppo.rollout.engines import check_engine_name, takes_server_urls
from jaxppo.rollout.spec import OLD_LOGPROBS
from jaxppo.update.checks import invalid, is_int

__all__ = ["SamplingConfig", "EnvironmentConfig", "EOS", "INFLIGHT_UPDATES"]

EOS = "eos"  # in `stop_tokens`: the tokenizer's end-of-sequence token
INFLIGHT_UPDATES = (None, "keep", "recompute")


@dataclasses.dataclass(frozen=True)
class SamplingConfig(Concern):
    """How the policy's completions are sampled: the behaviour policy (temperature and the
    filters, in vLLM's order; the sampler's log-probs are of the result), where a completion
    stops, its budget, the rollout engine, and how far sampling may run ahead of the update.

    Attributes:
      temperature: logits are divided by it before sampling, and by the same in the loss's
        log-probs; > 0.
      top_k: None or 0 (off), or the most likely tokens kept.
      top_p: nucleus sampling's mass, in (0, 1]; 1.0 off.
      min_p: None or 0 (off), or in (0, 1): tokens below min_p times the top probability
        dropped.
      repetition_penalty: > 0; 1.0 off, above 1 discourages repeats.
      response_length: the response budget in tokens (completions are padded to it).
      stop_tokens: where a completion stops: token ids, and "eos" for the tokenizer's
        end-of-sequence token (the default, ("eos",)); () stops only at the budget.
      stop_strings: a completion ends at the token completing one of these texts
        (`jaxppo.models.stops`).
      rollout_engine: "jaxppo" (the built-in engines: the static sampler, or the continuous
        one with `num_slots`), "vllm" (vLLM in this process, `jaxppo.rollout.engines.vllm.inprocess`),
        "vllm-server" (running vLLM servers, `vllm_urls`; `jaxppo.rollout.engines.vllm.server`), or a
        name registered with `jaxppo.rollout.engines.register_rollout_engine`.
      vllm_urls: with rollout_engine "vllm-server", the servers' base URLs
        ("http://host:port"; `jaxppo serve` starts one); requests are spread over them.
      vllm_timeout: seconds one request to a vLLM server may take before the server is
        dropped from the run and its requests go to the others; > 0.
      weight_sync: how the trainer's weights reach vLLM servers: "files" (a safetensors file
        per version in `weight_sync_dir`; CPUs and GPUs) or "nccl" (broadcast from the
        trainer's GPU into the servers', untested: see `jaxppo.rollout.engines.vllm.nccl`). With
        LoRA the adapter alone goes by file either way.
      weight_sync_dir: where the trainer writes the weights it pushes to vLLM servers (a
        directory they read: on one host None, a temporary directory in /dev/shm; across
        hosts a shared filesystem).
      num_slots: None (the static sampler: every row decoded together until the last ends)
        or the slots of the continuous sampler (a finished row's slot refilled at once); the
        same tokens either way.
      old_logprobs: where the rollout's old-policy log-probs come from: "sampler" (the
        sampler's own: no policy forward when scoring), "recompute" (a forward of the
        policy over the sampled batch) or "auto" ("sampler" with an engine whose log-probs
        are the trainer's own, a float32 policy without experts and max_staleness 0, else
        "recompute": a mixture of experts' forward pass records its routing).
      max_staleness: k; 0 (default) samples each iteration from the parameters it trains;
        k >= 1 samples iteration i from the parameters after max(0, i - k) iterations in
        producer threads, overlapping the update (`jaxppo.run.pipeline`); the loss then
        corrects for the stale sampler (`LossConfig.rollout_correction`).
      inflight_updates: None, "keep" or "recompute": with the continuous sampler and
        max_staleness >= 1, a long generation takes the newest parameters between decode
        steps (every `inflight_steps` steps); a row's KV cache is kept or computed again.
        Tokens then depend on timing: such a run is not repeated exactly on resume.
      inflight_steps: decode steps between looks for new parameters; a positive int.
    """

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: Optional[float] = None
    repetition_penalty: float = 1.0
    response_length: int = 32
    stop_tokens: Tuple[Union[int, str], ...] = (EOS,)
    stop_strings: Tuple[str, ...] = ()
    rollout_engine: str = "jaxppo"
    vllm_urls: Tuple[str, ...] = setting((), free=True)
    vllm_timeout: float = setting(300.0, free=True)
    weight_sync: str = setting("files", free=True)
    weight_sync_dir: Optional[str] = setting(None, free=True)
    num_slots: Optional[int] = setting(None, free=True)
    old_logprobs: str = setting("auto", free=True)
    max_staleness: int = 0
    inflight_updates: Optional[str] = setting(None, free=True)
    inflight_steps: int = setting(8, free=True)

    def __post_init__(self):
        check_real(self, "temperature", 0.0, low_open=True)
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
            raise invalid("SamplingConfig", "top_k", self.top_k, "None or 0 (off), or a positive int (the most "
                          "likely tokens kept)")
        check_real(self, "top_p", 0.0, 1.0, low_open=True, note=" (1.0: off)")
        if self.min_p is not None:
            check_real(self, "min_p", 0.0, 1.0, high_open=True, note=" (None or 0: off)")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 < r < math.inf:
            raise invalid("SamplingConfig", "repetition_penalty", r,
                          "a finite number > 0 (1.0: off; above 1 discourages repeats)")
        check_counts(self, ("response_length",))
        _check_stops(self)
        check_engine_name(self.rollout_engine, "SamplingConfig.rollout_engine")
        _check_servers(self)
        if self.num_slots is not None:
            check_counts(self, ("num_slots",))
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"SamplingConfig.old_logprobs={self.old_logprobs!r} is invalid; valid: 'auto' (the "
                             "sampler's with the built-in engine and a float32 policy, else recomputed), 'sampler' "
                             "(the sampler's own log-probs), 'recompute' (a forward of the policy)")
        check_counts(self, ("max_staleness",), least=0)
        if self.inflight_updates not in INFLIGHT_UPDATES:
            raise ValueError(f"SamplingConfig.inflight_updates={self.inflight_updates!r} is invalid; valid: None (each "
                             "iteration sampled from one version), 'keep' or 'recompute' (what happens to a row's KV "
                             "cache when new parameters arrive)")
        check_counts(self, ("inflight_steps",))

    @property
    def filters(self) -> dict:
        """{name: value} of the sampling filters and the penalty that are on."""
        from jaxppo.models.sampling import sampling_filters_on

        return sampling_filters_on(self)


def _check_stops(c: SamplingConfig):
    """The stops (a list given for a tuple becomes the tuple; one value a tuple of one)."""
    for name in ("stop_tokens", "stop_strings"):
        value = getattr(c, name)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise invalid("SamplingConfig", name, value, "a list of token ids >= 0 and 'eos'" if name == "stop_tokens"
                          else "a list of non-empty strings")
        object.__setattr__(c, name, tuple(value))
    if not all((is_int(t) and t >= 0) or t == EOS for t in c.stop_tokens):
        raise invalid("SamplingConfig", "stop_tokens", c.stop_tokens,
                      "a list of token ids >= 0, and 'eos' for the tokenizer's end-of-sequence token")
    if not all(isinstance(s, str) and s for s in c.stop_strings):
        raise invalid("SamplingConfig", "stop_strings", c.stop_strings,
                      "a list of non-empty strings (the completion ends where its text first holds one)")


def _check_servers(c: SamplingConfig):
    """The vLLM servers' settings (a URL given for a tuple becomes a tuple of one)."""
    urls = (c.vllm_urls,) if isinstance(c.vllm_urls, str) else c.vllm_urls
    if not isinstance(urls, (list, tuple)) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                                       and len(u) > len("http://") for u in urls):
        raise invalid("SamplingConfig", "vllm_urls", c.vllm_urls, "a list of base URLs, each 'http://host:port'")
    if len(set(urls)) != len(urls):
        raise invalid("SamplingConfig", "vllm_urls", c.vllm_urls, "distinct URLs (a server listed twice)")
    object.__setattr__(c, "vllm_urls", tuple(urls))
    if urls and not takes_server_urls(c.rollout_engine):
        raise ValueError(f"SamplingConfig.vllm_urls={tuple(urls)!r} is only read by rollout_engine='vllm-server' "
                         f"(this run's is {c.rollout_engine!r}): set rollout_engine='vllm-server' or drop the URLs")
    check_real(c, "vllm_timeout", 0.0, low_open=True)
    if c.weight_sync not in ("files", "nccl"):
        raise ValueError(f"SamplingConfig.weight_sync={c.weight_sync!r} is invalid; valid: 'files' (a weight file per "
                         "version that the servers load) or 'nccl' (broadcast between GPUs)")
    if c.weight_sync_dir is not None and (not isinstance(c.weight_sync_dir, str) or not c.weight_sync_dir):
        raise invalid("SamplingConfig", "weight_sync_dir", c.weight_sync_dir, "None or a directory path")


@dataclasses.dataclass(frozen=True)
class EnvironmentConfig(Concern):
    """How multi-turn episodes run (with `Trainer(environment=...)` or `tools=`;
    `jaxppo.rollout.environments`).

    Attributes:
      max_turns: model turns per episode at most.
      turn_length: tokens per model turn at most, in [1, response_length]; None: the rest
        of the response budget.
      turn_cache: the static sampler keeps each row's KV cache between turns and feeds a
        turn only its new tokens (the same tokens, log-probs equal up to rounding); False:
        every turn prefills its whole context again.
      environment_timeout: seconds one reset or step may take; > 0.
      environment_errors: "raise" (an environment that raises, returns the wrong type or
        times out stops the iteration with an error before any update) or "end" (that
        episode is ended, scored 0 and counted in `env/failed_episodes`).
      environment_workers: threads stepping environments in parallel.
    """

    max_turns: int = 4
    turn_length: Optional[int] = None
    turn_cache: bool = setting(True, free=True)
    environment_timeout: float = 60.0
    environment_errors: str = "raise"
    environment_workers: int = setting(8, free=True)

    def __post_init__(self):
        check_counts(self, ("max_turns", "environment_workers"))
        if self.turn_length is not None:
            check_counts(self, ("turn_length",))
        check_bools(self, ("turn_cache",))
        timeout = self.environment_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout)
                                                                                      and timeout > 0):
            raise ValueError(f"EnvironmentConfig.environment_timeout={timeout!r} is invalid: it must be a finite "
                             "number of seconds > 0")
        if self.environment_errors not in ("raise", "end"):
            raise ValueError(f"EnvironmentConfig.environment_errors={self.environment_errors!r} is invalid; valid: "
                             "'raise' (stop with an error naming the environment, row and turn) or 'end' (end that "
                             "episode with score 0 and count it)")

