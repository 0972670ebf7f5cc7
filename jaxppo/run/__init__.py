"""A training run: the loop around the stages of one iteration.

- `trainer`: `Trainer` (also `PPOTrainer`), the loop's owner;
- `stages`: one iteration as functions of their inputs; `loop`: signals, progress,
  logging, checkpoint cadence;
- `state`: `RunState`, everything carried from one iteration to the next;
- `assembly`: models and the optimizer from what the user gave;
- `directory`: the run directory (atomic writes, the lock, saved settings);
  `checkpoints`: orbax checkpoints; `save_restore`: claiming a run, saving and restoring it;
- `logger`, `report`: metric logs and the summary; `export`: Hugging Face and PEFT
  exports; `interrupts`: Ctrl-C and SIGTERM.
"""
