"""Fail points: named places where a test can have the process SIGKILL itself, to prove
that a kill at exactly that instant loses nothing.

Off unless the environment variable `JAXPPO_FAILPOINT` is set to `NAME` or `NAME:N` (kill
at the N-th time NAME is reached, default 1). Names: "metrics_write" (half of a
metrics.jsonl line written), "checkpoint_save" (a checkpoint's files being written). Nothing
else reads the variable; with it unset `hit` is a dictionary lookup.

`JAXPPO_PAUSE=NAME:SECONDS` makes `pause(NAME)` sleep that long each time it is reached
(`NAME@N:SECONDS`: only at the N-th iteration; several entries separated by commas), so
that a test can deliver a signal while that work is surely under way ("checkpoint_save":
before a checkpoint's files are written, inside the save; "iteration": at the start of an
iteration, before anything of it runs).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable, Optional

__all__ = ["hit", "hit_during", "pause"]

_counts: dict = {}


def _armed(name: str) -> bool:
    spec = os.environ.get("JAXPPO_FAILPOINT")
    if not spec:
        return False
    target, _, count = spec.partition(":")
    if target != name:
        return False
    _counts[name] = _counts.get(name, 0) + 1
    return _counts[name] == int(count or 1)


def hit(name: str, before_kill: Optional[Callable[[], None]] = None):
    """If `JAXPPO_FAILPOINT` names this point and this is its N-th hit: run `before_kill`
    (e.g. write part of a record), then SIGKILL this process."""
    if _armed(name):
        if before_kill is not None:
            before_kill()
        os.kill(os.getpid(), signal.SIGKILL)


def hit_during(name: str, started: Callable[[], bool]):
    """If `JAXPPO_FAILPOINT` names this point and this is its N-th hit: SIGKILL this process
    from a watcher thread as soon as `started()` is true (polled every millisecond), that
    is, in the middle of the work that the caller starts next."""
    if not _armed(name):
        return

    def watch():
        while not started():
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def pause(name: str, at: Optional[int] = None):
    """Sleep where `JAXPPO_PAUSE` says: comma-separated entries `NAME:SECONDS` (each time
    NAME is reached) or `NAME@N:SECONDS` (only where the caller passes `at=N`, e.g. the
    iteration). A signal ends the sleep as it would end any work there."""
    for entry in filter(None, os.environ.get("JAXPPO_PAUSE", "").split(",")):
        target, _, seconds = entry.partition(":")
        target, _, index = target.partition("@")
        if target == name and (not index or (at is not None and int(index) == at)):
            time.sleep(float(seconds))
