"""Reward functions as users write them: several, weighted, called on decoded text with
the prompt dataset's other columns.

    def correct(prompts, completions, answer, **_):     # `answer`: a dataset column
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

Each function is called as `f(prompts, completions, **columns)` with the columns it
accepts (by name, or all of them through `**kwargs`; `trainer_state` too, where it names
it), for the rows of the iteration; `async def` functions run concurrently. It returns one
number per completion (or a dict of named parts, summed); None means "no opinion on this row": the row is left
out of that function's statistics and adds nothing to the weighted sum (a row that no
function scored is an error). A NaN, an inf, a
wrong length or type, or an exception is a `RewardError` naming the function, iteration
and row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from jaxppo.errors import RewardError
from jaxppo.models.model import describe_model, is_model_spec

__all__ = ["RewardFunction", "HostRewards", "Scored", "reward_name", "RewardSetup", "sort_rewards", "accepted_columns",
           "required_columns", "check_signature",
           "check_scores", "nonfinite_rows", "qualified_name", "HostScores", "load_callable"]


def reward_name(fn) -> str:
    """A short name for metrics: the function's `__name__` (or its class's)."""
    return getattr(fn, "__name__", None) or type(fn).__name__


class RewardFunction(NamedTuple):
    name: str
    fn: Callable
    weight: float


class Scored(NamedTuple):
    """What `HostRewards` returns: the combined scores float32 (B,); per function (and per
    part of a function that returns a dict) {name: (values float64 (B,), given bool (B,))};
    each function's wall time in seconds {name: seconds}."""

    total: np.ndarray
    per_function: dict
    times: dict


