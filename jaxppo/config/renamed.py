"""The settings of 0.4 that said one thing twice, each now one setting, and `translate`,
which reads the old spellings as the new ones (with a `DeprecationWarning` naming each, for
one release: removed in 0.6). The run settings a directory of 0.4 recorded are read through
it too (`jaxppo.config.record`):

    truncate_prompts=True        -> overlong_prompts="truncate"       (DataConfig)
    tensorboard=False            -> report_to without "tensorboard"   (RunConfig)
    total_episodes=n             -> iterations=n // batch_size         (RunConfig)
    warmup_ratio=r               -> warmup_updates=r (a float: a fraction of the updates)
    stop_token_id=i              -> stop_tokens=(i, ...) in place of "eos"  (SamplingConfig)
    stop_token_ids=(j, ...)      -> stop_tokens=("eos", j, ...)

and the names that said two things alike, renamed in 0.5 (`RENAMED`):

    kl_target                    -> adaptive_kl_target        (KLConfig; beside target_kl, the early stop)
    skip_nonfinite               -> skip_nonfinite_updates    (BatchConfig; beside skip_nonfinite_scores)
"""

from __future__ import annotations

import math
import warnings
from typing import Mapping

from jaxppo.config.run import RunConfig
from jaxppo.update.minibatches import BatchConfig

__all__ = ["DEPRECATED", "OLD_DEFAULTS", "RENAMED", "translate"]

# {old name: new name} of the settings renamed in 0.5 (the same meaning, another name)
RENAMED = {"kl_target": "adaptive_kl_target", "skip_nonfinite": "skip_nonfinite_updates"}

# {deprecated name: its replacement, as the warning says it}
DEPRECATED = {
    "truncate_prompts": "overlong_prompts='truncate' (DataConfig)",
    "tensorboard": "report_to without 'tensorboard' (RunConfig)",
    "total_episodes": "iterations = total_episodes / batch_size (RunConfig)",
    "warmup_ratio": "warmup_updates=<the same float> (OptimizerConfig: a float in (0, 1) is a fraction of the "
                    "run's updates)",
    "stop_token_id": "stop_tokens=(<id>, ...) in place of 'eos' (SamplingConfig)",
    "stop_token_ids": "stop_tokens=('eos', <ids>...) (SamplingConfig)",
    "kl_target": "adaptive_kl_target (KLConfig: the adaptive controller's target, not target_kl's early stop)",
    "skip_nonfinite": "skip_nonfinite_updates (BatchConfig; skip_nonfinite_scores is RewardConfig's)",
}
# The old defaults of the deprecated names (given as these, they say nothing).
OLD_DEFAULTS = {"truncate_prompts": False, "tensorboard": True, "total_episodes": None, "warmup_ratio": 0.0,
                 "stop_token_id": None, "stop_token_ids": (), "overlong_prompts": None, "kl_target": None,
                 "skip_nonfinite": True}


