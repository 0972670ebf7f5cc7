"""The embedded demo, from Python: a tiny byte-level policy learns to write lowercase letters.

Equivalent to running `jaxppo` with no arguments (any `jaxppo` flag works here too):

    python examples/demo.py                       # ~1-2 minutes on 2 CPU cores
    python examples/demo.py --iterations 20 --output-dir runs/quick

It writes runs/demo/metrics.jsonl, runs/demo/metrics.png, TensorBoard events,
checkpoints on interrupt, and the final policy as a Hugging Face directory.
"""

import sys

from jaxppo.cli import build_trainer, resolve


def main(argv=None):
    config, extras = resolve(argv)
    trainer = build_trainer(config, extras)
    return trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
