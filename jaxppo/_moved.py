"""The module paths of jaxppo 0.3 (a flat package), kept working after 0.4 moved the modules
into subpackages: `import jaxppo.engine` gives `jaxppo.update.engine` itself (the same module
object) with a `DeprecationWarning` naming the new path. Nothing is copied, so there is one
definition of everything."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# jaxppo 0.3's module -> where it lives now. `math` and `critic_free` were split between
# `jaxppo.update.advantages` and `jaxppo.update.losses`: their old names give the
# `jaxppo.update` namespace, which holds every function of both.
MOVED = {
    "engine": "update.engine", "stats": "update.stats", "kl": "update.kl", "correction": "update.correction",
    "shaping": "update.shaping", "rollout_types": "update.batch", "packing": "update.packing",
    "ppo": "update.ppo", "critic_free": "update", "math": "update",
    "prompts": "rollout.prompts", "rewards": "rollout.rewards", "environments": "rollout.environments",
    "tools": "rollout.tools", "dynamic": "rollout.dynamic", "vllm_engine": "rollout.vllm",
    "trainer": "run.trainer", "stages": "run.stages", "loop": "run.loop", "run_state": "run.state",
    "checkpoint": "run.checkpoints", "rundir": "run.directory", "resume": "run.resume", "assembly": "run.assembly",
    "export": "run.export", "report": "run.report", "logger": "run.logger", "interrupts": "run.interrupts",
    "failpoints": "testing.failpoints", "toy": "testing.toy",
}


def new_name(old: str) -> str:
    """The module's full name now, for a 0.3 name such as "engine" or "jaxppo.engine"."""
    return "jaxppo." + MOVED[old.removeprefix("jaxppo.")]


class _Alias(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        target = new_name(module.__name__)
        warnings.warn(f"{module.__name__} moved to {target} in jaxppo 0.4; import it from there", DeprecationWarning,
                      stacklevel=2)
        # The import system returns what sys.modules holds under the name after this call.
        sys.modules[module.__name__] = importlib.import_module(target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("jaxppo.") and fullname.count(".") == 1 and fullname[7:] in MOVED:
            return importlib.machinery.ModuleSpec(fullname, _Alias())
        return None


def install():
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
