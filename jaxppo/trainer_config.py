"""`TrainerConfig`: the settings of the RLHF loop around the update (the update's own are
in `PPOConfig`), validated up front."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

from jaxppo.config import setting
from jaxppo.models.transformer import ATTENTION
from jaxppo.rollout.engines import BUILT_IN, engine_class, rollout_engine_names
from jaxppo.rollout.sampling import OLD_LOGPROBS
from jaxppo.tracking import check_installed, parse_report_to
from jaxppo.update.checks import is_int
from jaxppo.update.kl import check_kl_estimator

__all__ = ["TrainerConfig", "OLD_LOGPROBS"]


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """Settings of the RLHF loop (the update itself is in `PPOConfig`).

    Run: seed; iterations (PPO iterations, each `batch_size` episodes) or total_episodes
      (must be a multiple of batch_size; overrides iterations); query_length and
      response_length (tokens; prompts are left-padded to query_length); overlong_prompts,
      what a prompt longer than query_length gets: "error" (the default), "truncate" (its
      last query_length tokens are kept; `truncate_prompts=True` says the same) or "filter"
      (left out, counted in `data/prompts_filtered`); stream_prompts (read and tokenize the
      prompts as the run reaches them, in the order given, instead of all up front and
      reshuffled every pass: `jaxppo.rollout.prompts.PromptStream`; a generator, a
      `datasets.IterableDataset` or a `jaxppo.mix_prompts` mixture is always streamed).
    Rewards: kl_estimator ("k1", "k3", "abs", "mse"); kl_target and kl_horizon (adaptive
      KL controller; None = fixed `PPOConfig.kl_coef`); missing_eos_penalty (subtracted
      from scores of responses without a stop token); normalize_scores (running mean/std);
      score_clip.
    Optimisation: learning_rate (policy), critic_learning_rate (default: learning_rate),
      lr_schedule ("constant", "linear" decay to 0, "cosine" to 0, "cosine_with_min_lr" to
      min_lr_ratio * learning_rate), warmup_updates or warmup_ratio (of the run's updates),
      max_grad_norm (None: no clipping), adam_eps, adam_beta1, adam_beta2, weight_decay
      (> 0: AdamW, decoupled decay on the linear layers' kernels and LoRA matrices, not on
      embeddings, norms and biases; weight_decay_mask="all" decays every parameter),
      shared_trunk (value head on the policy). `Trainer(optimizer=...)` replaces the
      built-in Adam/AdamW with any optax transformation.
    Output: output_dir; log_every; sample_every and num_samples (printed completions);
      checkpoint_every (iterations; 0 = only on interrupt and at the end), keep_checkpoints,
      resume (continue from the latest checkpoint in output_dir; False refuses a directory
      that already holds a run); resume_from (another run's directory or one of its
      checkpoints, `<run>/checkpoints/<step>`: a new output_dir starts from it, with the
      same settings checks; `jaxppo.run.save_restore.adopt`); report_to (the experiment trackers, TRL's option: a
      comma-separated string or a list of "jsonl", "tensorboard", "wandb", "mlflow",
      "trackio", a name given to `jaxppo.tracking.register_tracker`, "all" or "none";
      `<output_dir>/metrics.jsonl` is written whatever it says; a tracker whose package is
      missing is refused here, with the pip command; see `jaxppo.tracking`); tensorboard
      (False drops "tensorboard" from report_to); progress; export_final (policy as a
      Hugging Face directory); plot (PNG of score, KL, reward). save_hf_every (a Hugging
      Face checkpoint of the policy, or its PEFT adapter with LoRA, with the tokenizer,
      every that many iterations under `<output_dir>/hf/iteration_<n>`; 0: none), keep_hf
      (the newest kept; 0: all), best_metric (an `eval/...` metric: the policy that scored
      best on it kept in `<output_dir>/hf/best`, `hf/best.json` saying which) and
      best_metric_mode ("max" or "min").
    Sampling (temperature: `PPOConfig.temperature`; docs/ppo.md, "Sampling settings"): top_k
      (None/0: off), top_p (1.0: off), min_p (None/0: off), repetition_penalty (1.0: off),
      in vLLM's order (`jaxppo.models.decoding`; the behaviour log-probs are of the result);
      stop_token_id (default: the tokenizer's EOS), stop_token_ids (more stop tokens),
      stop_strings (a completion ends at the token completing one: `jaxppo.models.stops`).
      num_slots (None: the static sampler, every row of the batch decoded together
      until the last ends, each prompt prefilled once per group; an int: the
      continuous sampler with that many slots, a finished row's slot refilled at
      once: `jaxppo.rollout.samplers.continuous`; the same tokens either way, so it may change
      between a run and its resume); rollout_engine, the rollout engine
      (`jaxppo.rollout.engines`): "jaxppo", the built-in engines (the static sampler, or
      the continuous one with num_slots); "vllm": vLLM in this process, the policy's weights
      pushed into it after every update (`jaxppo.rollout.vllm`; its log-probs are the
      rollout's sampler log-probs, which `PPOConfig.rollout_correction` corrects for; one
      device, single-turn rollouts); or a name given to `register_rollout_engine`. What a
      run needs of its engine (multi-turn, a mesh, in-flight updates) is checked against
      the engine's declared `Capabilities` before anything starts.
    Models: attention (None: each model as given, `Model.attention`, "einsum" by default;
      "einsum", "xla" or "cudnn": every model of the run computes attention over whole
      sequences that way, `jaxppo.models.Model`; "cudnn" is cuDNN's flash attention on
      NVIDIA GPUs, for bfloat16/float16 `dtype`; the same results up to rounding, so it
      may change between a run and its resume); hoist_layers (with scanned layers, the
      sampler slices each layer's weights out once per call instead of at every decode
      step: faster sampling for a second copy of the weights while sampling,
      `Model.hoist_layers`; the unrolled layout's tokens, equal up to rounding, so it too
      may change on resume).
    Environments (multi-turn episodes; used only with `Trainer(environment=...)`, see
      `jaxppo.rollout.environments`): max_turns (model turns per episode at most); turn_length
      (tokens per model turn at most; None: the rest of the response budget); turn_cache
      (the static sampler keeps each row's KV cache between turns and feeds a turn only
      its new tokens, the last turn's final token and the observation: the same tokens,
      log-probs equal up to rounding; False: every turn prefills the whole context again,
      as the continuous sampler always does; free on resume);
      environment_timeout (seconds one reset or step may take); environment_errors
      ("raise": an environment that raises, returns the wrong type or times out stops
      the iteration with an error before any update; "end": that episode is ended, scored
      0 and counted in `env/failed_episodes`); environment_workers (threads stepping
      environments in parallel).
    Dynamic sampling (DAPO): dynamic_sampling (groups of `num_generations` completions
      whose scores are all equal carry no signal: they are dropped and replaced by groups
      of further prompts, so every update still sees `batch_size` completions; see
      `jaxppo.rollout.dynamic`); dynamic_sampling_rounds (generation rounds per iteration at most,
      the first included; when they do not fill the batch, the rest is filled with dropped
      groups whose response mask is zero: counted in `dynamic/masked_groups`).
    Scoring: old_logprobs, where the rollout's old-policy log-probs come from: "sampler"
      (the sampler's own, kept while sampling: the scoring pass runs no policy forward,
      and with no reference and no critic no forward at all), "recompute" (a forward of
      the policy over the sampled batch, as 0.3 did), or "auto" (the default: "sampler"
      with the built-in engine, a float32 policy and max_staleness 0, where both are the
      same numbers up to float rounding, else "recompute": vLLM's, bf16 and stale
      log-probs differ from the trainer's, which `PPOConfig.rollout_correction` then
      corrects for). Free on resume.
    Pipelining (`jaxppo.run.pipeline`): max_staleness, k: 0 (default) is the synchronous
      loop, each iteration sampled from the parameters it trains; k >= 1 samples iteration
      i in producer threads from the parameters after max(0, i - k) iterations, so
      sampling, reward functions, environments and decoding of the next iterations
      overlap the update of this one; `rollout/staleness_*` logged. The loss then takes the
      trainer's own log-probs at update time as its old policy and corrects for the
      sampler's (`PPOConfig.rollout_correction`: a decoupled objective; `old_logprobs`
      "auto" recomputes). Checkpoints hold the k parameter snapshots still to be sampled
      from, so a resumed run repeats the uninterrupted one. sampler_devices: 0 (the
      sampler shares the trainer's devices) or n >= 1 (the last n devices sample on a mesh
      of their own, the others train; every snapshot is moved device to device; needs
      max_staleness >= 1). inflight_updates: None, "keep" or "recompute": with the
      continuous sampler (num_slots), a long generation takes the newest
      parameters between decode steps (every inflight_steps steps) instead of holding to
      the version it started from; each row's KV cache is kept or computed again with the
      new parameters; every token's version is recorded (`rollout/staleness_*` over
      tokens). Tokens then depend on when versions arrive: such a run is not repeated
      exactly on resume. Single-turn, no dynamic sampling.
    Evaluation (with `Trainer(eval_prompts=...)`; `jaxppo.run.evaluation`): eval_every (an
      evaluation at every iteration i > 0 with i % eval_every == 0; 0: none but the first),
      eval_before_training (the evaluation at iteration 0, of the initial policy; None: on),
      eval_generations (completions per eval prompt: pass@k for k up to it when the rewards
      are 0 or 1), eval_temperature (None: `PPOConfig.temperature`; 0: greedy). Metrics
      `eval/...` in the iteration's line, of the policy that sampled that iteration.
    Faults: skip_nonfinite_scores (an iteration whose scores include NaN or inf is skipped
      and counted in `objective/skipped_nonfinite_scores` instead of stopping the run with
      an error naming the rows).
    """

    seed: int = 0
    iterations: int = setting(100, on_resume="free")
    total_episodes: Optional[int] = setting(None, on_resume="free")
    query_length: int = 32
    response_length: int = 32
    truncate_prompts: bool = False
    overlong_prompts: Optional[str] = setting(None, on_resume="same_if_set")
    stream_prompts: bool = setting(False, on_resume="same_if_set")
    kl_estimator: str = "k1"
    kl_target: Optional[float] = None
    kl_horizon: int = 10000
    missing_eos_penalty: Optional[float] = None
    normalize_scores: bool = False
    score_clip: Optional[float] = None
    stop_token_id: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = setting((), on_resume="same_if_set")
    stop_strings: Tuple[str, ...] = setting((), on_resume="same_if_set")
    top_k: Optional[int] = setting(None, on_resume="same_if_set")
    top_p: float = setting(1.0, on_resume="same_if_set")
    min_p: Optional[float] = setting(None, on_resume="same_if_set")
    repetition_penalty: float = setting(1.0, on_resume="same_if_set")
    learning_rate: float = 1e-5
    critic_learning_rate: Optional[float] = None
    lr_schedule: str = "constant"
    warmup_updates: int = 0
    max_grad_norm: Optional[float] = 1.0
    adam_eps: float = 1e-5
    adam_beta1: float = setting(0.9, on_resume="same_if_set")
    adam_beta2: float = setting(0.999, on_resume="same_if_set")
    weight_decay: float = setting(0.0, on_resume="same_if_set")
    weight_decay_mask: str = setting("matrices", on_resume="same_if_set")
    min_lr_ratio: float = setting(0.0, on_resume="same_if_set")
    warmup_ratio: float = setting(0.0, on_resume="same_if_set")
    shared_trunk: bool = False
    output_dir: str = setting("runs/jaxppo", on_resume="free")
    log_every: int = setting(1, on_resume="free")
    sample_every: int = setting(10, on_resume="free")
    num_samples: int = setting(2, on_resume="free")
    checkpoint_every: int = setting(0, on_resume="free")
    keep_checkpoints: int = setting(2, on_resume="free")
    resume: bool = setting(True, on_resume="free")
    resume_from: Optional[str] = setting(None, on_resume="free")
    report_to: str = setting("jsonl,tensorboard", on_resume="free")
    tensorboard: bool = setting(True, on_resume="free")
    progress: bool = setting(True, on_resume="free")
    export_final: bool = setting(True, on_resume="free")
    plot: bool = setting(True, on_resume="free")
    save_hf_every: int = setting(0, on_resume="free")
    keep_hf: int = setting(2, on_resume="free")
    best_metric: Optional[str] = setting(None, on_resume="free")
    best_metric_mode: str = setting("max", on_resume="free")
    skip_nonfinite_scores: bool = False
    eval_every: int = setting(0, on_resume="free")
    eval_before_training: Optional[bool] = setting(None, on_resume="free")
    eval_generations: int = setting(1, on_resume="free")
    eval_temperature: Optional[float] = setting(None, on_resume="free")
    num_slots: Optional[int] = setting(None, on_resume="free")
    max_turns: int = setting(4, on_resume="same_if_set")
    turn_length: Optional[int] = setting(None, on_resume="same_if_set")
    turn_cache: bool = setting(True, on_resume="free")
    environment_timeout: float = setting(60.0, on_resume="same_if_set")
    environment_errors: str = setting("raise", on_resume="same_if_set")
    environment_workers: int = setting(8, on_resume="free")
    dynamic_sampling: bool = setting(False, on_resume="same_if_set")
    dynamic_sampling_rounds: int = setting(3, on_resume="same_if_set")
    rollout_engine: str = setting("jaxppo", on_resume="same_if_set")
    attention: Optional[str] = setting(None, on_resume="free")
    hoist_layers: bool = setting(False, on_resume="free")
    old_logprobs: str = setting("auto", on_resume="free")
    max_staleness: int = setting(0, on_resume="same_if_set")
    sampler_devices: int = setting(0, on_resume="free")
    inflight_updates: Optional[str] = setting(None, on_resume="free")
    inflight_steps: int = setting(8, on_resume="free")

    @property
    def overlong(self) -> str:
        """`overlong_prompts`, else "truncate" with `truncate_prompts`, else "error"."""
        return self.overlong_prompts or ("truncate" if self.truncate_prompts else "error")

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if field.type in (bool, "bool") and not isinstance(getattr(self, field.name), bool):
                raise ValueError(f"TrainerConfig.{field.name}={getattr(self, field.name)!r} is invalid: "
                                 f"{field.name} must be a bool (True or False)")
        _check_sampling(self)
        _check_overlong(self)
        names = parse_report_to(self.report_to)
        check_installed(names)
        object.__setattr__(self, "report_to", ",".join(names))  # a list given becomes its string
        if self.num_slots is not None and (not is_int(self.num_slots) or self.num_slots <= 0):
            raise ValueError(f"TrainerConfig.num_slots={self.num_slots!r} is invalid: num_slots must be None (the static "
                             "sampler) or a positive int (rows the continuous sampler decodes together)")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError(f"TrainerConfig.output_dir={self.output_dir!r} is invalid: output_dir must be a non-empty "
                             "path string")
        if self.total_episodes is not None and (not is_int(self.total_episodes) or self.total_episodes <= 0):
            raise ValueError(f"TrainerConfig.total_episodes={self.total_episodes!r} is invalid: total_episodes must be "
                             "None or a positive int")
        if self.stop_token_id is not None and (not is_int(self.stop_token_id) or self.stop_token_id < 0):
            raise ValueError(f"TrainerConfig.stop_token_id={self.stop_token_id!r} is invalid: stop_token_id must be "
                             "None or a token id >= 0")
        _check_counts(self)
        check_kl_estimator("TrainerConfig.kl_estimator=", self.kl_estimator)
        _check_watching(self)
        _check_inflight(self)
        if self.sampler_devices and not self.max_staleness:
            raise ValueError(f"TrainerConfig.sampler_devices={self.sampler_devices} gives the sampler devices of its "
                             "own, which only pays when sampling overlaps training: set max_staleness >= 1, or "
                             "sampler_devices=0 (sampler and trainer share the devices)")
        _check_environment(self)
        if self.lr_schedule not in ("constant", "linear", "cosine", "cosine_with_min_lr"):
            raise ValueError(f"TrainerConfig.lr_schedule={self.lr_schedule!r} is invalid; valid: constant, linear, "
                             "cosine, cosine_with_min_lr")
        _check_optimizer(self)
        _check_rates(self)

    @property
    def trackers(self) -> tuple:
        """The trackers the run reports to (`report_to`, "jsonl" first; without "tensorboard"
        when `tensorboard` is False)."""
        return tuple(n for n in self.report_to.split(",") if self.tensorboard or n != "tensorboard")


def _check_environment(self: TrainerConfig):
    if self.turn_length is not None and (not is_int(self.turn_length) or not
                                         0 < self.turn_length <= self.response_length):
        raise ValueError(f"TrainerConfig.turn_length={self.turn_length!r} is invalid: turn_length must be None (a "
                         f"turn may use the rest of the budget) or an int in [1, response_length="
                         f"{self.response_length}]")
    timeout = self.environment_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (math.isfinite(timeout)
                                                                                  and timeout > 0):
        raise ValueError(f"TrainerConfig.environment_timeout={timeout!r} is invalid: it must be a finite number of "
                         "seconds > 0")
    if self.attention is not None and self.attention not in ATTENTION:
        raise ValueError(f"TrainerConfig.attention={self.attention!r} is invalid; valid: None (each model as "
                         f"given), {', '.join(map(repr, ATTENTION))}")
    if self.rollout_engine not in rollout_engine_names():
        raise ValueError(f"TrainerConfig.rollout_engine={self.rollout_engine!r} is invalid; valid: 'jaxppo' (the "
                         "built-in engines), " + ", ".join(map(repr, rollout_engine_names()[1:]))
                         + " (jaxppo.rollout.engines.register_rollout_engine adds one)")
    if self.old_logprobs not in OLD_LOGPROBS:
        raise ValueError(f"TrainerConfig.old_logprobs={self.old_logprobs!r} is invalid; valid: 'auto' (the "
                         "sampler's with the built-in engine and a float32 policy, else recomputed), 'sampler' "
                         "(the sampler's own log-probs), 'recompute' (a forward of the policy)")
    if self.environment_errors not in ("raise", "end"):
        raise ValueError(f"TrainerConfig.environment_errors={self.environment_errors!r} is invalid; valid: 'raise' "
                         "(stop with an error naming the environment, row and turn) or 'end' (end that episode "
                         "with score 0 and count it)")


def _check_counts(self: TrainerConfig):
    positive = ("iterations", "query_length", "response_length", "kl_horizon", "log_every", "keep_checkpoints",
                "max_turns", "environment_workers", "dynamic_sampling_rounds", "inflight_steps", "eval_generations")
    for name in positive:
        value = getattr(self, name)
        if not is_int(value) or value <= 0:
            raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be a positive int")
    for name in ("sample_every", "num_samples", "checkpoint_every", "warmup_updates", "seed", "max_staleness",
                 "sampler_devices", "eval_every", "save_hf_every", "keep_hf"):
        value = getattr(self, name)
        if not is_int(value) or value < 0:
            raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be an int >= 0")
    if self.seed >= SEED_LIMIT:  # jax.random.key keeps 32 bits: 2**32 would be the run of seed 0
        raise ValueError(f"TrainerConfig.seed={self.seed!r} (--seed) is invalid: the run's PRNG key takes seeds in "
                         f"[0, 2**32) = [0, {SEED_LIMIT - 1}]; a larger one is cut to its low 32 bits, so it would "
                         f"repeat the run of seed {self.seed % SEED_LIMIT}")


def _check_rates(self: TrainerConfig):
    for name in ("learning_rate", "adam_eps"):
        value = getattr(self, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be a finite number > 0")
    for name in ("learning_rate", "critic_learning_rate"):  # legal, but almost surely a mistake
        value = getattr(self, name)
        if value is not None and value > 1:
            import warnings

            warnings.warn(f"TrainerConfig.{name}={value!r} is above 1: Adam steps each parameter by about that much "
                          "per update, which destroys a pretrained model at once (typical: 1e-6 to 1e-4 for "
                          "language models)", UserWarning, stacklevel=4)
    for name in ("critic_learning_rate", "kl_target", "max_grad_norm", "score_clip", "missing_eos_penalty"):
        value = getattr(self, name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or (name != "missing_eos_penalty" and value <= 0)):
            raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be None or a finite number"
                             + ("" if name == "missing_eos_penalty" else " > 0"))


SEED_LIMIT = 2 ** 32  # seeds are in [0, SEED_LIMIT): what jax.random.key keeps of an int


OVERLONG_PROMPTS = ("error", "truncate", "filter")


def _check_overlong(self: TrainerConfig):
    if self.overlong_prompts is not None and self.overlong_prompts not in OVERLONG_PROMPTS:
        raise ValueError(f"TrainerConfig.overlong_prompts={self.overlong_prompts!r} is invalid: what a prompt longer "
                         f"than query_length gets is one of {', '.join(map(repr, OVERLONG_PROMPTS))}")
    if self.truncate_prompts and self.overlong_prompts not in (None, "truncate"):
        raise ValueError(f"TrainerConfig.truncate_prompts=True and overlong_prompts={self.overlong_prompts!r} "
                         "disagree; set one of them (truncate_prompts=True is overlong_prompts='truncate')")


def _check_sampling(self: TrainerConfig):
    """The sampling settings (a list given for a tuple becomes the tuple)."""
    def bad(name, valid):
        return ValueError(f"TrainerConfig.{name}={getattr(self, name)!r} is invalid: {name} must be {valid}")

    for name, kind in (("stop_token_ids", int), ("stop_strings", str)):
        value = getattr(self, name)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise bad(name, "a list of " + ("token ids >= 0" if kind is int else "non-empty strings"))
        value = tuple(value)
        if kind is int and not all(is_int(v) and v >= 0 for v in value):
            raise bad(name, "a list of token ids >= 0")
        if kind is str and not all(isinstance(v, str) and v for v in value):
            raise bad(name, "a list of non-empty strings (the completion ends where its text first holds one)")
        object.__setattr__(self, name, value)
    if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
        raise bad("top_k", "None or 0 (off), or a positive int (the most likely tokens kept)")
    if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
        raise bad("top_p", "a number in (0, 1] (1.0: off)")
    if self.min_p is not None and (not isinstance(self.min_p, (int, float)) or isinstance(self.min_p, bool)
                                   or not 0.0 <= self.min_p < 1.0):
        raise bad("min_p", "None or 0 (off), or a number in (0, 1)")
    r = self.repetition_penalty
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0.0 < r < math.inf:
        raise bad("repetition_penalty", "a finite number > 0 (1.0: off; above 1 discourages repeats)")


def _check_inflight(self: TrainerConfig):
    if self.inflight_updates is None:
        return
    if self.inflight_updates not in ("keep", "recompute"):
        raise ValueError(f"TrainerConfig.inflight_updates={self.inflight_updates!r} is invalid; valid: None (each "
                         "iteration sampled from one version), 'keep' or 'recompute' (what happens to a row's KV "
                         "cache when new parameters arrive)")
    engine = engine_class(self.rollout_engine, self.num_slots)
    takes = engine.capabilities.inflight_updates
    needs = [what for what, missing in (
        ("max_staleness >= 1", not self.max_staleness),
        ("num_slots (the continuous sampler)" if self.rollout_engine == BUILT_IN else
         f"a rollout engine that takes weights while it decodes ({engine.__name__} does not)", not takes),
        ("dynamic_sampling=False", self.dynamic_sampling)) if missing]
    if needs:
        raise ValueError(f"TrainerConfig.inflight_updates={self.inflight_updates!r} takes new parameters between "
                         f"the rollout engine's decode steps while the trainer updates; it needs "
                         f"{', '.join(needs)}")


def _check_watching(self: TrainerConfig):
    """Evaluation, checkpoint and resume settings."""
    if self.resume_from is not None and (not isinstance(self.resume_from, str) or not self.resume_from):
        raise ValueError(f"TrainerConfig.resume_from={self.resume_from!r} is invalid: None, or the path of a run "
                         "directory or of one of its checkpoints (<run>/checkpoints/<step>)")
    if self.resume_from is not None and not self.resume:
        raise ValueError("TrainerConfig.resume_from is given with resume=False: resume_from starts this run from "
                         "another's checkpoint, which is a resume; drop one of them")
    if self.eval_before_training is not None and not isinstance(self.eval_before_training, bool):
        raise ValueError(f"TrainerConfig.eval_before_training={self.eval_before_training!r} is invalid: None (on "
                         "when eval prompts are given), True or False")
    if self.best_metric is not None and (not isinstance(self.best_metric, str)
                                         or not self.best_metric.startswith("eval/")):
        raise ValueError(f"TrainerConfig.best_metric={self.best_metric!r} is invalid: the best checkpoint is chosen "
                         "by an evaluation's metric, a name starting with 'eval/' (eval/reward_mean, "
                         "eval/pass@1, eval/rewards/<function>/mean, ...), or None")
    if self.best_metric_mode not in ("max", "min"):
        raise ValueError(f"TrainerConfig.best_metric_mode={self.best_metric_mode!r} is invalid; valid: 'max' "
                         "(higher is better), 'min'")
    t = self.eval_temperature
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
        raise ValueError(f"TrainerConfig.eval_temperature={t!r} is invalid: None (PPOConfig.temperature), 0 "
                         "(greedy) or a finite number > 0")


def _check_optimizer(self: TrainerConfig):
    """The optimizer's settings against the ranges their formulas allow."""
    def number(name):
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"TrainerConfig.{name}={value!r} is invalid: {name} must be a finite number")
        return value

    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= number(name) < 1:
            raise ValueError(f"TrainerConfig.{name}={getattr(self, name)!r} is invalid: a beta must be in [0, 1)")
    if number("weight_decay") < 0:
        raise ValueError(f"TrainerConfig.weight_decay={self.weight_decay!r} is invalid: it must be >= 0 (0: Adam)")
    if self.weight_decay_mask not in ("matrices", "all"):
        raise ValueError(f"TrainerConfig.weight_decay_mask={self.weight_decay_mask!r} is invalid; valid: 'matrices' "
                         "(linear layers' kernels and LoRA matrices), 'all'")
    if not 0 <= number("min_lr_ratio") < 1:
        raise ValueError(f"TrainerConfig.min_lr_ratio={self.min_lr_ratio!r} is invalid: it must be in [0, 1)")
    if self.min_lr_ratio and self.lr_schedule != "cosine_with_min_lr":
        raise ValueError(f"TrainerConfig.min_lr_ratio={self.min_lr_ratio} is read by lr_schedule="
                         f"'cosine_with_min_lr' only; lr_schedule is {self.lr_schedule!r}")
    if not 0 <= number("warmup_ratio") < 1:
        raise ValueError(f"TrainerConfig.warmup_ratio={self.warmup_ratio!r} is invalid: it must be in [0, 1)")
    if self.warmup_ratio and self.warmup_updates:
        raise ValueError(f"TrainerConfig.warmup_ratio={self.warmup_ratio} and warmup_updates={self.warmup_updates} "
                         "both set the warm-up; give one")
