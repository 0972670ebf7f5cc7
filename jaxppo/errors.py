"""The errors jaxppo raises for problems a user can fix, in one place. Bad settings and
arguments are `ValueError` / `TypeError` at the boundary (naming the field, the value given
and what would be valid); these four name the other kinds."""

from __future__ import annotations

__all__ = ["RunError", "RewardError", "EpisodeError", "ToolCallError", "TOOL_ERROR_KINDS", "name_the_flag"]

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


def name_the_flag(message: str) -> str:
    """An error about a setting, as the command's user typed it: a message naming
    `<Concern>Config.x` (the Python API's names) and not the flag already gets the flag of
    its first such setting in front ("--batch-size: BatchConfig.batch_size=3 is not ...")."""
    import re

    match = re.search(r"\b([A-Z][A-Za-z]*Config)\.([a-z_0-9]+)\b", message)
    if match is None:
        return message
    flag = "--" + match.group(2).replace("_", "-")
    return message if flag in message else f"{flag}: {message}"
