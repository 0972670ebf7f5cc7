"""Callbacks that watch and steer a run.

A callback is either a function `cb(iteration, metrics)`, called after every iteration (as
since 0.1), or an object with any of the hooks of `Callback`:

    on_train_begin(trainer)                            before the first iteration of `train()`
    on_iteration_end(trainer, iteration, metrics)      after each iteration's line is logged
    on_train_end(trainer, history)                     after the run's end (checkpoint, export)

`on_iteration_end` (and a plain function) may return a `Control`: `stop=True` ends the run
after this iteration as a SIGTERM does (a checkpoint is saved; the same command resumes
it), `checkpoint=True` saves a checkpoint now whatever `checkpoint_every` says. Returning
None asks for nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

__all__ = ["Callback", "Control", "Hooks", "call_iteration_end", "call_hook"]


@dataclasses.dataclass(frozen=True)
class Control:
    """What a callback asks of the loop after an iteration: `stop` the run (saved and
    resumable), or a `checkpoint` now."""

    stop: bool = False
    checkpoint: bool = False

    def __or__(self, other: "Control") -> "Control":
        return Control(self.stop or other.stop, self.checkpoint or other.checkpoint)


class Callback:
    """A base class for callbacks with hooks (each optional: the defaults do nothing)."""

    def on_train_begin(self, trainer) -> None:
        """Before the first iteration `train()` runs (after a resume: the first it runs)."""

    def on_iteration_end(self, trainer, iteration: int, metrics: dict) -> Optional[Control]:
        """After iteration `iteration`'s metrics line is logged; return a `Control` to steer."""

    def on_train_end(self, trainer, history: list) -> None:
        """After the run's end: its last checkpoint, evaluation and export are written."""


def _hook(callback, name: str) -> Optional[Callable]:
    return getattr(callback, name, None) if not _is_plain(callback) else None


def _is_plain(callback) -> bool:
    hooks = ("on_train_begin", "on_iteration_end", "on_train_end")
    return callable(callback) and not any(hasattr(callback, h) for h in hooks)


def call_iteration_end(callbacks: Sequence[Any], trainer, iteration: int, metrics: dict) -> Control:
    """Every callback's answer after `iteration`, combined (any stop stops, any checkpoint
    request saves). A callback that returns something other than None or a `Control` is a
    `TypeError` naming it."""
    control = Control()
    for cb in callbacks:
        answer = cb(iteration, metrics) if _is_plain(cb) else (
            _hook(cb, "on_iteration_end")(trainer, iteration, metrics) if _hook(cb, "on_iteration_end") else None)
        if answer is None:
            continue
        if not isinstance(answer, Control):
            raise TypeError(f"callback {getattr(cb, '__name__', type(cb).__name__)} returned {answer!r} after "
                            f"iteration {iteration}; a callback returns None or a jaxppo.Control(stop=..., "
                            "checkpoint=...)")
        control = control | answer
    return control


def call_hook(callbacks: Sequence[Any], name: str, *args) -> None:
    """Call hook `name` ("on_train_begin", "on_train_end") of every callback that has it."""
    for cb in callbacks:
        hook = _hook(cb, name)
        if hook is not None:
            hook(*args)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """A run's callbacks and what their hooks receive (`owner`: the trainer), as the loop
    calls them."""

    callbacks: Sequence[Any]
    owner: Any

    def begin(self) -> None:
        call_hook(self.callbacks, "on_train_begin", self.owner)

    def iteration_end(self, iteration: int, metrics: dict) -> Control:
        return call_iteration_end(self.callbacks, self.owner, iteration, metrics)

    def end(self, history: list) -> None:
        call_hook(self.callbacks, "on_train_end", self.owner, history)
