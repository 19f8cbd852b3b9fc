#!/usr/bin/env bash
# Attempts 67-69 (docs/perf-log/cuda_flash-issue-31b.md, session 35), on the
# tree with session36-fp8-bits.diff applied: `scripts/gpu kernels 8q4k`
# (CUDA tests, the conversion probe's eight cases among them; conformance),
# then alternated while the call has time:
#   V  the tree (67: the wgmma fp8 producer converts finite chunks to bf16 by
#      bit operations and a bf16 multiply, off the conversion unit);
#   U4 V with that conversion loop unrolled by four (68);
#   D  V with session36-fp8-decode-bits.diff (69: the mma.sync kernels'
#      fp8 -> f16 by the same bit operations);
#   M  main (the first diff reversed).
# V, U4, M on the prefill rows; V, D, M on the decode rows, each round with
# the bf16 64q1s4k the fp8 ratio divides by. Results in $OUT: ab.txt,
# kernels_summary.txt, tests.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
P=docs/perf-log/prepared
W=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
LIMIT=${LIMIT:-530}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
OUT=/tmp/k-out timeout 200 scripts/gpu kernels 8q4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
grep -E "PASSED|FAILED|conformance:" /tmp/kernels.log | tee -a "$O/ab.txt"
grep -rh "Fp8Bits" /tmp/k-out /tmp/kernels.log 2>/dev/null | sort -u > "$O/tests.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/V
cp $W /tmp/w.cuh
sed -i 's/^#pragma unroll 2$/#pragma unroll 4/' $W
cmp -s $W /tmp/w.cuh && t "the edit for U4 matched nothing"
ninja -C $B pagedattn_gpu_bench > /tmp/b_U4.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/U4; t "U4 built $?"
cp /tmp/w.cuh $W
patch -p1 < $P/session36-fp8-decode-bits.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_D.log 2>&1 &&
  cp $B/bin/pagedattn_gpu_bench /tmp/v/D; t "D built $?"
patch -R -p1 < $P/session36-fp8-decode-bits.diff > /dev/null
patch -R -p1 < $P/session36-fp8-bits.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 &&
  cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
patch -p1 < $P/session36-fp8-bits.diff > /dev/null
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3; do
  for v in V D U4 M; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    if [ $v != U4 ]; then
      run $v "r$r dec fp8" 64q1s4k 8q1s32k 1q1s8k --kv-cache-dtype fp8
      run $v "r$r dec bf16" 64q1s4k
    fi
    [ $v = D ] && continue
    run $v "r$r pre fp8" 8q4k 2q16k --kv-cache-dtype fp8
    run $v "r$r hd64 fp8" 8q4k --head-size 64 --kv-cache-dtype fp8
    run $v "r$r hd256 fp8" 8q4k --head-size 256 --kv-cache-dtype fp8
    run $v "r$r bf16" 8q4k
  done
done
t done
