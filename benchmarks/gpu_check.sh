#!/usr/bin/env bash
# The GPU check in one command, for one H200 (about 5 minutes, at most ~9.5 with the
# per-step time limits below):
#   1. tests/test_kernels.py: every CUDA kernel backend present (cuDNN, FA2, efficient,
#      flash-attn when installed) against the float64 reference;
#   2. benchmarks/kernel_bench.py: TFLOP/s of each backend at 8k, 32k and 128k tokens;
#   3. benchmarks/emulate.py: one rank of 8- and 64-rank jobs under the fake process
#      group (128k tokens on 8 ranks for every grid, 1M tokens on 64 ranks at 8 x 8).
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     # default: results/
#
# Every step runs even if an earlier one failed; each step's output is in
# RESULTS_DIR/<step>.log next to kernels.{json,md} and emulate.{json,md}. The exit
# status is non-zero if any step failed or ran past its limit.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${1:-results}
mkdir -p "$OUT"
failed=()

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    echo "=== $name (limit ${limit} s): $*"
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $(($(date +%s) - start)) s"
    if [ "$rc" -ne 0 ]; then failed+=("$name (exit $rc)"); fi
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    $PYTHON -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"cudnn", torch.backends.cudnn.version(), "gpu", torch.cuda.is_available())'
} 2>&1 | tee "$OUT/environment.txt"

step kernel_tests 150 "$PYTHON" -m pytest -q tests/test_kernels.py
step kernel_bench 120 "$PYTHON" benchmarks/kernel_bench.py --out "$OUT"
step emulate 300 "$PYTHON" benchmarks/emulate.py --out "$OUT"

if [ ${#failed[@]} -ne 0 ]; then
    echo "GPU check FAILED: ${failed[*]}"
    exit 1
fi
echo "GPU check passed; results in $OUT/"
