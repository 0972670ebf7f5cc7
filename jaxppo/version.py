"""The package version and the JAX releases it was tested on (a leaf module: checkpoints
record the version without importing the package, and nothing here imports jax)."""

from __future__ import annotations

import re
from typing import Optional

__version__ = "0.4.0"

# The JAX releases the test suite ran on (README, "Tested versions"): the whole suite on
# jax 0.10.2 (Python 3.11, the newest JAX for it) and its numerics on jax 0.12.0.1
# (Python 3.12). A newer minor release installs (there is no upper pin) and warns once at
# import; an older one than 0.10.2 is refused by the package's requirements.
TESTED_JAX = ("0.10.2", "0.12.0.1")


class UntestedJaxWarning(UserWarning):
    """The installed JAX is newer than any release jaxppo was tested on."""


def release(version: str) -> tuple:
    """The leading numbers of a version string as a tuple of ints: "0.12.0.1" -> (0, 12, 0, 1),
    "0.13.0rc1" -> (0, 13, 0), "0.11.0.dev20261001" -> (0, 11, 0)."""
    numbers = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        numbers.append(int(match.group()))
        if match.end() < len(part):
            break
    return tuple(numbers)


def untested_jax(version: str) -> Optional[str]:
    """The warning to give for JAX `version`: None for a minor release the suite ran on or
    an older one, else a sentence naming the version, the newest tested and what to do."""
    newest = max(TESTED_JAX, key=release)
    if release(version)[:2] <= release(newest)[:2]:
        return None
    return (f"jaxppo {__version__} was tested with jax {' and '.join(TESTED_JAX)}; the installed jax {version} is "
            f"newer than any of them. It may work; if it does not, `pip install 'jax=={newest}'` is the newest "
            "tested release (silence this with warnings.filterwarnings('ignore', "
            "category=jaxppo.version.UntestedJaxWarning)).")
