#!/usr/bin/env bash
# The GPU check in one command, for one H200, at most 8 minutes (GPU_CHECK_BUDGET_S):
#   environment    torch, CUDA, cuDNN, GPU; fails when there is no GPU
#   kernel_tests   tests/kernels/: every kernel backend the build has (cudnn,
#                  flash, efficient, math; flash_attn when installed) against the float64
#                  reference, their self-checks, NaN/inf semantics, host syncs; a backend
#                  that fails its self-check FAILS here, it is not skipped; and the 2026
#                  paths (test_new_paths_device.py): sliding windows, attention sinks and
#                  a value head size of its own through usp_attention on each backend, the
#                  MoE experts' grouped GEMM against the loop, the gated delta rule kernel
#                  against its recurrence; with usp[fla] installed, fla's gated delta rule,
#                  fla's simple GLA under Mamba-2 (mamba2_usp, kernel="fla") and
#                  causal-conv1d's short conv against usp's torch path (a self-check
#                  failure fails; skipped without the packages)
#   cuda_tests     every other test marked @pytest.mark.cuda (none yet is fine)
#   plan_check     benchmarks/plan_check.py: usp plan's fake-tensor memory estimate of 4
#                  layers of Llama-3.1-8B at 64k tokens (one of 8 ranks) against
#                  torch.cuda.max_memory_allocated of the same step; fails beyond 10%
#   overheads      benchmarks/overheads_check.py: each of usp plan's named overheads
#                  (CUDA context, a one-rank NCCL communicator from nvidia-smi before and
#                  after, each CUDA backend's backward workspace, the allocator reserve
#                  with and without expandable_segments, pinned rounding, a rank's VmRSS)
#                  against the planner's figure; fails where the planner is optimistic
#   kernel_bench   benchmarks/kernel_bench.py: TFLOP/s per backend at 8k, 32k, 128k
#                  tokens; exits non-zero when a backend is unavailable or fails
#   emulate        benchmarks/emulate.py: one rank of 8- and 64-rank jobs (fake group)
#   peers          benchmarks/peers.py: usp next to PyTorch context parallel and others
#   train_emulate  benchmarks/train_emulate.py: one rank's training step
#   host_overhead  benchmarks/host_overhead.py --device auto (cuda): the host time of one
#                  usp_attention layer call beyond its kernels (bf16, auto backend, fake
#                  group), the GPU time it spans, and its aten ops
#   cuda_graph     benchmarks/cuda_graph_check.py --cases 2: the compiled layer call
#                  (fullgraph, mode reduce-overhead, cudagraph_or_error) captured as a
#                  CUDA graph: packed documents at Plan(None) equal to eager, a ring of 8
#                  (fake group) captured; host ms eager / compiled / replayed; fails when
#                  a call is not captured or not equal
#   moe_experts    benchmarks/moe_experts.py --device auto (cuda) --dtype bfloat16: Qwen3-30B-A3B's
#                  experts at 512 tokens, the per-expert loop against torch._grouped_mm
#                  (and the sorted segments); ms and ratios; fails when a variant differs
#                  from the loop by more than 5e-2 (relative, bf16)
#   placement      benchmarks/placement_device.py --device auto: one rank's attention layer
#                  (bf16, 32/8 heads of 128, fake group) on a mixed-length 128k row of the
#                  fine-tuning mix, token placement "sequence" against "documents" on u1xr8
#                  and u8xr1: ms and bytes; fails when the bytes differ from the formula
#
#   bash benchmarks/gpu_check.sh [RESULTS_DIR]     # default: results/
#
# Every step runs even if an earlier one failed, under its own time limit and the
# overall budget; a step the budget leaves no time for is a failure ("not run"), as is
# a missing script. Each step's output is in RESULTS_DIR/<step>.log; the summary is
# RESULTS_DIR/gpu_check.json and gpu_check.md. Exit status 1 if anything failed.
# Environment: PYTHON (default python), GPU_CHECK_BUDGET_S (default 480),
# GPU_CHECK_ALLOW_CPU=1 (run without a GPU: only to test this script).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=${1:-results}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
MIN_STEP_S=15 # a step is not started with less time than this left
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
STEP_ROWS=() # name|status|rc|seconds|limit|note
FAILED=()

record() { # record NAME STATUS RC SECONDS LIMIT NOTE
    STEP_ROWS+=("$1|$2|$3|$4|$5|$6")
    if [ "$2" != ok ]; then FAILED+=("$1 ($2)"); fi
}

step() { # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 left began rc seconds status note=""
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt "$MIN_STEP_S" ]; then
        echo "=== $name: NOT RUN, ${left} s of the ${BUDGET} s budget left" | tee "$OUT/$name.log"
        record "$name" "not run" "" 0 "$limit" "out of the ${BUDGET} s budget"
        return
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    echo "=== $name (limit ${limit} s): $*"
    began=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    seconds=$(($(date +%s) - began))
    case $rc in
        0) status=ok ;;
        124 | 137) status="timed out" ;;
        *) status=failed ;;
    esac
    if [ "$name" = cuda_tests ] && [ "$rc" -eq 5 ]; then # pytest: no test selected
        status=ok
        note="no CUDA-marked tests outside tests/kernels/"
    fi
    echo "=== $name: $status (exit $rc) after $seconds s"
    record "$name" "$status" "$rc" "$seconds" "$limit" "$note"
}

