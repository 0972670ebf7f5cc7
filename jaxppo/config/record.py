"""What a run's settings record for its resume (`run_settings.json`), and how two records
are compared: by setting name, whatever concern or version wrote them.

`recorded(config, iterations)` is the part of a `jaxppo.Config` a resumed run must match:
every setting that is not free on resume (`jaxppo.config.fields.setting(free=True)`), by
concern, and the number of iterations where the learning-rate schedule's length depends on
it. `comparable(record)` reads a record of any version (0.4's and 0.5-dev's "ppo" and
"trainer" sections, 0.5's concerns) as {setting name: value}, the deprecated spellings
translated and the values at their defaults left out, so that a record written before a
setting moved, was renamed, or existed compares equal when nothing changed.
"""

from __future__ import annotations

import dataclasses
import json

from jaxppo.config.fields import is_free
from jaxppo.config.renamed import translate
from jaxppo.config.settings import CONCERNS, SETTINGS, Config, setting_field

__all__ = ["recorded", "comparable", "SECTIONS", "OLD_SECTIONS"]

SECTIONS = tuple(CONCERNS)  # a 0.5 record's sections
OLD_SECTIONS = ("ppo", "trainer")  # a record by 0.4 or 0.5-dev


def _json(value):
    """The JSON view of a value, as a record holds it (tuples as lists; others as text)."""
    return json.loads(json.dumps(value, default=str))


def recorded(config: Config, iterations: int) -> dict:
    """{concern: {setting: value}} of the settings a resumed run must match, JSON values."""
    out = {}
    for concern, part in config.concerns().items():
        if concern == "lora":  # recorded as the policy's adapters (`describe_model`), as before they were settings
            continue
        values = {f.name: _json(getattr(part, f.name)) for f in dataclasses.fields(part) if not is_free(f)}
        if values:
            out[concern] = values
    if _iterations_matter(config):  # the schedule's length: extending the run would change it
        out.setdefault("run", {})["iterations"] = iterations
    return out


def _iterations_matter(config: Config) -> bool:
    return config.optimizer.lr_schedule != "constant" or config.optimizer.warmup_is_fraction


def comparable(record: dict) -> dict:
    """{setting name: JSON value} of a record's settings (0.4's sections or 0.5's concerns),
    the deprecated names translated, free settings and values at their defaults left out
    (iterations kept where the record holds it)."""
    flat = {}
    for section in (*OLD_SECTIONS, *SECTIONS):
        part = record.get(section)
        if isinstance(part, dict):
            flat.update(part)
    iterations = flat.get("iterations")
    flat = {name: value for name, value in flat.items() if name not in ("iterations", "total_episodes", "tensorboard")}
    if isinstance(flat.get("stop_token_ids"), list):
        flat["stop_token_ids"] = tuple(flat["stop_token_ids"])
    flat = translate(flat)
    out = {}
    for name, value in flat.items():
        value = _json(value)
        if name in SETTINGS:
            field = setting_field(name)
            if is_free(field) or value == _json(_default(field)):
                continue
        out[name] = value
    if iterations is not None:
        out["iterations"] = iterations
    return out


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # pragma: no cover - every setting has a plain default