class HostRewards:
    """The text reward functions of a run and their weights.

    `__call__(iteration, prompts, completions, columns)` returns a `Scored`: the weighted sum
    over functions of the rows they scored, each function's values and the rows it scored,
    and its time. `async def` functions run concurrently (on one event loop, the others in
    threads beside them); without any, the functions run one after another, as written.
    A function that accepts `trainer_state` receives {"iteration", "updates"} (the updates
    applied before this iteration: `updates_per_iteration` per iteration). A function may
    return a dict of named parts (each a list of numbers or None): its value is their sum,
    and each part is reported as `<name>/<part>`."""

    def __init__(self, functions: Sequence[RewardFunction], updates_per_iteration: int = 0):
        self.functions = list(functions)
        self.updates_per_iteration = updates_per_iteration
        self._accepts = {f.name: accepted_columns(f.fn) for f in self.functions}
        self._async = any(_is_async(f.fn) for f in self.functions)

    def check_columns(self, columns, what: str = "the prompts"):
        """A `ValueError` naming the function and the parameter where a function needs a
        column (a parameter without a default besides prompts, completions and
        `trainer_state`) that `columns` (the names the prompts have) lacks: found before
        anything compiles, not at the first scoring."""
        for f in self.functions:
            missing = sorted(required_columns(f.fn) - set(columns) - {"trainer_state"})
            if missing:
                raise ValueError(f"reward function {f.name!r} ({qualified_name(f.fn)}) needs the column(s) {missing}, "
                                 f"which {what} lack (their columns: {sorted(columns)}); add them to the prompts (a "
                                 ".jsonl field, a dataset column, a key of each record), or give the parameter a "
                                 "default")

    def _kwargs(self, f, columns: dict, iteration: int) -> dict:
        accepts = self._accepts[f.name]
        kwargs = {k: v for k, v in columns.items() if accepts is None or k in accepts}
        if accepts is not None and "trainer_state" in accepts:
            kwargs["trainer_state"] = {"iteration": iteration, "updates": iteration * self.updates_per_iteration}
        return kwargs

    def _raised(self, f, iteration, prompts, kwargs, err):
        return RewardError(f"iteration {iteration}: reward function {f.name!r} raised {type(err).__name__}: {err} "
                           f"(called on {len(prompts)} completions; first prompt {prompts[0][:40]!r}; columns passed: "
                           f"{sorted(k for k in kwargs if k != 'trainer_state')}); nothing was updated")

    def _call_all(self, iteration: int, prompts: list, completions: list, columns: dict):
        """[(raw result, seconds)] in the functions' order."""
        calls = [(f, self._kwargs(f, columns, iteration)) for f in self.functions]
        if not self._async:
            out = []
            for f, kwargs in calls:
                t = time.perf_counter()
                try:
                    out.append((f.fn(prompts, completions, **kwargs), time.perf_counter() - t))
                except Exception as err:
                    raise self._raised(f, iteration, prompts, kwargs, err) from err
            return out

        async def one(f, kwargs):
            t = time.perf_counter()
            try:
                if _is_async(f.fn):
                    raw = await f.fn(prompts, completions, **kwargs)
                else:
                    raw = await asyncio.to_thread(f.fn, prompts, completions, **kwargs)
            except Exception as err:
                raise self._raised(f, iteration, prompts, kwargs, err) from err
            return raw, time.perf_counter() - t

        async def gather():
            return await asyncio.gather(*(one(f, kwargs) for f, kwargs in calls))

        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: the usual case
            return asyncio.run(gather())
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from inside a running loop (a notebook)
            return pool.submit(asyncio.run, gather()).result()

    def __call__(self, iteration: int, prompts: list, completions: list, columns: dict) -> Scored:
        total = np.zeros(len(prompts), np.float32)
        per_function, times = {}, {}
        for f, (raw, seconds) in zip(self.functions, self._call_all(iteration, prompts, completions, columns)):
            label = f"reward function {f.name!r}"
            try:
                values, given, parts = _function_values(raw, len(prompts), label, prompts, completions)
            except RewardError as err:
                raise RewardError(f"iteration {iteration}: {err}; nothing was updated") from None
            per_function[f.name] = (values.astype(np.float64), given)
            per_function.update({f"{f.name}/{part}": v for part, v in parts.items()})
            times[f.name] = seconds
            total = total + np.where(given, np.float32(f.weight) * values, np.float32(0.0))
        scored = np.any([per_function[f.name][1] for f in self.functions], axis=0)
        if not scored.all():
            i = int(np.flatnonzero(~scored)[0])
            who = (f"reward function {self.functions[0].name!r}" if len(self.functions) == 1
                   else f"every reward function ({', '.join(f.name for f in self.functions)})")
            raise RewardError(f"iteration {iteration}: {who} returned None at row {i} (prompt {prompts[i][:40]!r}, "
                              f"response {completions[i][:40]!r}): every response needs a score from at least one "
                              f"reward function (None means no opinion); {int((~scored).sum())} such rows; nothing "
                              "was updated")
        return Scored(total, per_function, times)


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _function_values(raw, batch: int, label: str, prompts, completions):
    """(values float32 (B,), given bool (B,), {part: (values float64, given)}) of what a
    function returned: scores, or a dict of named parts whose sum is its value."""
    if not isinstance(raw, dict):
        values, given = check_scores(raw, batch, label, prompts, completions, allow_none=True)
        return values, given, {}
    if not raw or not all(isinstance(k, str) for k in raw):
        raise RewardError(f"{label} returned a dict with keys {list(raw)[:5]!r}; a dict return names its parts (str "
                          "keys, at least one), each a list of numbers or None")
    values, given, parts = np.zeros(batch, np.float32), np.zeros(batch, bool), {}
    for part, scores in raw.items():
        v, g = check_scores(scores, batch, f"{label} (part {part!r})", prompts, completions, allow_none=True)
        parts[part] = (v.astype(np.float64), g)
        values, given = values + np.where(g, v, np.float32(0.0)), given | g
    return values, given, parts


