"""The tracker interface: where a run's metrics and tables go, and the rule on resume.

    tracker = tracker_class("mlflow")()
    tracker.start(TrackerRun(...))                  # before the first iteration of this process
    tracker.log(iteration, metrics)                 # every iteration, in order
    tracker.log_table(iteration, "completions", columns, rows)   # where tables are logged
    tracker.finish()

The resume rule. A run killed at any instant and resumed from its checkpoint at iteration
`s` starts its trackers again with `TrackerRun.start_iteration = s` and `history` (the kept
metrics lines of iterations `< s`), then logs iterations `s, s + 1, ...` again. Iterations
logged after that checkpoint and before the kill were already sent, and the resumed run
computes the same values for them (its resume is exact). Every backend ends holding each
iteration once:
- a backend that can rewrite its store (`metrics.jsonl`, TensorBoard's event files) keeps
  what `history` holds and drops the rest;
- an append-only store (wandb, MLflow, trackio) continues the same run, found by
  `TrackerRun.run_id` (one id per run directory, kept in it), reads back the last step it
  holds, logs the rows (and tables) of `history` it lacks (a tracker added on resume is
  filled in, and so is a store that lost what its process had not flushed when it was
  killed) and skips the steps it already holds (`AppendOnlyTracker` does this for them).

A tracker of your own subclasses `Tracker` (or `AppendOnlyTracker`) and is registered by name
(`register_tracker`), then named in `RunConfig.report_to` (docs/watching.md).
"""

from __future__ import annotations

import abc
import importlib.util
from typing import AbstractSet, Callable, ClassVar, Dict, NamedTuple, Optional, Sequence, Tuple, Union

__all__ = ["Tracker", "AppendOnlyTracker", "TrackerRun", "register_tracker", "tracker_class", "tracker_names",
           "parse_report_to", "check_installed", "ALWAYS"]

ALWAYS = "jsonl"  # the run's own record (metrics.jsonl): written whatever report_to says


class TrackerRun(NamedTuple):
    """What a tracker is started with.

    output_dir: the run directory; name: the run's name (the directory's name);
    run_id: an id kept in the run directory (`trackers.json`), the same on every resume of
    the run (for backends that name runs by id; "" when no tracker of the run needs one); config: the run's settings (flat dict of
    JSON values); start_iteration: the first iteration this process logs; history: the
    metrics lines of the iterations before it (`start_iteration` of them, in order);
    tables: the tables logged at those iterations, `(step, name, columns, rows)` in order."""

    output_dir: str
    name: str
    run_id: str
    config: dict
    start_iteration: int
    history: Tuple[dict, ...]
    tables: Tuple[tuple, ...] = ()


class Tracker(abc.ABC):
    """A destination for a run's metrics (and tables). Subclasses set `name` and, when the
    backend needs a package that jaxppo does not install, `requires = (module, pip
    requirement)`; `tables` says whether `log_table` records anything."""

    name: ClassVar[str] = ""
    requires: ClassVar[Optional[Tuple[str, str]]] = None
    tables: ClassVar[bool] = False

    @abc.abstractmethod
    def start(self, run: TrackerRun) -> None:
        """Open (or continue) the run's record; see the module's resume rule."""

    @abc.abstractmethod
    def log(self, step: int, metrics: dict) -> None:
        """Record iteration `step`'s metrics (a flat dict of numbers, with "iteration" and
        "episode")."""

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        """Record a table at iteration `step` (default: nothing)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Flush and close; the process may end right after."""


