#!/usr/bin/env bash
# Attempt 73 (docs/perf-log/cuda_flash-issue-31b.md, session 37) on main with
# session39-exp2-poly.diff applied: `scripts/gpu kernels 8q4k` (CUDA tests,
# the exp2_poly probe tests among them; conformance) on the tree, then
#   P4  the tree: class 64 exponentiates one n-tile in four on the FMA pipe;
#   P2  one in two at class 64;
#   Q4  one in four at classes 64 and 128;
#   M   none (kPolyExpEvery = 0: main's SASS, instruction for instruction);
# each a rebuild of the wgmma units with kPolyExpEvery's line edited,
# alternated while the call has time (LIMIT seconds). Head size 128 is P4's
# control (its code is main's). Results in $OUT: ab.txt, kernels_summary.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
LINE='kPolyExpEvery = kHC == 64 ? 4 : 0;'
LIMIT=${LIMIT:-540}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
OUT=/tmp/k-out timeout 200 scripts/gpu kernels 8q4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
grep -E "PASSED|FAILED|conformance:" /tmp/kernels.log | tee -a "$O/ab.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/P4
cp $H /tmp/wgmma.cuh
for v in "P2|kPolyExpEvery = kHC == 64 ? 2 : 0;" "Q4|kPolyExpEvery = kHC <= 128 ? 4 : 0;" "M|kPolyExpEvery = 0;"; do
  name=${v%%|*}; line=${v#*|}
  sed "s/$LINE/$line/" /tmp/wgmma.cuh > $H
  ninja -C $B pagedattn_gpu_bench > /tmp/b_$name.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$name; t "$name built $?"
done
cp /tmp/wgmma.cuh $H
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3; do
  for v in P4 P2 Q4 M; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    run $v "r$r hd64" 8q4k 2q16k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "r$r hd64f16" 8q4k --head-size 64 --dtype f16
    run $v "r$r hd128" 8q4k 2q16k
  done
done
t done
