#!/usr/bin/env bash
# Attempt 71 (docs/perf-log/cuda_flash-issue-31b.md, session 36) on main with
# session37-raw-masked.diff applied: `scripts/gpu kernels 8q4k` (CUDA tests,
# conformance), then X (the tree) and M (main, the diff reversed) alternated
# on the prefill rows, the mixed step and the bf16 decode while the call has
# time (LIMIT seconds); then Nsight Compute on one launch of each build's
# wgmma kernel at `8q4k` (head sizes 128 and 64; main's at 256 too) while
# PROFILE_LIMIT allows.
# Results in $OUT: ab.txt, kernels_summary.txt, ncu_{X,M}{,_hd64}.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
P=docs/perf-log/prepared
LIMIT=${LIMIT:-420}
PROFILE_LIMIT=${PROFILE_LIMIT:-520}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
OUT=/tmp/k-out timeout 200 scripts/gpu kernels 8q4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
grep -E "PASSED|FAILED|conformance:" /tmp/kernels.log | tee -a "$O/ab.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/X
patch -R -p1 < $P/session37-raw-masked.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 &&
  cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
patch -p1 < $P/session37-raw-masked.diff > /dev/null
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3 4; do
  for v in X M; do
    left || { t "round $r $v skipped (no time left)"; continue; }
    run $v "r$r bf16" 8q4k 2q16k q2k_63q1s4k 64q1s4k
    run $v "r$r hd64" 8q4k --head-size 64
    run $v "r$r hd256" 8q4k --head-size 256
    run $v "r$r fp8" 8q4k --kv-cache-dtype fp8
    # f16 queries: the producer's fp8 -> f16 is one conversion a pair (bf16: four).
    run $v "r$r f16" 8q4k --dtype f16
    run $v "r$r f16 fp8" 8q4k --dtype f16 --kv-cache-dtype fp8
  done
done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
prof() {  # variant, name suffix, then gpu_bench options
  local v=$1 name=ncu_$1$2; shift 2
  [ $(( $(date +%s) - S )) -lt $PROFILE_LIMIT ] || { t "$name skipped (no time left)"; return; }
  timeout 60 "$ncu" --clock-control none --kernel-name-base demangled -k regex:"wgmma_prefill_kernel" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -o "/tmp/$name" -f \
    /tmp/v/$v --warmup 1 --repeats 1 8q4k "$@" > "/tmp/$name.log" 2>&1 || tail -5 "/tmp/$name.log"
  "$ncu" --import "/tmp/$name.ncu-rep" --page details --print-details all > "$O/$name.txt" 2>&1; t "$name"
}
prof X ""
prof M ""
prof X _hd64 --head-size 64
prof M _hd64 --head-size 64
prof M _hd256 --head-size 256
t done
