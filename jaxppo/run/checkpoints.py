"""Checkpoints of a run (orbax), written so that a kill or a full disk loses nothing.

Layout: `<output_dir>/checkpoints/<iteration>/`, one orbax `StandardSave` of the trainer's
tree, with custom metadata naming the checkpoint layout version and the jaxppo version.
Orbax writes each checkpoint into a temporary folder and renames it when complete, so a
kill during a save leaves the earlier checkpoints as they were (the temporary folder is
removed when the next run opens the directory). Saves are synchronous.

Every checkpoint carries the SHA-256 of each of its files (`jaxppo_checksums.json` in its
folder, written atomically once orbax has finished; the custom metadata says one is due).
Restoring walks the checkpoints from the newest: one whose files do not match their
checksums (a flipped byte, a truncated or missing file, a checksum file cut short) or that
cannot be read is reported, moved aside to `checkpoints.corrupt/`, and the previous one is
tried; if checkpoints exist but none can be read, or one was written in another layout,
that is a `RunError` (never a silent fresh start). Checkpoints written before checksums
(jaxppo 0.4 and earlier) restore unverified, with a warning.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import warnings
from typing import Any, Optional, Tuple

import jax

from jaxppo.errors import RunError
from jaxppo.files import CHECKSUMS, ChecksumError, checksums, verify, write_checksums
from jaxppo.testing import failpoints
from jaxppo.version import __version__

__all__ = ["LAYOUT", "CHECKSUMS", "ChecksumError", "save", "restore_latest", "steps", "checksums", "verify"]

# Version of what a checkpoint holds. 1: jaxppo 0.1.0 (no metadata); 2: jaxppo 0.2.0.
LAYOUT = 2
_LAYOUT_KEY = "jaxppo_checkpoint_layout"
_CHECKSUMS_KEY = "jaxppo_checksums"  # in the custom metadata: a checksum file is due


def _manager(directory: str, keep: int = 2):
    import orbax.checkpoint as ocp

    # Synchronous saves, and no cleanup of temporary folders by orbax: both run in orbax's
    # background threads, which can outlive the manager (one still running when the process
    # exits prints a traceback). A kill's temporary folder is removed by `restore_latest`.
    return ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, cleanup_tmp_directories=False,
                                             enable_async_checkpointing=False))


def steps(directory: str) -> list:
    """Complete checkpoints in `directory`, oldest first (nothing is changed on disk)."""
    if not os.path.isdir(directory):
        return []
    manager = _manager(directory)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def save(directory: str, step: int, tree: Any, *, keep: int = 2):
    """Save `tree` as checkpoint `step` (skipped when that step exists); keep the newest
    `keep`. A write error (full disk, quota, permissions) is a `RunError` that names the
    directory; the checkpoints saved before stay intact."""
    import orbax.checkpoint as ocp

    manager = _manager(directory, keep)
    quiet = _BackgroundFaults()
    try:
        quiet.start()
        previous = sorted(manager.all_steps())
        if step in previous:
            return
        failpoints.hit_during("checkpoint_save", lambda: _writing(directory, step))
        failpoints.pause("checkpoint_save")
        manager.save(step, args=ocp.args.StandardSave(tree),
                     custom_metadata={_LAYOUT_KEY: LAYOUT, "jaxppo_version": __version__, _CHECKSUMS_KEY: 1})
        manager.wait_until_finished()
        if jax.process_index() == 0:
            write_checksums(os.path.join(directory, str(step)))
    except Exception as err:  # orbax and tensorstore raise many types for one cause
        quiet.keep()  # the writes still in flight fail after this, each into a closed event loop: not a cascade
        last = f"the checkpoint of iteration {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
        raise RunError(f"could not save the checkpoint of iteration {step} in {directory}: {type(err).__name__}: "
                       f"{_first_line(err)}. Nothing was overwritten ({last}); free disk space or fix the directory, "
                       "then run the same command again to resume") from err
    finally:
        try:
            manager.close()
        except Exception:  # noqa: BLE001 - the save error above is the one to report
            pass
        quiet.stop()


_LOOP_CLOSED = "RuntimeError: Event loop is closed"
_HEADER = "Traceback (most recent call last):"


class _DropClosedLoopTracebacks:
    """`sys.stderr` less the tracebacks of "RuntimeError: Event loop is closed": when one
    write of a checkpoint fails (a full disk), orbax's save gives up and closes its event
    loop while tensorstore still finishes the other writes, each of which then reports its
    completion into the closed loop and prints that traceback from its own thread (hundreds
    of them). They say nothing the save's own error does not. Everything else passes
    through unchanged: a traceback is held, per thread, until its exception line shows
    which it is."""

    def __init__(self, stream):
        import threading

        self.stream, self.lock = stream, threading.Lock()
        self.held = {}  # thread id -> [the traceback's lines so far, its unfinished line]

    def write(self, s):
        import threading

        with self.lock:
            self._write(threading.get_ident(), s)
        return len(s)

    def _write(self, thread: int, s: str):
        while s:
            held = self.held.get(thread)
            if held is None:
                i = s.find(_HEADER)
                if i < 0:
                    self.stream.write(s)
                    return
                self.stream.write(s[:i])
                held = self.held[thread] = [[], ""]
                s = s[i:]
            held[1] += s
            s = ""
            while "\n" in held[1]:
                line, held[1] = held[1].split("\n", 1)
                held[0].append(line)
                if len(held[0]) > 1 and not line.startswith((" ", "\t")):  # the exception line ends it
                    if line.strip() != _LOOP_CLOSED:
                        self.stream.write("\n".join(held[0]) + "\n")
                    s = held[1]
                    del self.held[thread]
                    break

    def flush(self):
        with self.lock:
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _BackgroundFaults:
    """Quiet orbax's background threads while a checkpoint saves: their closed-loop
    tracebacks (`_DropClosedLoopTracebacks` over `sys.stderr`), absl's ERROR record of the
    failed write and asyncio's of the write tasks it abandoned, which the save's own
    `RunError` reports once. After a failed save the filter stays on (`keep`): the writes
    still in flight fail later, until the process ends."""

    def __init__(self):
        self.filter, self.kept, self.previous = None, False, None

    def start(self):
        import logging
        import sys

        if not isinstance(sys.stderr, _DropClosedLoopTracebacks):
            self.previous = sys.stderr
            sys.stderr = _DropClosedLoopTracebacks(sys.stderr)

        def background_error(record):
            message = record.getMessage()
            return record.levelno >= logging.ERROR and ("Thread.run() raised an exception" in message
                                                        or "exception was never retrieved" in message)

        self.filter = lambda record: not background_error(record)
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(self.filter)

    def keep(self):
        import warnings

        self.kept = True
        # (and the abandoned writes' coroutines, reported by the garbage collector at exit)
        warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)

    def stop(self):
        import logging
        import sys

        if not self.kept:
            for name in ("absl", "asyncio"):
                logging.getLogger(name).removeFilter(self.filter)
            if self.previous is not None and isinstance(sys.stderr, _DropClosedLoopTracebacks):
                sys.stderr.flush()
                sys.stderr = self.previous


def _writing(directory: str, step: int) -> bool:
    """Whether checkpoint `step` is being written: its temporary folder holds a file."""
    prefix = f"{step}.orbax-checkpoint-tmp"
    try:
        return any(files for name in os.listdir(directory) if name.startswith(prefix)
                   for _, _, files in os.walk(os.path.join(directory, name)))
    except OSError:
        return False


def _first_line(err) -> str:
    """The first line of an error, shortened in the middle: tensorstore puts the cause (for
    example "File too large") at the end of a long line of paths, or before a long JSON spec
    that ends with the OS error's number (`[os_error_code='27']`): where the shortening cut
    the cause out, the OS error's own text is added."""
    lines = str(err).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) <= 400:
        return text
    short = f"{text[:180]} ... {text[-200:]}"
    code = re.search(r"os_error_code='(\d+)'", text)
    if code and os.strerror(int(code.group(1))) not in short:
        short += f" ({os.strerror(int(code.group(1)))})"
    return short


