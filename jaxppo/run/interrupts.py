"""Signals around the training loop: the signals that end a job (SIGTERM, a hang-up, a
scheduler's warning) end a run the way Ctrl-C does, and all of them are held (not lost)
while a checkpoint or an iteration's result is being committed."""

from __future__ import annotations

import signal
import sys

__all__ = ["interrupts_raise", "interrupts_held", "TERMINATING"]

# What ends a job besides Ctrl-C (SIGINT): SIGTERM (kill, Kubernetes, Slurm at the time
# limit), SIGHUP (the terminal or ssh session closed), SIGXCPU (a CPU-time limit: LSF,
# SGE), SIGUSR1 and SIGUSR2 (the warning Slurm's `--signal`, SGE's `-notify` and others send
# before they stop a job). Each saves a checkpoint and stops, as Ctrl-C does.
TERMINATING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGXCPU", "SIGUSR1", "SIGUSR2")
                    if hasattr(signal, name))


class interrupts_raise:
    """The signals of `TERMINATING` raise KeyboardInterrupt (as Ctrl-C does) inside the
    block, so that all end in the same checkpoint-and-exit path. Only in the main thread
    (signals cannot be set elsewhere)."""

    def __enter__(self):
        self.previous = {}
        for sig in TERMINATING:
            try:
                self.previous[sig] = signal.signal(sig, self._raise)
            except ValueError:  # not in the main thread
                break
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def __exit__(self, *exc):
        _restore(self.previous)


class interrupts_held:
    """Ctrl-C and the signals of `TERMINATING` inside the block (a checkpoint being written,
    an iteration's state and metrics line being committed) are held: a message says what is
    being finished, and a KeyboardInterrupt is raised once the block is complete (unless
    `reraise=False`, for a block inside the interrupt's own handling). SIGKILL cannot be
    held; a kill mid-save leaves the earlier checkpoints, a kill mid-line a torn line that
    the resume drops."""

    def __init__(self, reraise: bool = True, what: str = "the checkpoint"):
        self.reraise = reraise
        self.what = what

    def __enter__(self):
        self.received = None
        self.previous = {}
        for sig in (signal.SIGINT, *TERMINATING):
            try:
                self.previous[sig] = signal.signal(sig, self._hold)
            except ValueError:  # not in the main thread
                break
        return self

    def _hold(self, signum, frame):
        self.received = signum
        print(f"\n{signal.Signals(signum).name} received: finishing {self.what} first (it takes a moment) ...",
              file=sys.stderr, flush=True)

    def __exit__(self, exc_type, *exc):
        _restore(self.previous)
        if self.received is not None and exc_type is None and self.reraise:
            raise KeyboardInterrupt(signal.Signals(self.received).name)



def _restore(previous: dict):
    """Put back the handlers a block replaced (one installed from outside Python, which
    `signal.signal` reports as None, stays the default)."""
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)
