#!/usr/bin/env bash
# Attempts 73, 74 and 75 (docs/perf-log/cuda_flash-issue-31b.md, sessions
# 37-39) on main with attempts-73-75.diff applied; variants T, P and M
# (ab-lib.sh). Head size 128 runs 75 alone (T and P against M); 64 adds 73,
# 256 adds 74 (T against P).
#   GPU_MODE=kernels (default): `scripts/gpu kernels 8q4k` on T (CUDA tests,
#     the exp2_poly probe tests among them; conformance), then P and M;
#   GPU_MODE=perf: `scripts/gpu perf` on M (docs/perf.md's table and charts,
#     main's kernels; perf.tar.gz), then T and P: one call for both.
# The others are rebuilt in place (the wgmma units), then all alternated
# while the call has time (LIMIT seconds). Results in $OUT: ab.txt,
# summary.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); DEADLINE=${LIMIT:-540}
source "$(dirname "$0")/ab-lib.sh"
MODE=${GPU_MODE:-kernels}
if [ "$MODE" = perf ]; then VARIANTS=(M T P); ARGS=(); LIM=380; else VARIANTS=(T P M); ARGS=(8q4k); LIM=200; fi
first=${VARIANTS[0]}
if set_variant $first; then
  OUT=/tmp/gpu-out PAGEDATTN_GPU_KEEP_BUILD=1 timeout $LIM scripts/gpu $MODE "${ARGS[@]}" > /tmp/gpu.log 2>&1
  t "$MODE on $first rc $?"
  cp /tmp/gpu-out/summary.txt "$O/summary.txt" 2>/dev/null
  grep -E "PASSED|FAILED|conformance:" /tmp/gpu.log | tee -a "$O/ab.txt"
  [ "$MODE" = perf ] && tar czf "$O/perf.tar.gz" -C /tmp/gpu-out . /tmp/gpu.log 2>/dev/null
  cp $B/bin/pagedattn_gpu_bench /tmp/v/$first
fi
cp $PRISTINE $H
for v in "${VARIANTS[@]:1}"; do build_variant $v; done
rounds "${VARIANTS[@]}"
t done
