"""The run around the iterations: its length, output, checkpoints and trackers
(`RunConfig`), its prompts (`DataConfig`) and its evaluation (`EvalConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

from jaxppo.config.fields import Concern, check_bools, check_counts, setting
from jaxppo.tracking import check_installed, parse_report_to
from jaxppo.update.checks import invalid

__all__ = ["RunConfig", "DataConfig", "EvalConfig", "SEED_LIMIT", "OVERLONG_PROMPTS"]

SEED_LIMIT = 2 ** 32  # seeds are in [0, SEED_LIMIT): what jax.random.key keeps of an int
OVERLONG_PROMPTS = ("error", "truncate", "filter")


@dataclasses.dataclass(frozen=True)
class RunConfig(Concern):
    """The run: its seed and length, where it writes, how often it logs, checkpoints and
    exports, and whether it resumes.

    Attributes:
      seed: the run's PRNG seed, in [0, 2**32) (what `jax.random.key` keeps).
      iterations: PPO iterations, each one rollout of `batch_size` completions. It may grow
        when a run resumes under a constant learning rate (extending the run).
      output_dir: the run directory: metrics.jsonl, checkpoints, the run's settings, exports.
      log_every: print every n-th iteration's metrics (without a progress bar).
      sample_every, num_samples: print (and log as the "completions" table) the first
        `num_samples` completions every `sample_every` iterations; 0: never.
      checkpoint_every: iterations between checkpoints; 0: only on interrupt and at the end.
      keep_checkpoints: how many checkpoints are kept (the newest).
      resume: continue from the latest checkpoint in `output_dir`; False refuses a
        directory that already holds a run.
      resume_from: another run's directory or one of its checkpoints
        (`<run>/checkpoints/<step>`): a new `output_dir` starts from it, with the same
        settings checks (`jaxppo.run.save_restore.adopt`).
      report_to: the experiment trackers (TRL's option): a comma-separated string or a list
        of "jsonl", "tensorboard", "wandb", "mlflow", "trackio", a name given to
        `jaxppo.tracking.register_tracker`, "all" or "none"; `<output_dir>/metrics.jsonl` is
        written whatever it says; a tracker whose package is missing is refused here.
      progress: a progress bar (tqdm) instead of metrics lines.
      export_final: the final policy as a Hugging Face directory (`final_policy/`; with LoRA
        also `final_adapter/`, PEFT's format).
      plot: a PNG of the run's curves (`metrics.png`).
      save_hf_every: a Hugging Face checkpoint of the policy (its PEFT adapter with LoRA)
        with the tokenizer every that many iterations under `<output_dir>/hf/iteration_<n>`;
        0: none.
      keep_hf: the newest of those kept; 0: all.
    """

    seed: int = 0
    iterations: int = setting(100, free=True)
    output_dir: str = setting("runs/jaxppo", free=True)
    log_every: int = setting(1, free=True)
    sample_every: int = setting(10, free=True)
    num_samples: int = setting(2, free=True)
    checkpoint_every: int = setting(0, free=True)
    keep_checkpoints: int = setting(2, free=True)
    resume: bool = setting(True, free=True)
    resume_from: Optional[str] = setting(None, free=True)
    report_to: Union[str, Tuple[str, ...]] = setting("jsonl,tensorboard", free=True)
    progress: bool = setting(True, free=True)
    export_final: bool = setting(True, free=True)
    plot: bool = setting(True, free=True)
    save_hf_every: int = setting(0, free=True)
    keep_hf: int = setting(2, free=True)

    def __post_init__(self):
        check_counts(self, ("iterations", "log_every", "keep_checkpoints"))
        check_counts(self, ("seed", "sample_every", "num_samples", "checkpoint_every", "save_hf_every", "keep_hf"),
                     least=0)
        if self.seed >= SEED_LIMIT:  # jax.random.key keeps 32 bits: 2**32 would be the run of seed 0
            raise ValueError(f"RunConfig.seed={self.seed!r} (--seed) is invalid: the run's PRNG key takes seeds in "
                             f"[0, 2**32) = [0, {SEED_LIMIT - 1}]; a larger one is cut to its low 32 bits, so it "
                             f"would repeat the run of seed {self.seed % SEED_LIMIT}")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise invalid("RunConfig", "output_dir", self.output_dir, "a non-empty path string")
        check_bools(self, ("resume", "progress", "export_final", "plot"))
        if self.resume_from is not None and (not isinstance(self.resume_from, str) or not self.resume_from):
            raise ValueError(f"RunConfig.resume_from={self.resume_from!r} is invalid: None, or the path of a run "
                             "directory or of one of its checkpoints (<run>/checkpoints/<step>)")
        if self.resume_from is not None and not self.resume:
            raise ValueError("RunConfig.resume_from is given with resume=False: resume_from starts this run from "
                             "another's checkpoint, which is a resume; drop one of them")
        names = parse_report_to(self.report_to, "RunConfig.report_to")
        check_installed(names, "RunConfig.report_to")
        object.__setattr__(self, "report_to", ",".join(names))  # a list given becomes its string

    @property
    def trackers(self) -> tuple:
        """The trackers the run reports to, "jsonl" first."""
        return tuple(self.report_to.split(","))


@dataclasses.dataclass(frozen=True)
class DataConfig(Concern):
    """The prompts: how they are read, rendered and padded.

    Attributes:
      query_length: prompts are left-padded to this many tokens.
      overlong_prompts: what a prompt longer than `query_length` gets: "error" (the
        default), "truncate" (its last `query_length` tokens are kept) or "filter" (left
        out, counted in `data/prompts_filtered`).
      stream_prompts: read and tokenize the prompts as the run reaches them, in the order
        given, instead of all up front and reshuffled every pass
        (`jaxppo.rollout.streams.PromptStream`; a generator, a `datasets.IterableDataset`
        or a `jaxppo.mix_prompts` mixture is always streamed).
      prompt_column: the column or field holding the prompts in datasets and JSON files. A
        prompt may be a list of chat messages ({"role", "content"} dicts), rendered with the
        tokenizer's chat template; reward functions then receive the messages.
      chat_template: None renders chat-message prompts with the tokenizer's template (an
        error when it has none); False refuses them; True is None made explicit.
      image_column: the column or field holding each prompt's images (one or a list) for a
        vision-language policy; the default "images" also finds a column named "image".
    """

    query_length: int = 32
    overlong_prompts: str = "error"
    stream_prompts: bool = False
    prompt_column: str = setting("prompt", free=True)  # compared on resume in the run's description
    chat_template: Optional[bool] = setting(None, free=True)
    image_column: str = setting("images", free=True)

    def __post_init__(self):
        check_counts(self, ("query_length",))
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"DataConfig.overlong_prompts={self.overlong_prompts!r} is invalid: what a prompt longer "
                             f"than query_length gets is one of {', '.join(map(repr, OVERLONG_PROMPTS))}")
        check_bools(self, ("stream_prompts",))
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            raise invalid("DataConfig", "prompt_column", self.prompt_column, "a non-empty column name")
        if not isinstance(self.image_column, str) or not self.image_column:
            raise invalid("DataConfig", "image_column", self.image_column, "a non-empty column name")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):
            raise invalid("DataConfig", "chat_template", self.chat_template, "None, True or False")


@dataclasses.dataclass(frozen=True)
class EvalConfig(Concern):
    """Evaluation during training (with `Trainer(eval_prompts=...)`; `jaxppo.run.evaluation`):
    `eval/...` metrics in the iteration's line, of the policy that sampled that iteration.

    Attributes:
      eval_every: an evaluation at every iteration i > 0 with i % eval_every == 0; 0: none
        but the first.
      eval_before_training: the evaluation at iteration 0, of the initial policy; None: on.
      eval_generations: completions per eval prompt (pass@k for k up to it when the rewards
        are 0 or 1).
      eval_temperature: None (`SamplingConfig.temperature`), 0 (greedy) or > 0.
      best_metric: an `eval/...` metric: the policy that scored best on it is kept in
        `<output_dir>/hf/best` (`hf/best.json` says which); None: none kept.
      best_metric_mode: "max" or "min": whether a higher or a lower `best_metric` is better.
    """

    eval_every: int = setting(0, free=True)
    eval_before_training: Optional[bool] = setting(None, free=True)
    eval_generations: int = setting(1, free=True)
    eval_temperature: Optional[float] = setting(None, free=True)
    best_metric: Optional[str] = setting(None, free=True)
    best_metric_mode: str = setting("max", free=True)

    def __post_init__(self):
        check_counts(self, ("eval_every",), least=0)
        check_counts(self, ("eval_generations",))
        if self.eval_before_training is not None and not isinstance(self.eval_before_training, bool):
            raise ValueError(f"EvalConfig.eval_before_training={self.eval_before_training!r} is invalid: None (on "
                             "when eval prompts are given), True or False")
        t = self.eval_temperature
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0):
            raise ValueError(f"EvalConfig.eval_temperature={t!r} is invalid: None (SamplingConfig.temperature), 0 "
                             "(greedy) or a finite number > 0")
        if self.best_metric is not None and (not isinstance(self.best_metric, str)
                                             or not self.best_metric.startswith("eval/")):
            raise ValueError(f"EvalConfig.best_metric={self.best_metric!r} is invalid: the best checkpoint is chosen "
                             "by an evaluation's metric, a name starting with 'eval/' (eval/reward_mean, "
                             "eval/pass@1, eval/rewards/<function>/mean, ...), or None")
        if self.best_metric_mode not in ("max", "min"):
            raise ValueError(f"EvalConfig.best_metric_mode={self.best_metric_mode!r} is invalid; valid: 'max' "
                             "(higher is better), 'min'")
