"""Planning a run for an accelerator one does not have: its programs compiled for a GPU or
TPU target on this machine's CPU (`jax.experimental.topologies`), whether each fits per
device, and the iteration's floor (`jaxppo plan` on the command line).

    from jaxppo.plan import plan_run, resolve_target
    from jaxppo.run.parts import Inputs

    plan = plan_run(config, Inputs(policy="llama-8b/", tokenizer=None, prompts=None), resolve_target("h200x8"))
    print(plan.text())
"""

from jaxppo.plan.report import Plan, ProgramPlan, plan_run
from jaxppo.plan.targets import TARGETS, MissingExtra, Target, resolve_target, target_devices

__all__ = ["plan_run", "Plan", "ProgramPlan", "Target", "TARGETS", "resolve_target", "target_devices",
           "MissingExtra"]
