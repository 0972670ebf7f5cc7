"""What is static about a run's rollouts (`RolloutSpec`): everything the compiled sampling and
scoring read (the models, the sampler's settings, how scores become rewards), made from a
`jaxppo.Config` by `RolloutSpec.from_config`. (0.5-dev's `jaxppo.rollout.sampling`.)"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax.numpy as jnp

from jaxppo.models.model import Model
from jaxppo.models.sampling import Sampling, filter_on
from jaxppo.models.stops import StopStrings
from jaxppo.rollout.engines import engine_class
from jaxppo.update.shaping import default_overlong_buffer

__all__ = ["RolloutSpec", "OLD_LOGPROBS"]

# Where a rollout's old-policy log-probs come from (`SamplingConfig.old_logprobs`).
OLD_LOGPROBS = ("auto", "sampler", "recompute")


def _from(path: str, *, default=dataclasses.MISSING, convert=lambda value: value):
    """A field of `RolloutSpec` that `RolloutSpec.from_config` reads from a `jaxppo.Config`:
    `path` ("concern.setting", or "uses_critic" for a property of the config), converted by
    `convert`."""
    return dataclasses.field(default=default, metadata={"path": path, "convert": convert})


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Everything static about rollouts (hashable: a static jit argument).

    Attributes:
      policy: the causal-LM `Model` that samples (kind "causal_lm" or "causal_lm_value").
      apply_fn: the train state's `apply_fn(params, tokens, mask) -> (logits, values)`.
      policy_params_key: where the policy's params sit in the train params (None: the
        params are the policy's own, as with a shared trunk; "policy" for PolicyAndCritic).
      ref_apply: `ref_apply(ref_params, tokens, mask) -> logits`; one that offers
        `response_outputs` (a built-in model) scores without full logits. None: no
        reference (no KL in the reward or the loss); the KL is then 0 and not reported.
      ref_is_policy: the reference runs on the policy's own params (`ref_apply` is the
        policy's base model: a LoRA policy with `adapters=False`), so no `ref_params` are
        passed and no second copy of the weights exists.
      keep_ref_logprobs: put the reference log-probs in the rollout (`ref_logprobs`) for a
        KL term in the loss.
      reward_apply: `reward_apply(reward_params, tokens, mask) -> (B,)` scores, or None.
      reward_weight: the reward model's weight in the score (weighted reward functions on
        the host add theirs).
      token_reward_fn: a jittable `fn(prompt_ids, prompt_mask, response_ids, response_mask)
        -> (B,)` scores, or None.
      response_length, temperature, stop_token_ids, pad_token_id: sampling.
      top_k, top_p, min_p, repetition_penalty: the sampling filters and penalty
        (`SamplingConfig`'s, each None when off: a top_k of 0, a top_p of 1, a min_p of 0
        and a penalty of 1 are off), applied by every built-in engine
        (`jaxppo.models.decoding`).
      stop_strings: a `jaxppo.models.stops.StopStrings` (built with the tokenizer from
        `SamplingConfig.stop_strings`), or None.
      kl_estimator: "k1", "k3", "abs" or "mse".
      missing_eos_penalty: subtracted from the score of responses without a stop token.
      normalize_scores: standardise scores by running mean/std before use.
      score_clip: clip (normalised) scores to [-score_clip, score_clip].
      uses_critic: the rollout carries the critic's values (PPO); False: `values` is None.
      num_generations: G, rows per prompt (consecutive): each prompt is prefilled once
        and its KV cache shared by its G rows (`jaxppo.rollout.engines.static`).
      num_slots: None (the static sampler) or the slots of the continuous sampler
        (`jaxppo.rollout.engines.continuous`); the same tokens either way.
      overlong_penalty_factor, overlong_buffer: DAPO's soft overlong punishment of the
        scores (`jaxppo.update.shaping.overlong_penalty`; factor 0: off; buffer None: a fifth of
        `response_length`), from `RewardConfig`.
      mask_truncated: zero the rollout's response mask of completions without a stop token
        (`RewardConfig.mask_truncated_completions`), so the loss leaves them out.
      old_logprobs: where the rollout's log-probs come from (`SamplingConfig.old_logprobs`):
        "sampler" (the sampler's own; no policy forward in the forward pass), "recompute"
        (a forward of the policy; the default of a spec built by hand), or "auto"
        ("sampler" when the rollout engine's log-probs are exact (`Capabilities.exact_logprobs`:
        the built-in ones) and the policy computes in
        float32, else "recompute"; see `sampler_logprobs_used`).
      rollout_engine: the name of the rollout engine (`SamplingConfig.rollout_engine`:
        "jaxppo", "vllm" or a registered one; `jaxppo.rollout.engines`).
      max_staleness: the rollouts' sampling policy is up to this many iterations older
        than the trained one (`SamplingConfig.max_staleness`); "auto" old log-probs are
        then recomputed (the decoupled objective: see `jaxppo.run.pipeline`).
      turn_cache: multi-turn episodes keep each row's KV cache between turns with the
        static sampler (`EnvironmentConfig.turn_cache`; `jaxppo.rollout.engines.static`).
      share_prompts: with `num_generations` G > 1, the forward pass runs each group's
        prompt once for its G rows (policy, critic and reference; `LayoutConfig.share_prompts`,
        whose None, the trainer's default, counts as True here; False for a spec built by
        hand).
      pack_sequences, pack_streams, pack_length: score the batch packed (`jaxppo.update.packing`:
        the policy's, critic's and reference's forwards over `pack_streams` streams of
        `pack_length` tokens, None: Q + R); `jaxppo.run.stages.build_rollout` sets the streams
        for each batch from its lengths. The reward model still scores padded rows.
      common_prefix: p > 0: the prompts' first p real tokens are the same in every row
        (the prompt set's common prefix, `jaxppo.update.prefix.common_prefix_length`), and
        the rollout is built in the common-prefix layout (`jaxppo.update.prefix`): the
        prefix is every row's query, run once by the policy, the reference, the critic and
        the reward model; `LayoutConfig.common_prefix` then runs it once per micro-batch in
        the loss; the static sampler prefills it once for batches that begin with it
        (`jaxppo.rollout.engines.static.generate`'s `common_prefix`). 0: the usual layout.
      distill_top_k: k > 0: on-policy distillation keeps the teacher's (the `ref_apply`
        model's) k largest log-probs at each response position and their ids in the rollout
        (`teacher_top_logprobs`, `teacher_top_ids`), from the same forward that scores the
        sampled tokens; every row runs its own prompt there. 0: none.
    """

    policy: Model
    apply_fn: Callable
    ref_apply: Optional[Callable]
    response_length: int = _from("sampling.response_length")
    temperature: float = _from("sampling.temperature", default=1.0, convert=float)
    policy_params_key: Optional[str] = None
    reward_apply: Optional[Callable] = None
    reward_weight: float = 1.0
    keep_ref_logprobs: bool = _from("keeps_ref_logprobs", default=False, convert=bool)
    ref_is_policy: bool = False
    token_reward_fn: Optional[Callable] = None
    stop_token_ids: Tuple[int, ...] = ()
    pad_token_id: int = 0
    top_k: Optional[int] = _from("sampling.top_k", default=None, convert=lambda k: filter_on("top_k", k))
    top_p: Optional[float] = _from("sampling.top_p", default=None, convert=lambda p: filter_on("top_p", p))
    min_p: Optional[float] = _from("sampling.min_p", default=None, convert=lambda p: filter_on("min_p", p))
    repetition_penalty: Optional[float] = _from("sampling.repetition_penalty", default=None,
                                                convert=lambda r: filter_on("repetition_penalty", r))
    stop_strings: Optional[StopStrings] = None
    kl_estimator: str = _from("kl.kl_estimator", default="k1")
    missing_eos_penalty: Optional[float] = _from("rewards.missing_eos_penalty", default=None)
    normalize_scores: bool = _from("rewards.normalize_scores", default=False)
    score_clip: Optional[float] = _from("rewards.score_clip", default=None)
    uses_critic: bool = _from("uses_critic", default=True)
    num_generations: int = _from("batch.num_generations", default=1)
    num_slots: Optional[int] = _from("sampling.num_slots", default=None)
    overlong_penalty_factor: float = _from("rewards.overlong_penalty_factor", default=0.0, convert=float)
    overlong_buffer: Optional[int] = _from("rewards.overlong_buffer", default=None)
    mask_truncated: bool = _from("rewards.mask_truncated_completions", default=False)
    share_prompts: bool = _from("layout.share_prompts", default=False, convert=lambda value: value is not False)
    old_logprobs: str = _from("sampling.old_logprobs", default="recompute")
    turn_cache: bool = _from("environment.turn_cache", default=True)
    rollout_engine: str = _from("sampling.rollout_engine", default="jaxppo")
    max_staleness: int = _from("sampling.max_staleness", default=0)
    pack_sequences: bool = _from("layout.pack_sequences", default=False)
    pack_streams: Optional[int] = None
    pack_length: Optional[int] = _from("layout.pack_length", default=None)
    common_prefix: int = 0
    distill_top_k: int = _from("advantages.distill_top_k", default=0)

    @classmethod
    def from_config(cls, config, **fields) -> "RolloutSpec":
        """A spec whose settings come from a `jaxppo.Config` (each field that names a path
        reads that setting: nothing is copied by hand), and `fields` (the models, stop and
        pad tokens, ...)."""
        def read(path):
            value = config
            for part in path.split("."):
                value = getattr(value, part)
            return value

        settings = {f.name: f.metadata["convert"](read(f.metadata["path"]))
                    for f in dataclasses.fields(cls) if "path" in f.metadata}
        return cls(**settings, **fields)

    def __post_init__(self):
        """What a `jaxppo.Config` cannot check (its settings are checked there): the
        tokenizer's stops, and a layout set by the trainer or by hand."""
        if isinstance(self.common_prefix, bool) or not isinstance(self.common_prefix, int) or self.common_prefix < 0:
            raise ValueError(f"common_prefix={self.common_prefix!r} is invalid: the prompts' shared tokens, an int >= 0 "
                             "(0: the usual layout)")
        if self.common_prefix and self.pack_sequences:
            raise ValueError("common_prefix and pack_sequences exclude each other: packing packs whole rows")
        if self.mask_truncated and not self.stop_token_ids:
            raise ValueError("RewardConfig.mask_truncated_completions=True needs a stop token (SamplingConfig."
                             "stop_tokens, whose 'eos' needs a tokenizer with an eos_token_id): without one every "
                             "completion is truncated and nothing would be trained")

    @property
    def records_routing(self) -> bool:
        """The forward pass records the policy's routing (`RolloutBatch.routing`): a mixture of
        experts whose old log-probs it computes, in the plain layout (no common prefix, no
        packing, each row its own prompt)."""
        from jaxppo.update.batch import model_method

        return (bool(self.policy.config.num_experts) and not self.sampler_logprobs_used and not self.common_prefix
                and not self.pack_sequences and not (self.share_prompts and self.num_generations > 1)
                and model_method(self.apply_fn, "routed_outputs") is not None)

    @property
    def reshapes(self) -> bool:
        """A filter or the penalty is on: the distribution sampled from is not the policy's
        softmax(logits / temperature), and the sampler's log-probs are of the former."""
        return any(v is not None for v in (self.top_k, self.top_p, self.min_p, self.repetition_penalty))

    @property
    def sampling(self) -> Sampling:
        """The run's `Sampling` value, made of the spec's sampling fields (every sampler takes
        it whole; equal values compile once). A property, so `vars(spec)` holds fields only."""
        return Sampling(response_length=self.response_length, temperature=self.temperature, top_k=self.top_k,
                        top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                        stop_token_ids=self.stop_token_ids, stop_strings=self.stop_strings,
                        pad_token_id=self.pad_token_id)

    @property
    def sampler_logprobs_used(self) -> bool:
        """The rollout's old-policy log-probs are the sampler's own (no policy forward). Under
        "auto", not for a mixture of experts: its forward pass records the routing
        (`records_routing`)."""
        if self.old_logprobs == "auto":  # stale samples: the trainer's own at update time (decoupled)
            exact = engine_class(self.rollout_engine, self.num_slots).capabilities.exact_logprobs
            return (exact and jnp.dtype(self.policy.dtype) == jnp.float32
                    and not self.max_staleness and not self.policy.config.num_experts)
        return self.old_logprobs == "sampler"

    @property
    def buffer(self) -> int:
        """The overlong buffer in tokens (the configured one, or a fifth of the budget)."""
        return self.overlong_buffer or default_overlong_buffer(self.response_length)

    def policy_params(self, params):
        return params if self.policy_params_key is None else params[self.policy_params_key]
