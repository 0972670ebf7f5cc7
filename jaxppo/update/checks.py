"""The value checks the configs of every layer share: what counts as a count, a real number,
and the one shape of error message (`<Config>.<field>=<value> is invalid: ...`)."""

from __future__ import annotations

import math

__all__ = ["is_int", "is_real", "divisors", "invalid", "layer_config"]


def is_int(value) -> bool:
    """An int that is not a bool (a bool where a count is due is a mistake, not a 0/1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def divisors(n: int) -> list:
    """The positive divisors of `n`, for messages that list the valid sizes."""
    return [d for d in range(1, n + 1) if n % d == 0]


def invalid(owner: str, field: str, value, valid: str) -> ValueError:
    """The error for `owner.field=value`, saying what `field` must be (`valid`)."""
    return ValueError(f"{owner}.{field}={value!r} is invalid: {field} must be {valid}.")


def layer_config(config, cls: type, attribute: str, name: str):
    """The `cls` config of `config`: itself, or its `.<attribute>` (a `jaxppo.Config`
    hands over its layers' configs so); TypeError naming `name` (how users reach `cls`)."""
    if isinstance(config, cls):
        return config
    part = getattr(config, attribute, None)
    if isinstance(part, cls):
        return part
    raise TypeError(f"config must be a {name} or have one as .{attribute} (jaxppo.Config does), got "
                    f"{type(config).__name__}")
