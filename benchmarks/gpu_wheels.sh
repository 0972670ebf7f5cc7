#!/bin/bash
# What TRL 1.12 needs on the device machine that its image lacks (trl, datasets, dill,
# multiprocess; pyarrow in case the image's is older than datasets asks), as wheels for
# its Python 3.12, into wheels/ (ignored by git; pass it to the device tool's `carry`).
# Run here, where the package registry is reachable:  bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any -d wheels \
  trl==1.12.0 datasets==5.2.0 "dill<0.4.2,>=0.3.0" "multiprocess<0.70.20" "pyarrow>=24.0.0"
ls -la wheels
du -sh wheels