def translate(settings: Mapping, *, warn: bool = False, base=None, stacklevel: int = 3) -> dict:
    """`settings` by name with the deprecated spellings turned into the new ones (`DEPRECATED`;
    with `warn`, one `DeprecationWarning` naming each). `base`: the `jaxppo.Config` the
    settings change (a resumed run's, `Config.replace`'s), read where a translation needs a
    setting not given (the batch size for `total_episodes`, the trackers for
    `tensorboard`). A deprecated name contradicting its new one is a `ValueError`."""
    out = dict(settings)
    old = {name: out.pop(name) for name in list(out) if name in DEPRECATED}
    if out.get("overlong_prompts", "given") is None:  # 0.4's default for "error, unless truncate_prompts"
        out.pop("overlong_prompts")
    said = [name for name, value in old.items() if not _is_old_default(name, value)]
    base = base if base is not None else _Defaults()
    if old.get("truncate_prompts"):
        if not isinstance(old["truncate_prompts"], bool):
            raise ValueError(f"truncate_prompts={old['truncate_prompts']!r} is invalid: a bool (deprecated: use "
                             "overlong_prompts='truncate')")
        if out.get("overlong_prompts", "truncate") != "truncate":
            raise ValueError(f"truncate_prompts=True and overlong_prompts={out['overlong_prompts']!r} disagree; set one "
                             "of them (truncate_prompts=True is overlong_prompts='truncate')")
        out["overlong_prompts"] = "truncate"
    elif "truncate_prompts" in old and not isinstance(old["truncate_prompts"], bool):
        raise ValueError(f"truncate_prompts={old['truncate_prompts']!r} is invalid: a bool")
    for name, new in RENAMED.items():
        if name in old:
            if new in out and out[new] != old[name]:
                raise ValueError(f"{name}={old[name]!r} and {new}={out[new]!r} disagree; give {new} alone ({name} is "
                                 "its name before 0.5)")
            out[new] = old[name]
    if "tensorboard" in old:
        _tensorboard(old["tensorboard"], out, base)
    if old.get("total_episodes") is not None:
        _total_episodes(old["total_episodes"], out, base)
    if old.get("warmup_ratio"):
        ratio = old["warmup_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or not 0 <= ratio < 1:
            raise ValueError(f"warmup_ratio={ratio!r} is invalid: it must be in [0, 1) (deprecated: give warmup_updates "
                             "that float)")
        if out.get("warmup_updates"):
            raise ValueError(f"warmup_ratio={ratio} and warmup_updates={out['warmup_updates']} both set the warm-up; "
                             "give one (warmup_updates takes a fraction of the run's updates as a float in (0, 1))")
        out["warmup_updates"] = float(ratio)
    if old.get("stop_token_id") is not None or old.get("stop_token_ids"):
        if "stop_tokens" in out:
            raise ValueError("stop_tokens and the deprecated stop_token_id / stop_token_ids were both given; give "
                             "stop_tokens alone")
        first = old.get("stop_token_id")
        extra = old.get("stop_token_ids") or ()
        extra = (extra,) if isinstance(extra, int) and not isinstance(extra, bool) else tuple(extra)
        out["stop_tokens"] = ("eos" if first is None else first, *extra)
    if warn and said:
        warnings.warn("deprecated since 0.5 (removed in 0.6): " + "; ".join(f"{n} -> {DEPRECATED[n]}" for n in said),
                      DeprecationWarning, stacklevel=stacklevel)
    return out


def _is_old_default(name: str, value) -> bool:
    default = OLD_DEFAULTS[name]
    return value == default and type(value) is type(default) or (value is None and default is None)


class _Defaults:
    """A stand-in for a `Config` at its defaults, for what `translate` reads of one."""

    batch = BatchConfig()
    run = RunConfig()


def _tensorboard(value, out: dict, base) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"tensorboard={value!r} is invalid: tensorboard must be a bool (True or False) (deprecated: "
                         "leave 'tensorboard' out of report_to)")
    if value:
        return
    from jaxppo.tracking import parse_report_to

    names = parse_report_to(out.get("report_to", base.run.report_to), "RunConfig.report_to")
    out["report_to"] = ",".join(n for n in names if n != "tensorboard")


def _total_episodes(value, out: dict, base) -> None:
    from jaxppo.update.checks import is_int

    batch = out.get("batch_size", base.batch.batch_size)
    if not is_int(value) or value <= 0:
        raise ValueError(f"total_episodes={value!r} is invalid: total_episodes must be None or a positive int "
                         "(deprecated: give iterations)")
    if is_int(batch) and batch > 0 and value % batch:
        raise ValueError(f"total_episodes={value} is not a multiple of BatchConfig.batch_size={batch} (deprecated: "
                         "give iterations)")
    if "iterations" in out and out["iterations"] != value // batch:
        raise ValueError(f"total_episodes={value} and iterations={out['iterations']} disagree; give iterations alone")
    out["iterations"] = value // batch
