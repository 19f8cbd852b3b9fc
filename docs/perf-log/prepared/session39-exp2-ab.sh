#!/usr/bin/env bash
# Attempt 73 (docs/perf-log/cuda_flash-issue-31b.md, sessions 37-38) on main
# with session39-exp2-poly.diff applied. Variants, each the tree with
# WgmmaLayout::kPolyExpEvery's line edited:
#   P4  the diff's line: class 64 exponentiates one n-tile in four on the FMA pipe;
#   P2  one in two at class 64;
#   Q4  one in four at classes 64 and 128;
#   M   none (kPolyExpEvery = 0: main's SASS, instruction for instruction).
# The first variant is built and checked by scripts/gpu:
#   GPU_MODE=kernels (default): `scripts/gpu kernels 8q4k` on P4 (CUDA tests,
#     the exp2_poly probe tests among them; conformance), then P2, Q4 and M;
#   GPU_MODE=perf: `scripts/gpu perf` on M (docs/perf.md's table and charts,
#     main's kernels; perf.tar.gz), then P4 alone: one call for both.
# The others are rebuilt in place (the wgmma units), then all alternated
# while the call has time (LIMIT seconds); head size 128 is P4's control (its
# code is main's). Results in $OUT: ab.txt, summary.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
LIMIT=${LIMIT:-540}
MODE=${GPU_MODE:-kernels}
declare -A LINES=([P4]='kPolyExpEvery = kHC == 64 ? 4 : 0;' [P2]='kPolyExpEvery = kHC == 64 ? 2 : 0;'
                  [Q4]='kPolyExpEvery = kHC <= 128 ? 4 : 0;' [M]='kPolyExpEvery = 0;')
if [ "$MODE" = perf ]; then VARIANTS=(M P4); ARGS=(); LIM=380; else VARIANTS=(P4 P2 Q4 M); ARGS=(8q4k); LIM=200; fi
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
set_variant() { sed "s/${LINES[P4]}/${LINES[$1]}/" /tmp/wgmma.cuh > $H; }
cp $H /tmp/wgmma.cuh
mkdir -p /tmp/v
for v in "${VARIANTS[@]}"; do
  set_variant $v
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
    run $v "r$r hd64" 8q4k 2q16k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "r$r hd64f16" 8q4k --head-size 64 --dtype f16
    run $v "r$r hd128" 8q4k
  done
done
t done
