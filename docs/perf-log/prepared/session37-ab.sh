#!/usr/bin/env bash
# Attempts 71 and 72 (docs/perf-log/cuda_flash-issue-31b.md, session 36) on
# main with session37-raw-masked.diff (71) and session37-fp8-v-f16.diff (72)
# applied: `scripts/gpu kernels 8q4k` (CUDA tests, conformance) on both, then
#   X  the tree (71 + 72);
#   A  71 alone (72 reversed): X against A is 72, on the fp8 rows;
#   M  main (both reversed): A against M is 71, on the 16-bit rows;
# alternated while the call has time (LIMIT seconds). f16 queries with fp8
# K/V (one conversion a pair in the producer for K and V alike) bound what
# 72 can give bf16 queries. Results in $OUT: ab.txt, kernels_summary.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
P=docs/perf-log/prepared
LIMIT=${LIMIT:-540}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
OUT=/tmp/k-out timeout 200 scripts/gpu kernels 8q4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
grep -E "PASSED|FAILED|conformance:" /tmp/kernels.log | tee -a "$O/ab.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/X
patch -R -p1 < $P/session37-fp8-v-f16.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_A.log 2>&1 &&
  cp $B/bin/pagedattn_gpu_bench /tmp/v/A; t "A built $?"
patch -R -p1 < $P/session37-raw-masked.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 &&
  cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
patch -p1 < $P/session37-raw-masked.diff > /dev/null
patch -p1 < $P/session37-fp8-v-f16.diff > /dev/null
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3; do
  for v in X A M; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    run $v "r$r bf16" 8q4k 2q16k q2k_63q1s4k 64q1s4k
    run $v "r$r hd128" 8q4k 2q16k --kv-cache-dtype fp8
    run $v "r$r hd64" 8q4k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "r$r f16" 8q4k --dtype f16 --kv-cache-dtype auto,fp8
    run $v "r$r hd256" 8q4k --head-size 256
  done
done
t done
