"""The run directory: atomic writes, one run per directory (a lock), and the run's settings
saved beside its checkpoints so that a resume with other settings is refused up front.

A run can be killed at any instant. Every file jaxppo rewrites is written to a temporary
file in the same directory and renamed over the old one (`os.replace` is atomic on POSIX),
so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from typing import Optional

from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text

__all__ = ["RunError", "atomic_write_text", "atomic_replace_dir", "RunLock", "check_settings", "named_checkpoint",
           "SETTINGS_FILE", "make_output_dir", "read_settings"]

SETTINGS_FILE = "run_settings.json"
LOCK_FILE = ".jaxppo.lock"


def atomic_replace_dir(write, path: str):
    """Build a directory with `write(tmp_dir)` beside `path`, then put it in `path`'s place.

    The old directory (if any) is renamed away first and deleted only after the new one is
    in place, so a kill leaves either a complete old or a complete new directory (plus a
    leftover `*.old-*`/`*.tmp-*` folder, removed by the next call)."""
    import shutil

    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    for leftover in os.listdir(parent):
        if leftover.startswith(name + ".tmp-") or leftover.startswith(name + ".old-"):
            shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=name + ".tmp-")
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(dir=parent, prefix=name + ".old-")
        os.rmdir(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def make_output_dir(path: str):
    """Create a run's output directory (and its parents). What keeps it from being one is a
    `RunError` naming the path and what to do, before anything else is written: the path is
    a file, a part of it is a file, it cannot be created (permissions, a read-only file
    system), or it exists but cannot be written to."""
    what = f"the output directory {path!r}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunError(f"{what} is a file; give output_dir a directory (a new one, or a run's to resume)")
    try:
        os.makedirs(path, exist_ok=True)
    except (NotADirectoryError, FileExistsError):
        parent = next((p for p in _parents(path) if os.path.exists(p) and not os.path.isdir(p)), path)
        raise RunError(f"{what} cannot be created: {parent!r} is a file, not a directory; give output_dir a path "
                       "under a directory") from None
    except OSError as err:
        raise RunError(f"{what} cannot be created ({err.strerror or type(err).__name__}); give output_dir a path "
                       "where this user may write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunError(f"{what} cannot be written to (a read-only file system, or its permissions); give output_dir "
                       "a path where this user may write") from None


def _parents(path: str) -> list:
    """`path`'s ancestors, nearest last."""
    parts, current = [], os.path.abspath(path)
    while os.path.dirname(current) != current:
        current = os.path.dirname(current)
        parts.append(current)
    return parts[::-1]


class RunLock:
    """An exclusive lock on a run directory for the life of a run (`fcntl.flock` on
    `<directory>/.jaxppo.lock`). The operating system releases it when the process ends,
    however it ends (SIGKILL included), so a killed run never leaves a stale lock."""

    def __init__(self, directory: str):
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self):
        import fcntl

        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunError(
                    f"another jaxppo run (process {holder}) is using the output directory {self.directory!r}; "
                    "two runs on one directory would overwrite each other's checkpoints and logs. Wait for it to "
                    "finish, stop it, or give this run another output_dir") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def release(self):
        if self._fd is not None:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def named_checkpoint(source) -> tuple:
    """(run directory, step) when `source` is one of a run's checkpoint folders
    (`<run>/checkpoints/<step>`), else (`source`, None): what `resume_from` names, read
    without opening the checkpoint."""
    source = os.path.abspath(os.fspath(source))
    parent = os.path.dirname(source)
    if os.path.basename(parent) == "checkpoints" and os.path.basename(source).isdigit() and os.path.isdir(source):
        return os.path.dirname(parent), int(os.path.basename(source))
    return source, None


SETTINGS_CHECKSUM = "_sha256"  # in run_settings.json: the SHA-256 of the settings it holds


def _settings_digest(settings: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _settings_text(settings: dict) -> str:
    """run_settings.json's text: the settings and their checksum."""
    return json.dumps({**settings, SETTINGS_CHECKSUM: _settings_digest(settings)}, indent=1, sort_keys=True) + "\n"


def read_settings(path: str, directory: str) -> dict:
    """The settings saved at `path` (a run's run_settings.json), checked against the checksum
    saved in them (settings saved by jaxppo 0.4 have none and are taken as they are); a
    `RunError` naming the file when it cannot be read or does not match."""
    try:
        with open(path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise RunError(f"{path} cannot be read ({err}); it records the settings of the run in {directory!r}. "
                       "Restore it, or give this run another output_dir") from None
    digest = saved.pop(SETTINGS_CHECKSUM, None)
    if digest is not None and digest != _settings_digest(saved):
        raise RunError(f"{path} does not match the checksum saved in it ({SETTINGS_CHECKSUM}): the settings of the run "
                       f"in {directory!r} are damaged (a bad disk or an interrupted copy) or were edited by hand. "
                       f"Restore the file; if you edited it on purpose, delete its {SETTINGS_CHECKSUM!r} line")
    return saved


def check_settings(directory: str, settings: dict, *, write: bool = True, replace: bool = False):
    """Compare `settings` (a JSON-able dict) with those saved in `<directory>/run_settings.json`.

    No saved settings: save these (when `write`). Saved settings that differ: a `RunError`
    listing every differing field with its saved and its new value; with `replace` (the run
    there finished no iteration: nothing of it would be mixed in) a line listing them, and
    these saved instead (when `write`)."""
    path = os.path.join(directory, SETTINGS_FILE)
    new = json.loads(json.dumps(settings))  # the JSON view (tuples -> lists), as saved
    if os.path.isfile(path):
        old = read_settings(path, directory)
        a, b = _flatten(old), _flatten(new)
        diffs = [f"  {name}: was {a.get(name, '<unset>')!r}, now {b.get(name, '<unset>')!r}"
                 for name in sorted(set(a) | set(b)) if a.get(name, "<unset>") != b.get(name, "<unset>")]
        if diffs and replace:
            print(f"{directory!r} holds the settings of a run that finished no iteration; this run's replace them:\n"
                  + "\n".join(diffs), flush=True)
            if write:
                atomic_write_text(path, _settings_text(new))
        elif diffs:
            raise RunError(
                f"the output directory {directory!r} holds a run with other settings ({path}); resuming it with these "
                "would mix two runs. Differences:\n" + "\n".join(diffs) +
                "\nUse the saved settings to resume, or give this run another output_dir")
    elif write:
        os.makedirs(directory, exist_ok=True)
        atomic_write_text(path, _settings_text(new))
