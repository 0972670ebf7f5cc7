"""The run directory as one object (`RunDirectory`): claiming it (one run per directory, a
lock), the run's settings saved beside its checkpoints so that a resume with other settings
is refused up front, saving and restoring the `RunState` (orbax, `jaxppo.run.checkpoints`),
starting from another run's checkpoint (`resume_from`), and where the logs go.

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

import jax
import numpy as np

from jaxppo.config.record import OLD_SECTIONS, SECTIONS, comparable, recorded
from jaxppo.errors import RunError
from jaxppo.files import atomic_write_text
from jaxppo.run import checkpoints
from jaxppo.run.logger import read_metrics
from jaxppo.tracking.local import METRICS_FILE, TABLE_SUFFIX, read_table

__all__ = ["RunDirectory", "RunError", "atomic_write_text", "atomic_replace_dir", "RunLock", "check_settings",
           "named_checkpoint", "SETTINGS_FILE", "make_output_dir", "read_settings", "run_settings", "adopt"]

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


def _comparable(settings: dict) -> dict:
    """A saved settings dict as two runs' are compared: its settings by name, whatever
    version or concern recorded them (`jaxppo.config.record.comparable`), beside its
    description of the models, reward, tokenizer and prompts."""
    sections = set(SECTIONS) | set(OLD_SECTIONS)
    described = {k: v for k, v in settings.items()
                 if (k not in sections or not isinstance(v, dict)) and k != "checkpoint_layout"}
    if isinstance(described.get("optimizer"), str):  # 0.4's record of a custom optimizer
        described["custom_optimizer"] = described.pop("optimizer")
    return {"checkpoint_layout": settings.get("checkpoint_layout"), "settings": comparable(settings),
            **_reward_description(described)}


def _reward_description(described: dict) -> dict:
    """The reward's record as two runs' are compared: a list of one function of weight 1 and
    no reward model (`reward_fns=[f]`) is the same reward as that function given alone
    (`reward_fns=f`, 0.4's `reward_fn=f`), which records it as {"function", "on"}."""
    reward = described.get("reward")
    if isinstance(reward, dict) and "functions" in reward and "model" not in reward:
        functions = reward["functions"]
        if len(functions) == 1 and functions[0].get("weight") == 1.0:
            return {**described, "reward": {"function": functions[0].get("function"), "on": "text"}}
    return described


def _label(name: str) -> str:
    """A compared entry as a user names it: a setting as `Concern.name`, the rest as flattened."""
    from jaxppo.config.settings import CONCERNS, SETTINGS

    if name.startswith("settings."):
        setting = name[len("settings."):]
        if setting in SETTINGS:
            return f"{CONCERNS[SETTINGS[setting]].__name__}.{setting}"
        return setting
    return name


def _shown(flat: dict, name: str) -> str:
    """An entry's value as the differences show it; a setting left out is at its default."""
    if name in flat:
        return repr(flat[name])
    if name.startswith("settings.") and name != "settings.iterations":
        from jaxppo.config.settings import SETTINGS, setting_field

        setting = name[len("settings."):]
        if setting in SETTINGS:
            return f"{setting_field(setting).default!r} (the default)"
    return "'<unset>'"


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
        a, b = _flatten(_comparable(old)), _flatten(_comparable(new))
        diffs = [f"  {_label(name)}: was {_shown(a, name)}, now {_shown(b, name)}"
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


def run_settings(config, iterations: int, description: dict) -> dict:
    """What must stay the same for a resumed run to continue this one: the checkpoint
    layout, the settings a resumed run must match, by concern (`jaxppo.config.record.
    recorded`: every one not free on resume; `iterations` where the learning-rate schedule's
    length depends on it), and `description` (models, reward, tokenizer, prompts)."""
    return {"checkpoint_layout": checkpoints.LAYOUT, **recorded(config, iterations), **description}


class RunDirectory:
    """A run's directory, `config.run.output_dir`: claiming it, its settings, its checkpoints
    and where its logs go.

    `open(run, settings)` claims the directory (a lock: a second run on it is refused),
    starts it from `resume_from`'s checkpoint when asked, checks the saved settings against
    `settings` (writing them the first time) and restores the newest checkpoint when
    resuming, all before anything compiles; it returns the run state to start from.
    `save(run)` writes a checkpoint, `restore(run)` reads the newest readable one, `close()`
    releases the directory."""

    def __init__(self, run_config):
        self.config = run_config
        self.path = run_config.output_dir
        self.lock = None

    @property
    def checkpoints(self) -> str:
        return os.path.abspath(os.path.join(self.path, "checkpoints"))

    @property
    def log_dir(self) -> str:
        """Process 0 logs to the directory; in multi-host runs the others to a subfolder."""
        return self.path if jax.process_index() == 0 else os.path.join(self.path, f"process_{jax.process_index()}")

    def open(self, run, settings: dict):
        """Claim the directory, check the saved settings and restore the newest checkpoint
        when resuming (see the class); the run state to start from."""
        import warnings

        make_output_dir(self.path)
        c = self.config
        self.lock = RunLock(self.log_dir).acquire()
        try:
            if c.resume_from is not None and c.resume and jax.process_index() == 0:
                adopt(c.resume_from, self.path, settings)
            with warnings.catch_warnings():  # a torn last line: the logger warns once, when it rewrites the file
                warnings.simplefilter("ignore", RuntimeWarning)
                logged = bool(read_metrics(os.path.join(self.log_dir, "metrics.jsonl")))
            # A run that finished no iteration (its first failed or was stopped) left nothing a
            # new run could be mixed with: it neither blocks a corrected command nor needs resume.
            existing = logged or bool(checkpoints.steps(self.checkpoints))
            if not c.resume and existing:
                raise RunError(f"the output directory {self.path!r} already holds a run (metrics.jsonl or "
                               "checkpoints) and resume is off; give this run another output_dir, delete the old "
                               "run, or resume it")
            check_settings(self.path, settings, write=jax.process_index() == 0, replace=not existing)
            restored = self.restore(run) if c.resume else None
            if restored is not None:
                run = restored
                print(f"resumed from iteration {run.iteration} ({self.checkpoints})")
            elif logged:
                warnings.warn(f"{self.path!r} holds logged iterations but no checkpoint (none was saved before the "
                              "run stopped): starting again from iteration 0 with the same settings; the logged "
                              "iterations are recomputed", RuntimeWarning, stacklevel=3)
        except BaseException:
            self.close()
            raise
        return run

    def close(self):
        """Release the directory `open` claimed (idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self, run):
        """Save the run state at its iteration (orbax; see `jaxppo.run.checkpoints`). A write
        error is a `RunError`; the checkpoints saved before stay intact."""
        checkpoints.save(self.checkpoints, run.iteration, run.checkpoint_tree(), keep=self.config.keep_checkpoints)

    def restore(self, run):
        """`run` with the newest readable checkpoint put in, or None if there is none.
        Unreadable ones are warned about and set aside (`jaxppo.run.checkpoints`)."""
        template = run.checkpoint_tree()
        found = checkpoints.restore_latest(self.checkpoints, template)
        if found is None:
            return None
        _, tree = found
        if not np.array_equal(np.asarray(tree["key"]), np.asarray(template["key"])):
            raise RunError(f"the checkpoint in {self.path!r} was written with another seed; "
                           "use the same seed to resume, or another output_dir")
        return run.restored(tree)


def adopt(source: str, output_dir: str, settings: dict) -> Optional[int]:
    """`RunConfig.resume_from`: start `output_dir` from another run's checkpoint. `source` is
    a run directory (its newest checkpoint whose checksums verify) or one of its checkpoints
    (`<run>/checkpoints/<step>`). When `output_dir` holds no checkpoint yet, the checkpoint,
    the run's saved settings and its metrics and table lines before the checkpoint are
    copied in (the source is only read), so the automatic resume continues from it;
    settings that differ from the source run's (`settings`, as `check_settings` compares
    them) are refused before anything is copied. Once `output_dir` has checkpoints of its
    own, it resumes from them and `source` is not read. Returns the step adopted, or None."""
    import shutil

    own = os.path.join(output_dir, "checkpoints")
    if checkpoints.steps(own):
        return None
    run_dir, step = _adopted_checkpoint(source)
    try:
        check_settings(run_dir, settings, write=False)
    except RunError as err:
        raise RunError(f"resume_from={source!r}: {err}") from None
    os.makedirs(own, exist_ok=True)
    saved = os.path.join(run_dir, SETTINGS_FILE)
    if os.path.isfile(saved) and not os.path.isfile(os.path.join(output_dir, SETTINGS_FILE)):
        shutil.copyfile(saved, os.path.join(output_dir, SETTINGS_FILE))
    for name in sorted(os.listdir(run_dir)):
        if name == METRICS_FILE or name.endswith(TABLE_SUFFIX):
            rows = [r for r in read_table(os.path.join(run_dir, name)) if r["iteration"] < step]
            if not os.path.isfile(os.path.join(output_dir, name)):
                atomic_write_text(os.path.join(output_dir, name), "".join(json.dumps(r) + "\n" for r in rows))
    tmp = tempfile.mkdtemp(dir=own, prefix=f".adopt-{step}-")
    shutil.copytree(os.path.join(run_dir, "checkpoints", str(step)), os.path.join(tmp, str(step)))
    os.replace(os.path.join(tmp, str(step)), os.path.join(own, str(step)))  # the checkpoint lands last, whole
    os.rmdir(tmp)
    print(f"starting from {os.path.join(run_dir, 'checkpoints', str(step))} (copied into {own})", flush=True)
    return step


def _adopted_checkpoint(source: str):
    """(run directory, step) that `resume_from=source` names; a `RunError` saying what a
    valid value is otherwise."""
    import warnings

    source = os.path.abspath(os.fspath(source))
    run_dir, step = named_checkpoint(source)
    if step is not None:
        parent = os.path.dirname(source)
        try:
            checkpoints.verify(source, expected=True)
        except (checkpoints.ChecksumError, OSError) as err:
            raise RunError(f"resume_from={source!r}: the checkpoint does not verify ({err}); give another of "
                           f"{parent}'s checkpoints, or the run directory (its newest that verifies)") from None
        return run_dir, step
    folder = os.path.join(source, "checkpoints")
    steps = sorted((int(n) for n in os.listdir(folder) if n.isdigit()), reverse=True) if os.path.isdir(folder) else []
    for step in steps:
        try:
            checkpoints.verify(os.path.join(folder, str(step)), expected=True)
            return source, step
        except (checkpoints.ChecksumError, OSError) as err:
            warnings.warn(f"resume_from: checkpoint {os.path.join(folder, str(step))} does not verify ({err}); trying "
                          "the one before", RuntimeWarning, stacklevel=4)
    raise RunError(f"resume_from={source!r} is neither a run directory with a readable checkpoint "
                   "(<run>/checkpoints/<step>) nor one of its checkpoints; give the output_dir of a run that saved a "
                   "checkpoint, or its checkpoints/<step> folder")