def _column_parameters(fn, skip: int):
    """(every parameter of `fn`, those after its first `skip` positional ones that can take
    a column by name); None where its signature cannot be read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return params, positional[skip:] + [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def accepted_columns(fn, skip: int = 2):
    """The keyword names `fn` takes besides its first `skip` positional parameters
    ((prompts, completions) for a reward function, (prompt,) for an environment's `reset`);
    None: all (**kwargs or a signature that cannot be read)."""
    read = _column_parameters(fn, skip)
    if read is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in read[0]):
        return None
    return {p.name for p in read[1]}


def check_signature(fn, positional: int, what: str, call: str) -> None:
    """A `ValueError` naming `what` (the function and where it was given) unless `fn` can be
    called with `positional` positional arguments (`call` shows the call it receives): a
    function that takes fewer, or that requires more positional-only ones, is refused
    before anything compiles. A signature that cannot be read (a builtin) passes."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return
    P = inspect.Parameter
    takes = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    variadic = any(p.kind is P.VAR_POSITIONAL for p in params)
    stranded = [p.name for p in takes[positional:] if p.kind is P.POSITIONAL_ONLY and p.default is P.empty]
    if (len(takes) < positional and not variadic) or stranded:
        signature = f"{getattr(fn, '__name__', type(fn).__name__)}{inspect.signature(fn)}"
        why = (f"it takes {len(takes)} positional parameter(s)" if not stranded else
               f"its positional-only parameter(s) {stranded} cannot be given")
        raise ValueError(f"{what} {qualified_name(fn)} cannot take the call it gets, {call}: {signature}: {why}; "
                         "change its parameters")


def required_columns(fn, skip: int = 2) -> set:
    """The keyword names `fn` needs (no default) besides its first `skip` positional
    parameters; empty where its signature cannot be read."""
    read = _column_parameters(fn, skip)
    return set() if read is None else {p.name for p in read[1] if p.default is inspect.Parameter.empty}


@dataclasses.dataclass(frozen=True)
class RewardSetup:
    """The rewards of a run, sorted: the reward model (a checkpoint path or `(Model,
    params)`, or None) and its weight, the text functions (scored on the host), a jittable
    token function (or None), what `reward_fn` was called on ("text" or "tokens"), and
    whether the run used the single-reward arguments (`legacy`: its settings keep their
    older layout, so such runs resume)."""

    model_spec: Any
    host: tuple
    token_fn: Optional[Callable]
    model_weight: float
    on: str
    legacy: bool

    def host_rewards(self, updates_per_iteration: int = 0) -> Optional["HostRewards"]:
        return HostRewards(self.host, updates_per_iteration) if self.host else None

    def describe(self, model, dtype) -> dict:
        """The reward's identity for the run settings."""
        if self.legacy:
            if model is not None:
                return describe_model(self.model_spec, model, dtype)
            fn = self.token_fn if self.token_fn is not None else self.host[0].fn
            return {"function": qualified_name(fn), "on": self.on}
        out = {"functions": [{"function": qualified_name(f.fn), "name": f.name, "weight": f.weight}
                             for f in self.host]}
        if model is not None:
            out["model"] = describe_model(self.model_spec, model, dtype)
            out["model_weight"] = self.model_weight
        return out

    def source(self) -> str:
        """What produced the scores, for error messages."""
        if self.model_spec is not None and not self.host:
            return "the reward model"
        if self.host:
            names = [f.name for f in self.host]
            what = (f"reward function {qualified_name(self.host[0].fn)!r}" if len(names) == 1
                    else f"the reward functions {names}")
            return what + (" with the reward model" if self.model_spec is not None else "")
        if self.token_fn is not None:
            return f"token reward function {qualified_name(self.token_fn)!r}"
        return "the environment"


def sort_rewards(reward_model, reward_fns, reward_fn_on: str, reward_weights, environment: bool = False,
                 what: str = "reward_fns") -> "RewardSetup":
    """Sort the trainer's reward arguments into a `RewardSetup`: `reward_model` (a checkpoint
    path or `(Model, params)`), `reward_fns` (one function, or a list of functions of which
    one may be a reward model) called on `reward_fn_on` ("text", or "tokens": one jittable
    function), and `reward_weights` (one per entry of the list). Errors name what was
    wrong. With an `environment` (whose rewards score the episodes) none is needed."""
    if reward_fn_on not in ("text", "tokens"):
        raise ValueError(f"reward_fn_on={reward_fn_on!r} is invalid; valid: 'text', 'tokens'")
    bare = reward_fns is not None and not isinstance(reward_fns, (list, tuple))
    if bare and not callable(reward_fns):
        raise ValueError(f"{what} must be a function or a non-empty list of functions (one may be a reward model); "
                         f"got {reward_fns!r:.80}")
    if reward_fns is not None and not bare and not reward_fns:
        raise ValueError(f"{what} must be a non-empty list of functions (one may be a reward model); got "
                         f"{reward_fns!r:.80}")
    entries = [] if reward_fns is None else [reward_fns] if bare else list(reward_fns)
    if reward_fn_on == "tokens" and (len(entries) != 1 or not callable(entries[0]) or is_model_spec(entries[0])):
        raise ValueError(f"reward_fn_on='tokens' takes one jittable function as {what} (fn(prompt_ids, prompt_mask, "
                         "response_ids, response_mask) -> (B,)); text reward functions are called on text")
    weights = _weights(reward_weights, entries, bare or reward_fns is None, what)
    model_weight = 1.0
    fns = []
    for entry, weight in zip(entries, weights):
        if is_model_spec(entry):
            if reward_model is not None:
                raise ValueError(f"one reward model at most: reward_model and a model in {what} were both given")
            reward_model, model_weight = entry, weight
        elif callable(entry):
            fns.append((entry, weight))
        else:
            raise ValueError(f"{what} entry {entry!r:.60} is neither a function nor a reward model (a checkpoint "
                             "path or a (Model, params) pair)")
    if reward_model is None and not fns and not environment:
        raise ValueError(f"give a reward: reward_model (a reward model) or {what} (a function, or a list of "
                         "functions one of which may be a reward model)")
    if bare and reward_model is not None:
        raise ValueError(f"give reward_model or one function as {what}; to combine them, list both in {what} "
                         f"({what}=[function, reward model])")
    token_fn = None
    if reward_fn_on == "tokens":
        token_fn, fns = fns[0][0], []
        check_signature(token_fn, 4, "the token-level reward function",
                        "fn(prompt_ids, prompt_mask, response_ids, response_mask)")
    for fn, _ in fns:
        check_signature(fn, 2, "the reward function", "f(prompts, completions, **columns)")
    names = {}
    host = []
    for fn, weight in fns:
        name = reward_name(fn)
        names[name] = names.get(name, 0) + 1
        host.append(RewardFunction(name if names[name] == 1 else f"{name}_{names[name]}", fn, float(weight)))
    # One source given bare (a function, or a reward model alone) keeps 0.4's record of the
    # reward (a run resumes with the same settings); a list records each entry and weight.
    legacy = (bare or reward_fns is None) and (reward_model is not None or token_fn is not None or bool(host))
    return RewardSetup(reward_model, tuple(host), token_fn, float(model_weight), reward_fn_on, legacy=legacy)


def _weights(reward_weights, entries: list, bare: bool, what: str) -> list:
    if reward_weights is None:
        return [1.0] * len(entries)
    if bare:
        raise ValueError(f"reward_weights needs {what} as a list (one weight per entry)")
    weights = list(reward_weights)
    if len(weights) != len(entries):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(entries)} {what}; give one weight per "
                         "entry, in the same order")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w):
            raise ValueError(f"reward_weights[{i}]={w!r} is invalid: a weight must be a finite number")
    return weights


