"""The errors jaxppo raises for problems a user can fix, in one place. Bad settings and
arguments are `ValueError` / `TypeError` at the boundary (naming the field, the value given
and what would be valid); these four name the other kinds."""

from __future__ import annotations

__all__ = ["RunError", "RewardError", "EpisodeError", "ToolCallError", "TOOL_ERROR_KINDS"]

# What can be wrong with a tool call (`ToolCallError.kind`).
TOOL_ERROR_KINDS = ("parse", "unknown_tool", "bad_arguments", "raised", "timeout")


class RunError(RuntimeError):
    """A problem with the run directory (lock, settings, checkpoints, logs) that jaxppo
    cannot recover from by itself; the message says what was found and what to do."""


class RewardError(ValueError):
    """A reward function raised, or returned something other than one number per response."""


class EpisodeError(RuntimeError):
    """An environment raised, returned something other than a `StepResult`, or took longer
    than `environment_timeout`; raised before anything is updated."""


class ToolCallError(ValueError):
    """A tool call that cannot run; `kind` is one of `TOOL_ERROR_KINDS`."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
