"""Files written whole or not at all: a leaf every layer may use (the run directory, the
trackers' records)."""

from __future__ import annotations

import os
import tempfile

__all__ = ["atomic_write_text"]


def atomic_write_text(path: str, text: str):
    """Write `text` to `path` atomically: a temporary file in the same directory, flushed
    to disk, then renamed over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a log or settings file is not
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