class AppendOnlyTracker(Tracker):
    """A tracker whose store only appends (a step logged twice is held twice). Subclasses
    implement `open(run)`, `write(step, metrics)`, and optionally `write_table`; this class
    applies the resume rule: it fills in the `history` rows the store lacks and skips every
    step the store already holds.

    `open` returns what the store holds of the run's metrics: None (nothing), an int (every
    step up to it: for stores that take only increasing steps) or a set of steps (the
    store's own record, read row by row). It may set `held_tables` to the `(step, name)`
    tables the store holds; without it a table is held where its step's metrics are. A
    store that keeps a step's table and its metrics apart must say which it holds: a
    process killed between the two leaves the table without the metrics."""

    held: Union[None, int, AbstractSet[int]] = None
    held_tables: Optional[AbstractSet[Tuple[int, str]]] = None

    @abc.abstractmethod
    def open(self, run: TrackerRun) -> Union[None, int, AbstractSet[int]]:
        """Open or continue the run's record (by `run.run_id`); return the steps it holds."""

    @abc.abstractmethod
    def write(self, step: int, metrics: dict) -> None:
        """Append one step."""

    def write_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        """Append one table (default: nothing)."""

    def start(self, run: TrackerRun) -> None:
        self.held = self.open(run)
        tables = {}
        for table in run.tables:
            tables.setdefault(table[0], []).append(table)
        for row in run.history:  # as the loop logs them: a step's tables, then its metrics
            for step, name, columns, rows in tables.get(row["iteration"], ()):
                self.log_table(step, name, columns, rows)
            self.log(row["iteration"], row)

    def holds(self, step: int) -> bool:
        """Whether the store held `step`'s metrics when the run opened."""
        if self.held is None:
            return False
        if isinstance(self.held, int):
            return step <= self.held
        return step in self.held

    def log(self, step: int, metrics: dict) -> None:
        if not self.holds(step):
            self.write(step, metrics)

    def log_table(self, step: int, name: str, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        held = (step, name) in self.held_tables if self.held_tables is not None else self.holds(step)
        if not held:
            self.write_table(step, name, columns, rows)


_TRACKERS: Dict[str, Callable[[], Tracker]] = {}


def register_tracker(name: str, cls: Callable[[], Tracker], *, replace: bool = False) -> None:
    """Make `name` a valid entry of `RunConfig.report_to`: `cls()` is a `Tracker`
    (a subclass, or any factory of one; `cls.requires`, when set, is checked up front)."""
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise ValueError(f"tracker name {name!r} is invalid: a non-empty string without commas or spaces at its ends")
    if name in ("none", "all"):
        raise ValueError(f"tracker name {name!r} is reserved (report_to='none' and 'all' mean no tracker and every one)")
    if name in _TRACKERS and not replace:
        raise ValueError(f"a tracker named {name!r} is registered already (replace=True replaces it)")
    _TRACKERS[name] = cls


def tracker_names() -> Tuple[str, ...]:
    return tuple(_TRACKERS)


def tracker_class(name: str) -> Callable[[], Tracker]:
    if name not in _TRACKERS:
        raise ValueError(f"unknown tracker {name!r}; valid: {', '.join(_TRACKERS)} (or register one with "
                         "jaxppo.tracking.register_tracker)")
    return _TRACKERS[name]


def parse_report_to(value, where: str = "RunConfig.report_to") -> Tuple[str, ...]:
    """The trackers `value` names: a comma-separated string or a list of names, "none" (the
    run's metrics.jsonl only) or "all" (every registered tracker whose package is installed).
    `ALWAYS` ("jsonl") is always among them, first. Unknown names are a `ValueError` listing
    the valid ones."""
    if isinstance(value, str):
        names = [n.strip() for n in value.split(",") if n.strip()]
    elif isinstance(value, (list, tuple)) and all(isinstance(n, str) for n in value):
        names = [n.strip() for n in value]
    else:
        raise ValueError(f"{where}={value!r} is invalid: give tracker names, comma-separated or as a list; valid: "
                         f"{', '.join(_TRACKERS)}, 'none' or 'all'")
    if "all" in names:
        names = [n for n in _TRACKERS if _missing(_TRACKERS[n]) is None]
    names = [n for n in names if n != "none"]
    unknown = [n for n in names if n not in _TRACKERS]
    if unknown:
        raise ValueError(f"{where}={value!r} names unknown trackers {unknown}; valid: {', '.join(_TRACKERS)}, 'none' "
                         "(metrics.jsonl only) or 'all' (jaxppo.tracking.register_tracker adds one)")
    return tuple(dict.fromkeys([ALWAYS, *names]))


def _missing(cls) -> Optional[Tuple[str, str]]:
    requires = getattr(cls, "requires", None)
    if requires and importlib.util.find_spec(requires[0]) is None:
        return requires
    return None


def check_installed(names: Sequence[str], where: str = "RunConfig.report_to") -> None:
    """A `ValueError` naming every tracker in `names` whose package is not installed, with
    the pip command that installs it (nothing is imported)."""
    missing = {n: _missing(_TRACKERS[n]) for n in names}
    missing = {n: r for n, r in missing.items() if r is not None}
    if missing:
        pips = " ".join(sorted({r[1] for r in missing.values()}))
        raise ValueError(f"{where} names {', '.join(missing)}, whose package is not installed "
                         f"({', '.join(r[0] for r in missing.values())}): pip install {pips}")
