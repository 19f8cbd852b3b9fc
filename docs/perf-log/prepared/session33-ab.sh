#!/usr/bin/env bash
# One call for attempts 59 and 60 (device starts were scarce in session 33):
# the tree with session32-fp8-mma.diff applied (main + 59 + 60: the fp8 MMA
# prefill, its quantized queries, and the per-tile Q descriptors in both MMA
# paths) through `scripts/gpu kernels` (CUDA tests, one conformance pass, the
# SDPA peers), then three builds alternated, three rounds while the call has
# time: Q (that tree), N (the same with supports_quant_query_input false:
# fp8 prefill on the 16-bit MMAs over converted tiles, so N against M is
# attempt 60 alone) and M (main). Then Nsight Compute on M's bf16 and fp8
# 64q1s4k decode if time is left. Results in $OUT: kernels_summary.txt,
# ab.txt, ncu_*.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
L=${LIMIT:-560}  # seconds the call may run (less when the device time left is short)
I=src/backends/cuda_flash/flash_impl.cpp
P=docs/perf-log/prepared/session32-fp8-mma.diff
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
left() { [ $(( $(date +%s) - S )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$O/ab.txt"
patch -s -p1 < $P || t "patch failed"
# The rounds and rebuilds need about 290 s: the kernels mode gets the rest
# (its build alone about 150 s; cut short, its binary is still built).
KT=$(( L - 290 )); [ $KT -gt 270 ] && KT=270; [ $KT -lt 150 ] && KT=150
OUT=/tmp/k-out timeout $KT scripts/gpu kernels 8q4k 64q1s4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/Q
cp $I /tmp/impl.cpp
sed -i 's/supports_quant_query_input() const override { return true; }/supports_quant_query_input() const override { return false; }/' $I
cmp -s $I /tmp/impl.cpp && t "the edit for N matched nothing"
ninja -C $B pagedattn_gpu_bench > /tmp/b_N.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/N; t "N built $?"
cp /tmp/impl.cpp $I
patch -s -p1 -R < $P || t "reverse patch failed"
ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
run() {  # variant, label, then bench arguments
  local v=$1 l=$2; shift 2
  timeout 40 /tmp/v/$v "$@" --label $l 2>&1 | grep -v "^device\|^spec" | sed "s/^/$l /" | tee -a "$O/ab.txt"
}
for r in 1 2 3; do
  for v in Q N M; do
    left $((L - 15)) || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    if [ $v = Q ]; then
      run Q Q$r 8q4k 2q16k 64q1s4k --kv-cache-dtype fp8
    else
      run $v $v$r 8q4k 2q16k 64q1s4k --kv-cache-dtype auto,fp8
      for d in 64 256; do run $v "$v$r-hd$d" 8q4k --head-size $d; done
    fi
  done
done
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for kv in auto fp8; do
  left $((L - 10)) || { t "ncu $kv skipped (no time left)"; continue; }
  timeout 25 "$ncu" --clock-control none -k regex:attention_kernel --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    /tmp/v/M 64q1s4k --kv-cache-dtype $kv --warmup 1 --repeats 3 > "$O/ncu_$kv.txt" 2>&1; t "ncu $kv rc $?"
done
t done
