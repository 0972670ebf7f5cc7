#!/bin/bash
# Issue 56's device calls (each about 7 minutes; results as JSON in $OUT):
#   bash benchmarks/gpu_side_by_side.sh defaults   # jaxppo's whole PPO and GRPO iterations at both
#                                                  # layouts with its defaults, then TRL 1.12's on the
#                                                  # same GPU from the same random weights
#   bash benchmarks/gpu_side_by_side.sh variants   # jaxppo's variants (unrolled layers, autodiff gated
#                                                  # MLP, cuDNN attention), the update's program memory
#                                                  # at mini-batches of 16 and 32 (gpu.py)
# Here, once: bash benchmarks/gpu_wheels.sh (wheels/, carried: run(..., carry=["wheels"])).
# JAX_BUDGET / TRL_BUDGET: seconds after which a side starts no new case.
set -u
cd "$(dirname "$0")/.."
PART=${1:-defaults}
OUT=${OUT:-/tmp/jaxppo-gpu-out}; mkdir -p "$OUT"
WEIGHTS=/tmp/jaxppo-gpu-weights
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.csv" 2>&1
if [ "$PART" = variants ]; then
  python3 benchmarks/gpu_iteration.py --weights "$WEIGHTS" --budget-s "${JAX_BUDGET:-300}" \
    --variants "unrolled layers,autodiff gated MLP,cudnn attention" \
    --out "$OUT/gpu_iteration_variants.json" > "$OUT/variants.log" 2>&1
  tail -n 20 "$OUT/variants.log"
  for layout in qwen2.5-0.5b qwen3-1.7b; do
    python3 benchmarks/gpu.py --layout $layout --sections "train bf16 scan remat chunk128 mini-batch 32,train bf16 scan remat chunk128" \
      --budget-s 40 --out "$OUT/gpu_memory_$layout.json" > "$OUT/memory_$layout.log" 2>&1
    tail -n 6 "$OUT/memory_$layout.log"
  done
  exit 0
fi
python3 benchmarks/gpu_iteration.py --weights "$WEIGHTS" --budget-s "${JAX_BUDGET:-230}" --variants defaults \
  --out "$OUT/gpu_iteration_jaxppo.json" > "$OUT/jaxppo.log" 2>&1
tail -n 8 "$OUT/jaxppo.log"
EXTRA=/tmp/trl-packages
python3 -m pip install -q --no-index --find-links wheels --no-deps --target "$EXTRA" trl datasets dill multiprocess
if ! PYTHONPATH="$EXTRA:$PYTHONPATH" python3 -c "import datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links wheels --no-deps --target "$EXTRA" pyarrow
fi
PYTHONPATH="$EXTRA:$PYTHONPATH" python3 benchmarks/gpu_iteration.py --side trl --weights "$WEIGHTS" \
  --budget-s "${TRL_BUDGET:-120}" --out "$OUT/gpu_iteration_trl.json" > "$OUT/trl.log" 2>&1
tail -n 8 "$OUT/trl.log"
