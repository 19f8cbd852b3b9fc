#!/usr/bin/env bash
# Attempts 73-75 for a short call, on main with attempts-73-75.diff applied:
# T (the tree) built by `scripts/gpu build`, then P and M (ab-lib.sh; the
# wgmma units rebuilt), alternated while the call has time; then, time
# allowing, T's CUDA tests (the exp2_poly probe tests among them) and one
# conformance pass (what keeping any of them needs).
# LIMIT: the seconds the call may run. Results in $OUT: ab.txt, tests.txt,
# conformance.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s)
L=${LIMIT:-360}
# A call of 400 s or more keeps its last 100 s for T's tests and conformance.
R=10; [ "$L" -ge 400 ] && R=100
DEADLINE=$((L - R - 25))
source "$(dirname "$0")/ab-lib.sh"
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$O/ab.txt"
# BENCH_ONLY=1 (a call under about 300 s): the timing driver alone.
targets=(pagedattn_cli pagedattn_tests pagedattn_gpu_bench); [ "${BENCH_ONLY:-0}" = 1 ] && targets=(pagedattn_gpu_bench)
OUT=/tmp/gpu-out PAGEDATTN_GPU_KEEP_BUILD=1 scripts/gpu build "${targets[@]}" > /tmp/b_T.log 2>&1; rc=$?
t "T built $rc"; [ $rc = 0 ] || tail -40 /tmp/b_T.log | tee -a "$O/ab.txt"
cp $B/bin/pagedattn_gpu_bench /tmp/v/T; cp $B/bin/pagedattn_tests /tmp/v/Ttests 2>/dev/null; cp $B/bin/pagedattn /tmp/v/Tcli 2>/dev/null
for v in P M; do build_variant $v; done
rounds T P M
DEADLINE=$((L - 60))
if left; then
  timeout $((L - 45 - $(date +%s) + S)) /tmp/v/Ttests --gtest_filter='*Cuda*:*FlashPlanner*:*RejectedForward*:*PlainVariant*' \
    > /tmp/tests.log 2>&1; t "T tests rc $?"; tail -5 /tmp/tests.log > "$O/tests.txt"; grep "FAILED" /tmp/tests.log >> "$O/tests.txt"
fi
DEADLINE=$((L - 40))
if left; then
  timeout $((L - 10 - $(date +%s) + S)) /tmp/v/Tcli conformance --backend CUDA_FLASH --device cuda --threads 8 \
    > /tmp/conf.log 2>&1; t "T conformance rc $?"; tail -1 /tmp/conf.log | tee "$O/conformance.txt"
fi
t done
