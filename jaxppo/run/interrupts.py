"""Signals around the training loop: SIGTERM ends a run the way Ctrl-C does, and both are
held (not lost) while a checkpoint or an iteration's result is being committed."""

from __future__ import annotations

import signal
import sys

__all__ = ["interrupts_raise", "interrupts_held"]


class interrupts_raise:
    """SIGTERM raises KeyboardInterrupt (as Ctrl-C does) inside the block, so both end in
    the same checkpoint-and-exit path. Only in the main thread (signals cannot be set
    elsewhere)."""

    def __enter__(self):
        self.previous = None
        try:
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        except ValueError:  # not in the main thread
            pass
        return self

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


class interrupts_held:
    """Ctrl-C and SIGTERM inside the block (a checkpoint being written, an iteration's state
    and metrics line being committed) are held: a message says what is being finished, and
    a KeyboardInterrupt is raised once the block is complete (unless `reraise=False`, for a
    block inside the interrupt's own handling). SIGKILL cannot be held; a kill mid-save
    leaves the earlier checkpoints, a kill mid-line a torn line that the resume drops."""

    def __init__(self, reraise: bool = True, what: str = "the checkpoint"):
        self.reraise = reraise
        self.what = what

    def __enter__(self):
        self.received = None
        self.previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._hold)
            except ValueError:  # not in the main thread
                pass
        return self

    def _hold(self, signum, frame):
        self.received = signum
        print(f"\n{signal.Signals(signum).name} received: finishing {self.what} first (it takes a moment) ...",
              file=sys.stderr, flush=True)

    def __exit__(self, exc_type, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received is not None and exc_type is None and self.reraise:
            raise KeyboardInterrupt(signal.Signals(self.received).name)

