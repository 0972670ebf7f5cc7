"""Reward functions as users write them: several, weighted, called on decoded text with
the prompt dataset's other columns.

    def correct(prompts, completions, answer, **_):     # `answer`: a dataset column
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

Each function is called as `f(prompts, completions, **columns)` with the columns it
accepts (by name, or all of them through `**kwargs`), for the rows of the iteration. It
returns one number per completion; None means "no opinion on this row": the row is left
out of that function's statistics and adds nothing to the weighted sum (a row that no
function scored is an error). A NaN, an inf, a
wrong length or type, or an exception is a `RewardError` naming the function, iteration
and row.
"""

from __future__ import annotations

import inspect
from typing import Callable, NamedTuple, Sequence

import numpy as np

from jaxppo.rollout import RewardError, check_scores

__all__ = ["RewardFunction", "HostRewards", "reward_name"]


def reward_name(fn) -> str:
    """A short name for metrics: the function's `__name__` (or its class's)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardFunction(NamedTuple):
    name: str
    fn: Callable
    weight: float


class HostRewards:
    """The text reward functions of a run and their weights.

    `__call__(iteration, prompts, completions, columns)` returns (scores, per_function):
    scores float32 (B,), the weighted sum over functions of the rows they scored;
    per_function {name: (values float64 (B,), given bool (B,))}."""

    def __init__(self, functions: Sequence[RewardFunction]):
        self.functions = list(functions)
        self._accepts = {f.name: _accepted_columns(f.fn) for f in self.functions}

    def __call__(self, iteration: int, prompts: list, completions: list, columns: dict):
        total = np.zeros(len(prompts), np.float32)
        per_function = {}
        for f in self.functions:
            accepts = self._accepts[f.name]
            kwargs = {k: v for k, v in columns.items() if accepts is None or k in accepts}
            label = f"reward function {f.name!r}"
            try:
                raw = f.fn(prompts, completions, **kwargs)
            except Exception as err:
                raise RewardError(f"iteration {iteration}: {label} raised {type(err).__name__}: {err} (called on "
                                  f"{len(prompts)} completions; first prompt {prompts[0][:40]!r}; columns passed: "
                                  f"{sorted(kwargs)}); nothing was updated") from err
            try:
                values, given = check_scores(raw, len(prompts), label, prompts, completions, allow_none=True)
            except RewardError as err:
                raise RewardError(f"iteration {iteration}: {err}; nothing was updated") from None
            per_function[f.name] = (values.astype(np.float64), given)
            total = total + np.where(given, np.float32(f.weight) * values, np.float32(0.0))
        scored = np.any([given for _, given in per_function.values()], axis=0)
        if not scored.all():
            i = int(np.flatnonzero(~scored)[0])
            who = (f"reward function {self.functions[0].name!r}" if len(self.functions) == 1
                   else f"every reward function ({', '.join(f.name for f in self.functions)})")
            raise RewardError(f"iteration {iteration}: {who} returned None at row {i} (prompt {prompts[i][:40]!r}, "
                              f"response {completions[i][:40]!r}): every response needs a score from at least one "
                              f"reward function (None means no opinion); {int((~scored).sum())} such rows; nothing "
                              "was updated")
        return total, per_function


def _accepted_columns(fn):
    """The keyword names `fn` takes besides (prompts, completions); None: all (**kwargs or
    a signature that cannot be read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    named = positional[2:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return {p.name for p in named}
