"""Fail points: named places where a test can have the process SIGKILL itself, to prove
that a kill at exactly that instant loses nothing.

Off unless the environment variable `JAXPPO_FAILPOINT` is set to `NAME` or `NAME:N` (kill
at the N-th time NAME is reached, default 1). Names: "metrics_write" (half of a
metrics.jsonl line written), "checkpoint_save" (a checkpoint's files being written in the
background). Nothing else reads the variable; with it unset `hit` is a dictionary lookup.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

__all__ = ["hit"]

_counts: dict = {}


def hit(name: str, before_kill: Optional[Callable[[], None]] = None):
    """If `JAXPPO_FAILPOINT` names this point and this is its N-th hit: run `before_kill`
    (e.g. write part of a record), then SIGKILL this process."""
    spec = os.environ.get("JAXPPO_FAILPOINT")
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] == int(count or 1):
        if before_kill is not None:
            before_kill()
        os.kill(os.getpid(), signal.SIGKILL)
