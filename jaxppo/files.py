"""Files written whole or not at all, and folders that carry the SHA-256 of their files: a
leaf every layer may use (the run directory, checkpoints, exports, the trackers' records)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

__all__ = ["atomic_write_text", "CHECKSUMS", "ChecksumError", "checksums", "write_checksums", "verify",
           "verify_if_present"]

CHECKSUMS = "jaxppo_checksums.json"  # in a checkpoint's or an export's folder: {"sha256": {relative path: sha256}}


class ChecksumError(Exception):
    """A folder's files do not match the checksums saved with them."""


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


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checksums(folder: str) -> dict:
    """{path relative to `folder`: SHA-256} of every file under `folder` but the checksum
    file itself (and its temporary file)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if not rel.startswith(CHECKSUMS):
                out[rel.replace(os.sep, "/")] = _digest(path)
    return dict(sorted(out.items()))


def write_checksums(folder: str):
    """The checksum file of a folder whose files are written, written atomically (a
    temporary file, flushed to disk, renamed)."""
    tmp = os.path.join(folder, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"sha256": checksums(folder)}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, CHECKSUMS))


def verify(folder: str, expected: bool = True, extra_ok: bool = False) -> bool:
    """Check a folder's files against its checksum file; True when verified, False when it
    has none and none is `expected`. Raises `ChecksumError` naming the first file that
    differs or is missing, or is extra (unless `extra_ok`: files added beside a saved
    export), or a checksum file that is missing where expected or cannot be read."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        if expected:
            raise ChecksumError(f"its checksum file {CHECKSUMS} is missing (the save was cut short)")
        return False
    try:
        with open(path) as f:
            saved = json.load(f)["sha256"]
        if not isinstance(saved, dict):
            raise TypeError("not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ChecksumError(f"its checksum file {CHECKSUMS} cannot be read ({type(err).__name__})") from None
    found = checksums(folder)
    for name in sorted(set(saved) | set(found)):
        if name not in found:
            raise ChecksumError(f"file {name} is missing")
        if name not in saved:
            if extra_ok:
                continue
            raise ChecksumError(f"file {name} is not among the files saved")
        if found[name] != saved[name]:
            raise ChecksumError(f"file {name} does not match its checksum (sha256 {found[name][:12]}..., saved "
                                f"{str(saved[name])[:12]}...)")
    return True


def verify_if_present(folder: str, what: str) -> None:
    """Check an exported folder (a policy, an adapter) against its checksum file where it
    has one (jaxppo writes one with every export; a checkpoint from elsewhere has none):
    a `ValueError` naming `what`, the folder and the damaged file. Files added beside the
    saved ones are allowed."""
    if not os.path.isdir(folder):
        return
    try:
        verify(folder, expected=False, extra_ok=True)
    except ChecksumError as err:
        raise ValueError(f"{what} {folder!r} is damaged: {err}. jaxppo saved it with {CHECKSUMS}, and its files no "
                         "longer match (a bad disk or an interrupted copy); copy or export it again") from None
