#!/bin/bash
# The prepared device calls (each about 7 minutes; results as JSON in $OUT), one part a call:
#   bash benchmarks/gpu_calls.sh iteration   # issue 56: jaxppo's whole PPO and GRPO iterations at
#                                            # both layouts with its defaults, then TRL 1.12's on the
#                                            # same GPU from the same random weights
#   bash benchmarks/gpu_calls.sh variants    # issue 56: jaxppo's variants (unrolled layers, autodiff
#                                            # gated MLP, cuDNN attention), the update's program memory
#                                            # at mini-batches of 16 and 32 (gpu.py)
#   bash benchmarks/gpu_calls.sh sampling    # issue 57: the samplers' decode sweep against the HBM
#                                            # floor, then transformers' generate
# Here, once, for "iteration": bash benchmarks/gpu_wheels.sh (wheels/; run(..., carry=["wheels"])).
# JAX_BUDGET / TRL_BUDGET: seconds after which a side starts no new case.
set -u
cd "$(dirname "$0")/.."
PART=${1:-iteration}
OUT=${OUT:-/tmp/jaxppo-gpu-out}; mkdir -p "$OUT"
WEIGHTS=/tmp/jaxppo-gpu-weights
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/device.csv" 2>&1
if [ "$PART" = sampling ]; then
  python3 benchmarks/gpu_sampling.py --budget-s "${JAX_BUDGET:-150}" \
    --out "$OUT/gpu_sampling_jaxppo.json" > "$OUT/sampling.log" 2>&1
  tail -n 25 "$OUT/sampling.log"
  python3 benchmarks/gpu_sampling.py --side torch --budget-s "${TORCH_BUDGET:-90}" \
    --out "$OUT/gpu_sampling_torch.json" > "$OUT/sampling_torch.log" 2>&1
  tail -n 10 "$OUT/sampling_torch.log"
  exit 0
fi
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
