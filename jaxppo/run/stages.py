"""Deprecated since 0.5 (removed in 0.6): one iteration's stages are `jaxppo.run.iteration`,
in the order the data flows (`score` is `reward`, `build_rollout` is `build`), and the
compiled-program plumbing is `jaxppo.run.compiled` (`Precompiled`, `PackedSteps`,
`abstract_rollout`, `precompile`)."""

import warnings

from jaxppo.run.compiled import PackedSteps, Precompiled, abstract_rollout, precompile  # noqa: F401
from jaxppo.run.iteration import (Built, mesh_context, prompt_rows, row_advantages, sample, scoring_streams,  # noqa: F401
                                  select_prompts, skip, update)
from jaxppo.run.iteration import build as build_rollout  # noqa: F401
from jaxppo.run.iteration import reward as score  # noqa: F401

warnings.warn("jaxppo.run.stages is deprecated since 0.5 and will be removed in 0.6: import jaxppo.run.iteration "
              "(score is reward, build_rollout is build) and jaxppo.run.compiled (Precompiled, PackedSteps)",
              DeprecationWarning, stacklevel=2)
