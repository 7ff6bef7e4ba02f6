#!/usr/bin/env bash
# The GPU measurements of issues 5 and 6 in one go, on nvidia-h200-x2 (about 4-5 minutes; every step
# has its own deadline, 530 s in all, and a failed step does not stop the next):
#
#   1. deep-ep info; deep-ep jit warmup (a cache hit when the cache is warm)
#   2. deep-ep calibrate -> $OUT/hopper.json, then installed as deep_ep/data/hopper.json so that the
#      benchmarks below plan with the calibrated rates
#   3. the planner's SM sweep (issue 5): deep-ep bench --sms 4,...,64 (FP8, uniform) -> $OUT/sweep.{json,png}
#   4. issue 6's table: FP8 and BF16, uniform and imbalanced routing, the planner's pick plus 16 and
#      24 SMs, kernel breakdown of the planner's cases -> $OUT/table.{json,png}
#
# Usage, from the repository root (the device tool sets $OUT; elsewhere it defaults to bench/results/latest):
#   EP_BENCH_COMMIT=$(git rev-parse HEAD) bash bench/run_gpu_bench.sh
# Six files come back: hopper.json, sweep.json, sweep.png, table.json, table.png, run_gpu_bench.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/latest}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
LOG="$OUT/run_gpu_bench.log"
: >"$LOG"

# Never NVLink multicast on these machines (deep_ep.utils.spawn sets the same in every rank)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${EP_BENCH_COMMIT:-}" ]; then
    EP_BENCH_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
fi
export EP_BENCH_COMMIT

started=$SECONDS
step() { echo "=== [$((SECONDS - started)) s] $*" | tee -a "$LOG"; }

# run LIMIT_S ARGS...: `deep-ep ARGS...` with a deadline, output to the terminal and the log
run() {
    local limit=$1
    shift
    timeout --kill-after=10 "$limit" "$PYTHON" -m deep_ep.cli "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "!!! deep-ep $* exited with $rc$([ "$rc" -eq 124 ] && echo ' (deadline)')" | tee -a "$LOG"
    fi
    return "$rc"
}

step "commit $EP_BENCH_COMMIT; writing to $OUT"
run 30 info
run 60 jit warmup --no-progress

step "calibrate (deadline 120 s)"
if run 120 calibrate --out "$OUT/hopper.json"; then
    cp "$OUT/hopper.json" deep_ep/data/hopper.json
    step "calibrated rates installed in deep_ep/data/hopper.json"
else
    step "calibration failed: the benchmarks plan with the committed rates"
fi

step "issue 5: the planner's SM sweep (deadline 160 s)"
run 160 bench --sms 4,8,12,16,20,24,32,48,64 --iters 20 --json "$OUT/sweep.json" --plot "$OUT/sweep.png"

step "issue 6: FP8/BF16 x uniform/imbalanced, planner's pick + 16 and 24 SMs (deadline 160 s)"
run 160 bench --dtype fp8,bf16 --routing uniform,imbalanced --sms 16,24 --iters 20 --breakdown \
    --json "$OUT/table.json" --plot "$OUT/table.png"

step "done"
ls -l "$OUT" | tee -a "$LOG"