def restore_latest(directory: str, template: Any) -> Optional[Tuple[int, Any]]:
    """(step, tree) of the newest readable checkpoint in `directory`, shaped and sharded
    like `template`; None when there is no checkpoint at all.

    Each checkpoint is verified against its checksums before orbax reads anything of it;
    one that fails or cannot be read is warned about by path, moved to
    `<directory>.corrupt/` and skipped. Raises `RunError` when checkpoints exist but none is
    readable, or when one was written in another checkpoint layout."""
    if not os.path.isdir(directory):  # a new run: orbax is not even imported (0.2 s of start-up)
        return None
    _remove_temporary(directory)
    failed, verified = [], {}
    for step in sorted(_step_folders(directory), reverse=True):
        path = os.path.join(directory, str(step))
        try:  # before orbax opens the folder: its manager reads the newest one's metadata on start
            verified[step] = verify(path, expected=_announced(path))
        except (ChecksumError, OSError) as err:
            failed.append((step, path, err))
    if verified:
        _set_aside(directory, failed)  # out of orbax's way; reported
        found = _restore_verified(directory, template, verified)
        if found is not None:
            return found
    elif failed:
        _raise_none_readable(directory, failed)
    return None


def _restore_verified(directory: str, template: Any, verified: dict):
    """The newest of the `verified` checkpoints ({step: whether checksums were checked})
    that orbax restores, as `restore_latest` returns it."""
    import orbax.checkpoint as ocp

    manager = _manager(directory)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
        template)
    failed = []
    try:
        for step in sorted(set(manager.all_steps()) & set(verified), reverse=True):
            path = os.path.join(directory, str(step))
            try:
                meta = manager.metadata(step).custom_metadata or {}
            except Exception as err:  # noqa: BLE001
                failed.append((step, path, err))
                continue
            layout = meta.get(_LAYOUT_KEY, 1)
            if layout != LAYOUT:
                raise RunError(
                    f"checkpoint {path} has checkpoint layout {layout} (written by jaxppo "
                    f"{meta.get('jaxppo_version', '0.1.0')}); this jaxppo {__version__} reads layout {LAYOUT} only. "
                    f"Resume it with the jaxppo version that wrote it, or start a new output_dir")
            try:
                restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
            except Exception as err:  # noqa: BLE001 - tensorstore/orbax raise many types for a torn file
                failed.append((step, path, err))
                continue
            _set_aside(directory, failed)
            if not verified[step]:
                warnings.warn(f"checkpoint {path} was written without checksums (jaxppo 0.4 or earlier): restored "
                              "unverified", RuntimeWarning, stacklevel=4)
            return step, jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(restored))
    finally:
        manager.close()
    if failed:
        _raise_none_readable(directory, failed)
    return None


