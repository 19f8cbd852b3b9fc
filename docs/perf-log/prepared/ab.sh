#!/usr/bin/env bash
# Attempts 73, 74 and 75 (docs/perf-log/cuda_flash-issue-31b.md, sessions
# 37-39) on main with attempts-73-75.diff applied; variants T, P and M
# (variants.sh). Head size 128 runs 75 alone (T and P against M); 64 adds 73,
# 256 adds 74 (T against P).
#   GPU_MODE=kernels (default): `scripts/gpu kernels 8q4k` on T (CUDA tests,
#     the exp2_poly probe tests among them; conformance), then P and M;
#   GPU_MODE=perf: `scripts/gpu perf` on M (docs/perf.md's table and charts,
#     main's kernels; perf.tar.gz), then T and P: one call for both.
# The others are rebuilt in place (the wgmma units), then all alternated
# while the call has time (LIMIT seconds). Results in $OUT: ab.txt,
# summary.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
source "$(dirname "$0")/variants.sh"
LIMIT=${LIMIT:-540}
MODE=${GPU_MODE:-kernels}
if [ "$MODE" = perf ]; then VARIANTS=(M T P); ARGS=(); LIM=380; else VARIANTS=(T P M); ARGS=(8q4k); LIM=200; fi
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
cp $H /tmp/wgmma.cuh
mkdir -p /tmp/v
for v in "${VARIANTS[@]}"; do
  set_variant $v || { t "$v: an edit missed its line; not built"; continue; }
  if [ $v = "${VARIANTS[0]}" ]; then
    OUT=/tmp/gpu-out PAGEDATTN_GPU_KEEP_BUILD=1 timeout $LIM scripts/gpu $MODE "${ARGS[@]}" > /tmp/gpu.log 2>&1
    t "$MODE on $v rc $?"
    cp /tmp/gpu-out/summary.txt "$O/summary.txt" 2>/dev/null
    grep -E "PASSED|FAILED|conformance:" /tmp/gpu.log | tee -a "$O/ab.txt"
    [ "$MODE" = perf ] && tar czf "$O/perf.tar.gz" -C /tmp/gpu-out . /tmp/gpu.log 2>/dev/null
    cp $B/bin/pagedattn_gpu_bench /tmp/v/$v
  else
    ninja -C $B pagedattn_gpu_bench > /tmp/b_$v.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$v; t "$v built $?"
  fi
done
cp /tmp/wgmma.cuh $H
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3 4; do
  for v in "${VARIANTS[@]}"; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    run $v "r$r hd128" 8q4k 2q16k
    run $v "r$r hd64" 8q4k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "r$r hd256" 8q4k --head-size 256
  done
done
t done
