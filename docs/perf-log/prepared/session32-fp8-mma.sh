#!/usr/bin/env bash
# Attempt 52 again on attempt 57's registers (docs/perf-log/prepared/README.md):
# run with session32-fp8-mma.diff applied. `scripts/gpu kernels` (CUDA tests;
# conformance with the 8 fp8_mma_prefill_sweep cases), then Q (the tree: a
# layer over a per-tensor e4m3 cache quantizes its queries, so class-128
# prefill runs the fp8 MMAs) against N (supports_quant_query_input false: the
# 16-bit MMAs over converted tiles; a host-only rebuild), three rounds.
# Results in $OUT: kernels_summary.txt, fp8mma.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
I=src/backends/cuda_flash/flash_impl.cpp
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/fp8mma.txt"; }
OUT=/tmp/k-out timeout 300 scripts/gpu kernels 8q4k 64q1s4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/Q
cp $I /tmp/impl.cpp
sed -i 's/supports_quant_query_input() const override { return true; }/supports_quant_query_input() const override { return false; }/' $I
cmp -s $I /tmp/impl.cpp && t "the edit for N matched nothing"
ninja -C $B pagedattn_gpu_bench > /tmp/b_N.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/N; t "N built $?"
cp /tmp/impl.cpp $I
for r in 1 2 3; do
  for v in Q N; do
    [ $(( $(date +%s) - S )) -lt 560 ] || { t "round $r $v skipped (no time left)"; continue; }
    timeout 60 /tmp/v/$v 8q4k 2q16k 64q1s4k --kv-cache-dtype auto,fp8 --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r /" | tee -a "$O/fp8mma.txt"
  done
done
# Where the lone fp8 decode's time goes, beside the bf16 one (N: its queries
# stay 16-bit), while the call has time.
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for kv in auto fp8; do
  [ $(( $(date +%s) - S )) -lt 500 ] || { t "ncu $kv skipped (no time left)"; continue; }
  timeout 50 "$ncu" --clock-control none -k regex:attention_kernel --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    /tmp/v/N 64q1s4k --kv-cache-dtype $kv --warmup 1 --repeats 3 > "$O/ncu_$kv.txt" 2>&1; t "ncu $kv rc $?"
done
t done
