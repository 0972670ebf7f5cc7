"""What is static about a run's rollouts: the rollout's own settings (`RolloutConfig`, what a
`PPOConfig` holds for the rollout), everything the compiled rollout reads (`RolloutSpec`: the
models, the sampler's settings, how scores become rewards), and sampling responses from the
policy with it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax.numpy as jnp

from jaxppo.models.model import Model
from jaxppo.models.stops import StopStrings
from jaxppo.rollout.engines import engine_class
from jaxppo.update.checks import invalid, is_int, is_real
from jaxppo.update.kl import check_kl_estimator
from jaxppo.update.shaping import default_overlong_buffer

__all__ = ["RolloutConfig", "RolloutSpec", "OLD_LOGPROBS", "SAMPLING_OFF", "sampling_filters_on"]

# Where a rollout's old-policy log-probs come from (`TrainerConfig.old_logprobs`).
OLD_LOGPROBS = ("auto", "sampler", "recompute")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """The rollout's own settings among a `jaxppo.PPOConfig`'s fields (`PPOConfig.rollout`):
    how completions are sampled and how their scores are shaped before the update sees
    them (the `PPOConfig` fields of the same names, documented here).

    Attributes:
      temperature: the sampling temperature (the loss divides logits by the same one).
      num_generations: G completions per prompt, in consecutive rows.
      kl_coef: the initial beta of the KL penalty in the per-token rewards (the adaptive
        controller moves it when the trainer has a `kl_target`).
      overlong_penalty_factor: DAPO's soft overlong punishment, added to each completion's
        score by the rollout layer: 0 for length L <= Lmax - buffer, falling linearly to
        -factor at L = Lmax, where Lmax is the response budget (the rollout's width) and
        buffer `overlong_buffer`. >= 0; 0 (default) turns it off.
      overlong_buffer: the buffer in tokens, a positive int no longer than the response
        budget; None (default) means a fifth of the budget (DAPO's 4096 of 20480). Only
        read when overlong_penalty_factor > 0.
      mask_truncated_completions: completions that reach the budget without a stop token
        are left out of the loss (their response mask is zeroed in the rollout; their
        scores still count in their group's statistics), as DAPO's overlong filtering and
        TRL's `mask_truncated_completions`. Needs a stop token.
      owner: the name error messages give the fields; not part of equality or the hash.
    """

    temperature: float = 1.0
    num_generations: int = 1
    kl_coef: float = 0.05
    overlong_penalty_factor: float = 0.0
    overlong_buffer: Optional[int] = None
    mask_truncated_completions: bool = False
    owner: str = dataclasses.field(default="RolloutConfig", compare=False, repr=False)

    def __post_init__(self):
        o = self.owner
        if not is_real(self.temperature) or self.temperature <= 0:
            raise invalid(o, "temperature", self.temperature, "a finite real number > 0")
        if not is_int(self.num_generations) or self.num_generations <= 0:
            raise invalid(o, "num_generations", self.num_generations, "a positive int")
        for name in ("kl_coef", "overlong_penalty_factor"):
            if not is_real(getattr(self, name)) or getattr(self, name) < 0:
                raise invalid(o, name, getattr(self, name), "a finite real number >= 0"
                              + (" (0: off)" if name == "overlong_penalty_factor" else ""))
        if self.overlong_buffer is not None:
            if not is_int(self.overlong_buffer) or self.overlong_buffer <= 0:
                raise invalid(o, "overlong_buffer", self.overlong_buffer,
                              "None (a fifth of the response budget) or a positive int (tokens)")
            if not self.overlong_penalty_factor:
                raise invalid(o, "overlong_buffer", self.overlong_buffer,
                              "None while overlong_penalty_factor is 0 (the buffer is only read with a penalty: set "
                              "overlong_penalty_factor > 0, DAPO's is 1.0)")
        if not isinstance(self.mask_truncated_completions, bool):
            raise invalid(o, "mask_truncated_completions", self.mask_truncated_completions, "a bool (True or False)")


# The sampling filters and penalty (`TrainerConfig`'s), each with the values that mean off.
SAMPLING_OFF = {"top_k": (None, 0), "top_p": (None, 1.0), "min_p": (None, 0.0), "repetition_penalty": (None, 1.0)}


def _on(name: str, value):
    """A filter's or the penalty's value as the samplers take it: None where it is off."""
    return None if value in SAMPLING_OFF[name] else (value if name == "top_k" else float(value))


def sampling_filters_on(trainer_config) -> dict:
    """{name: value} of the trainer config's sampling filters and penalty that are on."""
    return {name: getattr(trainer_config, name) for name in SAMPLING_OFF
            if _on(name, getattr(trainer_config, name)) is not None}


def _from(config: str, attribute: str = None, *, default=dataclasses.MISSING, convert=lambda value: value):
    """A field of `RolloutSpec` that `RolloutSpec.from_configs` reads from a config:
    `config` ("rollout": the `RolloutConfig`, "loss": the update's `LossConfig`, whose
    forward the scoring pass repeats, or "trainer": the `TrainerConfig`), its `attribute`
    (None: the field's own name), converted by `convert`."""
    return dataclasses.field(default=default, metadata={"config": config, "attribute": attribute,
                                                         "convert": convert})


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
        (`TrainerConfig`'s, each None when off: a top_k of 0, a top_p of 1, a min_p of 0
        and a penalty of 1 are off), applied by every built-in engine
        (`jaxppo.models.decoding`).
      stop_strings: a `jaxppo.models.stops.StopStrings` (built with the tokenizer from
        `TrainerConfig.stop_strings`), or None.
      kl_estimator: "k1", "k3", "abs" or "mse".
      missing_eos_penalty: subtracted from the score of responses without a stop token.
      normalize_scores: standardise scores by running mean/std before use.
      score_clip: clip (normalised) scores to [-score_clip, score_clip].
      uses_critic: the rollout carries the critic's values (PPO); False: `values` is None.
      num_generations: G, rows per prompt (consecutive): each prompt is prefilled once
        and its KV cache shared by its G rows (`jaxppo.rollout.samplers.static`).
      num_slots: None (the static sampler) or the slots of the continuous sampler
        (`jaxppo.rollout.samplers.continuous`); the same tokens either way.
      overlong_penalty_factor, overlong_buffer: DAPO's soft overlong punishment of the
        scores (`jaxppo.update.shaping.overlong_penalty`; factor 0: off; buffer None: a fifth of
        `response_length`), from `PPOConfig`.
      mask_truncated: zero the rollout's response mask of completions without a stop token
        (`PPOConfig.mask_truncated_completions`), so the loss leaves them out.
      old_logprobs: where the rollout's log-probs come from (`TrainerConfig.old_logprobs`):
        "sampler" (the sampler's own; no policy forward in the scoring pass), "recompute"
        (a forward of the policy; the default of a spec built by hand), or "auto"
        ("sampler" when the rollout engine's log-probs are exact (`Capabilities.exact_logprobs`:
        the built-in ones) and the policy computes in
        float32, else "recompute"; see `sampler_logprobs_used`).
      rollout_engine: the name of the rollout engine (`TrainerConfig.rollout_engine`:
        "jaxppo", "vllm" or a registered one; `jaxppo.rollout.engines`).
      max_staleness: the rollouts' sampling policy is up to this many iterations older
        than the trained one (`TrainerConfig.max_staleness`); "auto" old log-probs are
        then recomputed (the decoupled objective: see `jaxppo.run.pipeline`).
      turn_cache: multi-turn episodes keep each row's KV cache between turns with the
        static sampler (`TrainerConfig.turn_cache`; `jaxppo.rollout.samplers.turns`).
      share_prompts: with `num_generations` G > 1, the scoring pass runs each group's
        prompt once for its G rows (policy, critic and reference; `PPOConfig.share_prompts`,
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
        the reward model; `PPOConfig.common_prefix` then runs it once per micro-batch in
        the loss; the static sampler prefills it once for batches that begin with it
        (`jaxppo.rollout.samplers.static.generate`'s `common_prefix`). 0: the usual layout.
    """

    policy: Model
    apply_fn: Callable
    ref_apply: Optional[Callable]
    response_length: int = _from("trainer")
    temperature: float = _from("rollout", default=1.0, convert=float)
    policy_params_key: Optional[str] = None
    reward_apply: Optional[Callable] = None
    reward_weight: float = 1.0
    keep_ref_logprobs: bool = _from("loss", "kl_loss_coef", default=False, convert=bool)
    ref_is_policy: bool = False
    token_reward_fn: Optional[Callable] = None
    stop_token_ids: Tuple[int, ...] = ()
    pad_token_id: int = 0
    top_k: Optional[int] = _from("trainer", default=None, convert=lambda k: _on("top_k", k))
    top_p: Optional[float] = _from("trainer", default=None, convert=lambda p: _on("top_p", p))
    min_p: Optional[float] = _from("trainer", default=None, convert=lambda p: _on("min_p", p))
    repetition_penalty: Optional[float] = _from("trainer", default=None,
                                                convert=lambda r: _on("repetition_penalty", r))
    stop_strings: Optional[StopStrings] = None
    kl_estimator: str = _from("trainer", default="k1")
    missing_eos_penalty: Optional[float] = _from("trainer", default=None)
    normalize_scores: bool = _from("trainer", default=False)
    score_clip: Optional[float] = _from("trainer", default=None)
    uses_critic: bool = _from("loss", default=True)
    num_generations: int = _from("rollout", default=1)
    num_slots: Optional[int] = _from("trainer", default=None)
    overlong_penalty_factor: float = _from("rollout", default=0.0, convert=float)
    overlong_buffer: Optional[int] = _from("rollout", default=None)
    mask_truncated: bool = _from("rollout", "mask_truncated_completions", default=False)
    share_prompts: bool = _from("loss", default=False, convert=lambda value: value is not False)
    old_logprobs: str = _from("trainer", default="recompute")
    turn_cache: bool = _from("trainer", default=True)
    rollout_engine: str = _from("trainer", default="jaxppo")
    max_staleness: int = _from("trainer", default=0)
    pack_sequences: bool = _from("loss", default=False)
    pack_streams: Optional[int] = None
    pack_length: Optional[int] = _from("loss", default=None)
    common_prefix: int = 0

    @classmethod
    def from_configs(cls, ppo, trainer, **fields) -> "RolloutSpec":
        """A spec whose settings come from a `PPOConfig` (its `.rollout` and `.loss`) and a
        `TrainerConfig` (each field that says so reads its attribute of that config: nothing
        is copied by hand), and `fields` (the models, stop and pad tokens, ...)."""
        configs = {"rollout": ppo.rollout, "loss": ppo.loss, "trainer": trainer}
        read = {f.name: f.metadata["convert"](getattr(configs[f.metadata["config"]],
                                                                        f.metadata["attribute"] or f.name))
                for f in dataclasses.fields(cls) if "config" in f.metadata}
        return cls(**read, **fields)

    def __post_init__(self):
        check_kl_estimator("kl_estimator=", self.kl_estimator)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs={self.old_logprobs!r} is invalid; valid: {', '.join(map(repr, OLD_LOGPROBS))}")
        if self.overlong_buffer is not None and self.overlong_buffer > self.response_length:
            raise ValueError(f"PPOConfig.overlong_buffer={self.overlong_buffer} is longer than the response budget "
                             f"(response_length={self.response_length}); it must be in [1, {self.response_length}] "
                             "(None: a fifth of the budget)")
        if isinstance(self.common_prefix, bool) or not isinstance(self.common_prefix, int) or self.common_prefix < 0:
            raise ValueError(f"common_prefix={self.common_prefix!r} is invalid: the prompts' shared tokens, an int >= 0 "
                             "(0: the usual layout)")
        if self.common_prefix and self.pack_sequences:
            raise ValueError("common_prefix and pack_sequences exclude each other: packing packs whole rows")
        if self.mask_truncated and not self.stop_token_ids:
            raise ValueError("PPOConfig.mask_truncated_completions=True needs a stop token (TrainerConfig."
                             "stop_token_id, or a tokenizer with an eos_token_id): without one every completion "
                             "is truncated and nothing would be trained")

    @property
    def reshapes(self) -> bool:
        """A filter or the penalty is on: the distribution sampled from is not the policy's
        softmax(logits / temperature), and the sampler's log-probs are of the former."""
        return any(v is not None for v in (self.top_k, self.top_p, self.min_p, self.repetition_penalty))

    def sampling(self) -> dict:
        """The sampling settings every built-in sampler takes from the spec."""
        return dict(temperature=self.temperature, stop_token_ids=self.stop_token_ids, pad_token_id=self.pad_token_id,
                    top_k=self.top_k, top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                    stop_strings=self.stop_strings)

    @property
    def sampler_logprobs_used(self) -> bool:
        """The rollout's old-policy log-probs are the sampler's own (no policy forward)."""
        if self.old_logprobs == "auto":  # stale samples: the trainer's own at update time (decoupled)
            exact = engine_class(self.rollout_engine, self.num_slots).capabilities.exact_logprobs
            return (exact and jnp.dtype(self.policy.dtype) == jnp.float32
                    and not self.max_staleness)
        return self.old_logprobs == "sampler"

    @property
    def buffer(self) -> int:
        """The overlong buffer in tokens (the configured one, or a fifth of the budget)."""
        return self.overlong_buffer or default_overlong_buffer(self.response_length)

    def policy_params(self, params):
        return params if self.policy_params_key is None else params[self.policy_params_key]