def qualified_name(fn) -> str:
    if fn is None:
        return "None"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def check_scores(scores, batch: int, name: str = "reward function", prompts=None, responses=None,
                 allow_none: bool = False):
    """Validate what a host-side reward function returned: one real number (int, float,
    numpy scalar or 0-d array) per response, `batch` of them, as a list, tuple or 1-D array.
    Returns float32 (batch,). Non-finite numbers pass through (the trainer reports or skips
    them for every kind of reward alike). With `allow_none`, None means "no opinion on this
    row": returns (scores with 0 there, given: bool (batch,) False there).

    Raises `RewardError` naming the function (`name`), the row and the value, and the row's
    prompt and response when given."""

    def row_text(i):
        if prompts is None or responses is None:
            return ""
        return f" (prompt {prompts[i][:40]!r}, response {responses[i][:40]!r})"

    if isinstance(scores, jax.Array):  # a JAX array is taken as the NumPy array it holds
        scores = np.asarray(scores)
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise RewardError(f"{name} returned a {type(scores).__name__} ({scores!r:.60}); it must return a list or 1-D "
                          f"array of {batch} numbers, one per response")
    if isinstance(scores, np.ndarray) and scores.ndim != 1:
        raise RewardError(f"{name} returned an array of shape {scores.shape}; expected ({batch},): one number per "
                          "response")
    if len(scores) != batch:
        raise RewardError(f"{name} returned {len(scores)} scores for {batch} responses; expected ({batch},): one "
                          "number per response")
    out = np.empty(batch, np.float32)
    given = np.ones(batch, bool)
    for i, value in enumerate(scores):
        if value is None and allow_none:
            out[i], given[i] = 0.0, False
            continue
        if value is None:
            raise RewardError(f"{name} returned None at row {i}{row_text(i)}: every response needs a score (a reward "
                              "function with no opinion on a row must still return a number for it)")
        if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:  # a 0-d array (NumPy's or JAX's)
            value = np.asarray(value).item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise RewardError(f"{name} returned {value!r:.60} ({type(value).__name__}) at row {i}{row_text(i)}; "
                              "each score must be a real number (int or float)")
        out[i] = float(value)
    return (out, given) if allow_none else out


