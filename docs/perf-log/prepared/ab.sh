#!/usr/bin/env bash
# Attempts 73 and 74 (docs/perf-log/cuda_flash-issue-31b.md, sessions 37-39)
# on main with attempts-73-74.diff applied. The two touch disjoint head
# classes, so one build carries both: 73 the class-64 wgmma kernels (one
# n-tile in kPolyExpEvery exponentiated on the FMA pipe), 74 the class-256
# 16-bit ones (80-key tiles, registers 40 / 232). Variants, each the tree
# with three lines of WgmmaLayout edited (VARIANTS below):
#   T  the diff's lines: 73 one n-tile in four; 74 80-key tiles on 40 / 232;
#   V  73 one in two at class 64 and one in four at class 128 (its SFU time
#      is half its MMAs'); 74 80-key tiles on main's 72 / 216 (what the split adds);
#   M  none of either: kPolyExpEvery 0, 64-key tiles, 72 / 216 (main's SASS,
#      instruction for instruction, in all three wgmma units: host check).
# Head size 128 is T's control (its SASS is main's in T).
#   GPU_MODE=kernels (default): `scripts/gpu kernels 8q4k` on T (CUDA tests,
#     the exp2_poly probe tests among them; conformance), then V and M;
#   GPU_MODE=perf: `scripts/gpu perf` on M (docs/perf.md's table and charts,
#     main's kernels; perf.tar.gz), then T and V: one call for both.
# The others are rebuilt in place (the wgmma units), then all alternated
# while the call has time (LIMIT seconds). Results in $OUT: ab.txt,
# summary.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
LIMIT=${LIMIT:-540}
MODE=${GPU_MODE:-kernels}
POLY='kPolyExpEvery = kHC == 64 ? 4 : 0;'
TILE='kTileKeys = kHC <= 128 ? 128 : (kFp8 ? 64 : 80);'
REGS='kProducerRegs = kHC > 128 \&\& !kFp8 ? 40 : 72;'
declare -A EDIT=(
  [T]=""
  [V]="s/$POLY/kPolyExpEvery = kHC == 64 ? 2 : (kHC == 128 ? 4 : 0);/; s/$REGS/kProducerRegs = 72;/"
  [M]="s/$POLY/kPolyExpEvery = 0;/; s/$TILE/kTileKeys = kHC <= 128 ? 128 : 64;/; s/$REGS/kProducerRegs = 72;/")
if [ "$MODE" = perf ]; then VARIANTS=(M T V); ARGS=(); LIM=380; else VARIANTS=(T V M); ARGS=(8q4k); LIM=200; fi
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
cp $H /tmp/wgmma.cuh
for v in T V M; do  # every edit must hit its lines (T 0, V 2, M 3), or the variant is not what it says
  t "$v edits $(sed "${EDIT[$v]}" /tmp/wgmma.cuh | diff /tmp/wgmma.cuh - | grep -c '^>') lines"
done
mkdir -p /tmp/v
for v in "${VARIANTS[@]}"; do
  sed "${EDIT[$v]}" /tmp/wgmma.cuh > $H
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
    run $v "r$r hd256" 8q4k 2q16k --head-size 256
    run $v "r$r hd128" 8q4k
  done
done
t done