script_step() { # script_step NAME SECONDS SCRIPT ARGS...: a step whose script may be missing
    local name=$1 limit=$2 script=$3
    if [ ! -f "$script" ]; then
        echo "=== $name: FAILED: $script does not exist, so this step cannot run" | tee "$OUT/$name.log"
        record "$name" "missing" "" 0 "$limit" "$script does not exist"
        return
    fi
    step "$name" "$limit" "$PYTHON" "$@"
}

# shellcheck disable=SC2016 # the Python snippet is single-quoted on purpose
step environment 60 "$PYTHON" -c '
import os, subprocess, torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
    try:
        print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True).stdout)
    except OSError as err:
        print("nvidia-smi:", err)
elif os.environ.get("GPU_CHECK_ALLOW_CPU") == "1":
    print("no GPU: GPU_CHECK_ALLOW_CPU=1, running the steps on CPU (a test of this script)")
else:
    raise SystemExit("no CUDA GPU visible to torch: this is the GPU check")
'
cp "$OUT/environment.log" "$OUT/environment.txt" 2>/dev/null || true

step kernel_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider -rfEsxX \
    --junitxml="$OUT/kernel_tests.xml" tests/kernels
step cuda_tests 90 "$PYTHON" -m pytest -q -p no:cacheprovider -rfEsxX -m cuda \
    --junitxml="$OUT/cuda_tests.xml" --ignore=tests/kernels tests
# the planner's checks next: an optimistic plan is an out-of-memory on a booked cluster,
# so a short budget still runs them
script_step plan_check 120 benchmarks/plan_check.py benchmarks/plan_check.py --out "$OUT"
script_step overheads 150 benchmarks/overheads_check.py benchmarks/overheads_check.py --out "$OUT"
step kernel_bench 120 "$PYTHON" benchmarks/kernel_bench.py --out "$OUT"
step emulate 180 "$PYTHON" benchmarks/emulate.py --out "$OUT"
script_step peers 90 benchmarks/peers.py benchmarks/peers.py --out "$OUT"
script_step train_emulate 90 benchmarks/train_emulate.py benchmarks/train_emulate.py --out "$OUT"
step host_overhead 60 "$PYTHON" benchmarks/host_overhead.py --device auto --repeats 100 --out "$OUT"
script_step cuda_graph 150 benchmarks/cuda_graph_check.py benchmarks/cuda_graph_check.py \
    --cases 2 --out "$OUT"
script_step moe_experts 60 benchmarks/moe_experts.py benchmarks/moe_experts.py --device auto \
    --dtype bfloat16 --shapes qwen3-30b-a3b --repeats 5 --max-error 5e-2 --out "$OUT"
script_step placement 60 benchmarks/placement_device.py benchmarks/placement_device.py \
    --device auto --out "$OUT"

# ------------------------------------------------------------------ summary
json_string() { # a JSON string literal of $1
    local s=${1//\\/\\\\}
    s=${s//\"/\\\"}
    printf '"%s"' "$s"
}
elapsed=$(($(date +%s) - START))
passed=true
[ ${#FAILED[@]} -ne 0 ] && passed=false
{
    printf '{\n "date": %s,\n "budget_s": %s,\n "elapsed_s": %s,\n "passed": %s,\n "steps": [' \
        "$(json_string "$(date -u +%Y-%m-%dT%H:%M:%SZ)")" "$BUDGET" "$elapsed" "$passed"
    sep=""
    for row in "${STEP_ROWS[@]}"; do
        IFS='|' read -r name status rc seconds limit note <<<"$row"
        printf '%s\n  {"name": %s, "status": %s, "exit": %s, "seconds": %s, "limit_s": %s, "log": %s, "note": %s}' \
            "$sep" "$(json_string "$name")" "$(json_string "$status")" "${rc:-null}" "$seconds" \
            "$limit" "$(json_string "$OUT/$name.log")" "$(json_string "$note")"
        sep=","
    done
    printf '\n ]\n}\n'
} >"$OUT/gpu_check.json"
{
    echo "# GPU check $(date -u +%Y-%m-%d), $elapsed s of a $BUDGET s budget: $([ "$passed" = true ] && echo passed || echo FAILED)"
    echo
    head -n 3 "$OUT/environment.txt" 2>/dev/null
    echo
    echo "| step | status | exit | seconds | limit s | note |"
    echo "|---|---|---|---|---|---|"
    for row in "${STEP_ROWS[@]}"; do
        IFS='|' read -r name status rc seconds limit note <<<"$row"
        echo "| $name | $status | $rc | $seconds | $limit | $note |"
    done
} >"$OUT/gpu_check.md"

if [ "$passed" != true ]; then
    echo "GPU check FAILED after $elapsed s: ${FAILED[*]} (logs and gpu_check.md in $OUT/)"
    exit 1
fi
echo "GPU check passed in $elapsed s; results in $OUT/"
