"""What every concern's config shares: a field's rule on resume and whether it is a flag of
the command, the checks of values of one kind, and the methods each config has."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

from jaxppo.update.checks import invalid, is_int, is_real

__all__ = ["setting", "is_free", "is_flag", "Concern", "describe", "check_bools", "check_counts", "check_real", "check_choice",
           "check_optional_real"]


def setting(default, *, free: bool = False, flag: bool = True):
    """A config field with its `default`. `free`: it may differ when a run resumes (it
    changes how the run computes or what it writes, never its results); the others are
    recorded in the run's settings and a resumed run must match them. `flag`: the `jaxppo`
    command has a flag for it (`--name-with-dashes`)."""
    return dataclasses.field(default=default, metadata={"free": free, "flag": flag})


def is_free(field: dataclasses.Field) -> bool:
    """The field may differ on resume (`setting(..., free=True)`)."""
    return field.metadata.get("free", False)


def is_flag(field: dataclasses.Field) -> bool:
    """The command has a flag for the field (`setting(..., flag=False)` says it has not)."""
    return field.metadata.get("flag", True)


class Concern:
    """The methods each concern's config (a frozen dataclass) has."""

    def replace(self, **changes):
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple:
        """The names of its settings."""
        return tuple(f.name for f in dataclasses.fields(cls))


_ENTRY = re.compile(r"^(\w+(?:, \w+)*):\s*(.*)$")


def describe(cls) -> dict:
    """{setting name: what the `Attributes:` section of the class's docstring says of it},
    each entry's lines joined (an entry may describe several: `adam_beta1, adam_beta2:
    Adam's.`). The command's help and the docs' table of settings read it."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    out, names = {}, ()
    for line in section.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        entry = _ENTRY.match(line.strip())
        if indent <= 2 and entry:
            names = tuple(entry.group(1).split(", "))
            for name in names:
                out[name] = entry.group(2)
        elif indent <= 2:
            break  # the section ended
        else:
            for name in names:
                out[name] += " " + line.strip()
    return out


def check_bools(config, names) -> None:
    """Each of `names` holds a bool (a string or an int where a bool is due is a mistake)."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise invalid(type(config).__name__, name, getattr(config, name), "a bool (True or False)")


def check_counts(config, names, least: int = 1) -> None:
    """Each of `names` holds an int >= `least` (not a bool)."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value) or value < least:
            kind = "" if is_int(value) or isinstance(value, bool) else f" (got type {type(value).__name__})"
            raise invalid(type(config).__name__, name, value, ("a positive int" if least == 1 else f"an int >= {least}")
                          + kind)


def check_real(config, name: str, low=None, high=None, *, low_open=False, high_open=False, note: str = "") -> None:
    """`name` holds a finite real number in the interval given (bounds None: unbounded;
    `*_open`: the bound itself excluded)."""
    value = getattr(config, name)
    ok = is_real(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise invalid(type(config).__name__, name, value, _interval(low, high, low_open, high_open) + note)


def check_optional_real(config, name: str, low=None, *, low_open=False, none: str = "None") -> None:
    """`name` holds None or a finite real number >= `low` (> with `low_open`)."""
    value = getattr(config, name)
    if value is None:
        return
    if not is_real(value) or (low is not None and (value <= low if low_open else value < low)):
        bound = "" if low is None else f" {'>' if low_open else '>='} {low:g}"
        raise invalid(type(config).__name__, name, value, f"{none} or a finite real number{bound}")


def check_choice(config, name: str, valid, note: str = "") -> None:
    """`name` holds one of `valid`."""
    if getattr(config, name) not in valid:
        raise invalid(type(config).__name__, name, getattr(config, name),
                      "one of " + ", ".join(map(repr, valid)) + note)


def _interval(low, high, low_open, high_open) -> str:
    if low is not None and high is not None:
        return f"a real number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"a finite real number {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"a finite real number {'<' if high_open else '<='} {high:g}"
    return "a finite real number"


def finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