def nonfinite_rows(scores) -> np.ndarray:
    """Indices of the non-finite entries of (B,) scores (on the host)."""
    return np.flatnonzero(~np.isfinite(np.asarray(scores, np.float64)))


class HostScores(NamedTuple):
    """Scores from the text reward functions: float32 (B,) on the device (or None without
    text rewards), per function {name: (values (B,), given (B,))} on the host, the count of
    sampled token ids the tokenizer does not know, and each function's time in seconds."""

    scores: Optional[jax.Array]
    per_function: dict
    unknown_tokens: int
    times: dict = {}


def load_callable(text: str, flag: str = "--reward", form: str = "MODULE:FN") -> Callable:
    """`MODULE:NAME` (a module on the Python path and a callable in it, `NAME` may be
    dotted) -> the callable. ValueError naming `flag`, what was wrong and the expected
    `form`, before anything is built."""
    import importlib

    if not isinstance(text, str) or text.count(":") != 1 or not all(text.split(":")):
        raise ValueError(f"{flag} {text!r} is invalid: expected {form}, e.g. mypackage.module:{form.split(':')[1].lower()}")
    module_name, attr = text.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {text!r}: cannot import module {module_name!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 - a SyntaxError, or anything the module raised while it was imported
        where = f" ({err.filename}, line {err.lineno})" if isinstance(err, SyntaxError) and err.filename else ""
        raise ValueError(f"{flag} {text!r}: importing module {module_name!r} failed: {type(err).__name__}: "
                         f"{getattr(err, 'msg', None) or err}{where}; fix the module, then run again") from None
    found = module
    for part in attr.split("."):
        found = getattr(found, part, None)
    if not callable(found):
        raise ValueError(f"{flag} {text!r}: module {module_name!r} has no callable {attr!r}")
    return found
