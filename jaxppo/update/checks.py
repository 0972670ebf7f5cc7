"""The value checks the configs of every layer share: what counts as a count, a real number,
and the one shape of error message (`<Config>.<field>=<value> is invalid: ...`)."""

from __future__ import annotations

import math

__all__ = ["is_int", "is_real", "divisors", "invalid", "layer_config", "check_sizes"]


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


def check_sizes(owner: str, batch_size, mini_batch_size, ppo_epochs, gradient_accumulation_steps,
                rows: str = "row (a completion, or a reward model's pair)"):
    """ValueError unless the counts are positive ints and divide as the engine needs:
    `batch_size % mini_batch_size == 0` (every row in exactly one mini-batch per epoch) and
    `mini_batch_size % gradient_accumulation_steps == 0` (equal micro-batches). `owner`
    names the config in the message ("BatchConfig"), `rows` what a row is ("rollout row")."""
    sizes = dict(batch_size=batch_size, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs,
                 gradient_accumulation_steps=gradient_accumulation_steps)
    for name, value in sizes.items():
        if not is_int(value) or value <= 0:
            kind = "" if is_int(value) else f" (got type {type(value).__name__})"
            raise ValueError(f"{owner}.{name}={value!r} is invalid: {name} must be a positive int{kind}.")
    if batch_size % mini_batch_size:
        raise ValueError(
            f"{owner}.batch_size={batch_size} is not divisible by {owner}.mini_batch_size={mini_batch_size}: every "
            f"{rows} must land in exactly one mini-batch per epoch. Valid mini_batch_size values for this "
            f"batch_size: {divisors(batch_size)}.")
    if mini_batch_size % gradient_accumulation_steps:
        raise ValueError(
            f"{owner}.mini_batch_size={mini_batch_size} is not divisible by {owner}.gradient_accumulation_steps="
            f"{gradient_accumulation_steps}: a mini-batch must split into equal micro-batches. Valid "
            f"gradient_accumulation_steps values: {divisors(mini_batch_size)}.")