def _raise_none_readable(directory: str, failed: list):
    listing = "; ".join(f"{p}: {type(e).__name__}: {_first_line(e)}" for _, p, e in failed)
    raise RunError(f"no checkpoint in {directory} can be read ({listing}). The run's logs are left as they are; "
                   "restore the checkpoints, or give this run another output_dir to start afresh")


def _remove_temporary(directory: str):
    """Remove the temporary folders of saves that a kill cut short (process 0)."""
    if jax.process_index() != 0:
        return
    for name in os.listdir(directory):
        if ".orbax-checkpoint-tmp" in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _step_folders(directory: str) -> list:
    """The steps of the finished checkpoints in `directory`: folders named by an integer
    (orbax's temporary folders are named otherwise)."""
    return [int(name) for name in os.listdir(directory)
            if name.isdigit() and os.path.isdir(os.path.join(directory, name))]


def _announced(folder: str) -> bool:
    """Whether a checkpoint says it has a checksum file (its custom metadata; an unreadable
    metadata file counts as yes, so that it is not restored unverified)."""
    try:
        with open(os.path.join(folder, "_CHECKPOINT_METADATA")) as f:
            return bool((json.load(f).get("custom_metadata") or {}).get(_CHECKSUMS_KEY))
    except (OSError, ValueError, AttributeError):
        return True


def _set_aside(directory: str, failed: list):
    """Warn about each unreadable checkpoint and move it to `<directory>.corrupt/` (kept for
    inspection), so that the run can save that step again."""
    if not failed or jax.process_index() != 0:
        for step, path, err in failed:
            warnings.warn(f"checkpoint {path} cannot be read ({type(err).__name__}: {_first_line(err)}); "
                          "resuming from an earlier one", RuntimeWarning, stacklevel=3)
        return
    aside = os.path.abspath(directory).rstrip(os.sep) + ".corrupt"
    os.makedirs(aside, exist_ok=True)
    for step, path, err in failed:
        target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(path, target)
        warnings.warn(f"checkpoint {path} cannot be read ({type(err).__name__}: {_first_line(err)}); moved to "
                      f"{target} and resuming from an earlier checkpoint", RuntimeWarning, stacklevel=3)
