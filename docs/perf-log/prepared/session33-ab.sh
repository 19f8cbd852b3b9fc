#!/usr/bin/env bash
# One call for attempts 59 and 60 (device starts were scarce in session 33),
# the measurements first: the tree with session32-fp8-mma.diff applied (main
# + 59 + 60: the fp8 MMA prefill, its quantized queries, and the per-tile Q
# descriptors in both MMA paths) built as scripts/gpu builds it, then three
# builds alternated, three rounds while the call has time: Q (that tree), N
# (the same with supports_quant_query_input false: fp8 prefill on the 16-bit
# MMAs over converted tiles, so N against M is attempt 60 alone) and M
# (main). Then, time allowing, Q's CUDA tests and one conformance pass (what
# keeping 59 or 60 needs), and Nsight Compute on M's bf16 and fp8 64q1s4k
# decode. LIMIT: the seconds the call may run. Results in $OUT: ab.txt,
# tests.txt, conformance.txt, ncu_*.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
L=${LIMIT:-560}
I=src/backends/cuda_flash/flash_impl.cpp
P=docs/perf-log/prepared/session32-fp8-mma.diff
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
left() { [ $(( $(date +%s) - S )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$O/ab.txt"
# scripts/gpu's configuration: Highway and xxHash from the carried packages.
D=/tmp/pagedattn-deps; rm -rf $D && mkdir -p $D
for f in .gpu-deps/*.deb; do dpkg -x "$f" $D; done
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
patch -s -p1 < $P || t "patch failed"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDATTN_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_PREFIX_PATH=$D/usr "-DCMAKE_CXX_FLAGS=-isystem $D/usr/include -DHWY_COMPILE_ONLY_SCALAR" \
  > /tmp/configure.log 2>&1 || { t "configure failed"; tail -20 /tmp/configure.log | tee -a "$O/ab.txt"; }
mkdir -p /tmp/v
ninja -C $B pagedattn_cli pagedattn_tests pagedattn_gpu_bench > /tmp/b_Q.log 2>&1; rc=$?
t "Q built $rc"; [ $rc = 0 ] || grep -E "error|FAILED" -A5 /tmp/b_Q.log | head -40 | tee -a "$O/ab.txt"
cp $B/bin/pagedattn_gpu_bench /tmp/v/Q; cp $B/bin/pagedattn_tests /tmp/v/Qtests; cp $B/bin/pagedattn /tmp/v/Qcli
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
# Rounds stop where the tests' share of the call begins (none below 450 s).
R=10; [ "$L" -ge 450 ] && R=150
for r in 1 2 3; do
  for v in Q N M; do
    left $((L - R)) || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    if [ $v = Q ]; then
      run Q Q$r 8q4k 2q16k 64q1s4k --kv-cache-dtype fp8
    else
      run $v $v$r 8q4k 2q16k 64q1s4k --kv-cache-dtype auto,fp8
      for d in 64 256; do run $v "$v$r-hd$d" 8q4k --head-size $d; done
    fi
  done
done
if left $((L - 60)); then
  timeout $((L - 60 - $(date +%s) + S)) /tmp/v/Qtests --gtest_filter='*Cuda*:*FlashPlanner*:*RejectedForward*' \
    > /tmp/tests.log 2>&1; t "Q tests rc $?"; tail -5 /tmp/tests.log > "$O/tests.txt"; grep "FAILED" /tmp/tests.log >> "$O/tests.txt"
fi
if left $((L - 40)); then
  timeout $((L - 10 - $(date +%s) + S)) /tmp/v/Qcli conformance --backend CUDA_FLASH --device cuda --threads 8 \
    > /tmp/conf.log 2>&1; t "Q conformance rc $?"; tail -1 /tmp/conf.log | tee "$O/conformance.txt"
  grep -E "^  (FAILED|failed)" /tmp/conf.log | head -20 >> "$O/conformance.txt"
fi
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for kv in auto fp8; do
  left $((L - 25)) || { t "ncu $kv skipped (no time left)"; continue; }
  timeout 20 "$ncu" --clock-control none -k regex:attention_kernel --launch-count 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section SchedulerStats \
    /tmp/v/M 64q1s4k --kv-cache-dtype $kv --warmup 1 --repeats 3 > "$O/ncu_$kv.txt" 2>&1; t "ncu $kv rc $?"
done
t done
