"""A training run: one iteration's stages, and the parts that run them.

- `trainer`: `Trainer`, which coordinates the parts below;
- `iteration`: one iteration, in the order its data flows (select prompts, sample,
  reward, build, check, update, metrics), and its values (`Collected`, `Built`,
  `Prepared`, `Outcome`); `state`: `RunState`, everything carried to the next iteration;
- `parts`: every part of a run built from a `jaxppo.Config` and the trainer's inputs
  (`RunParts`); `assembly`: the models; `compiled`: the update's compiled programs (one
  device, a mesh, packed streams) and their compile ahead of time;
- `pipeline`: pipelined iterations (`Producer` threads, the trainer's `Pipeline`);
  `evaluation`: evaluation during training;
- `directory`: the run directory (`RunDirectory`: the lock, the saved settings, saving and
  restoring checkpoints, `resume_from`); `checkpoints`: the orbax files;
- `outputs`: exports, Hugging Face checkpoints during the run, completion tables
  (`Outputs`);
- `loop`: signals, progress, logging and the checkpoint cadence, given its collaborators;
  `logger`, `report`: the metrics lines, trackers and the summary; `callbacks`;
  `interrupts`: Ctrl-C and SIGTERM.
"""

from jaxppo.run.state import RunState

__all__ = ["RunState"]
