#!/usr/bin/env bash
# Attempt 60 alone, for a short call (session 33's device starts were
# scarce): D (main with session32-q-descriptors.diff: the wgmma consumers'
# Q descriptors computed per tile) built as scripts/gpu builds it, then M
# (main, the wgmma units rebuilt), alternated while the call has time; then,
# time allowing, D's CUDA tests and one conformance pass (what keeping it
# needs). LIMIT: the seconds the call may run. Results in $OUT: qd.txt,
# tests.txt, conformance.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
L=${LIMIT:-360}
P=docs/perf-log/prepared/session32-q-descriptors.diff
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/qd.txt"; }
left() { [ $(( $(date +%s) - S )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$O/qd.txt"
D=/tmp/pagedattn-deps; rm -rf $D && mkdir -p $D
for f in .gpu-deps/*.deb; do dpkg -x "$f" $D; done
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
patch -s -p1 < $P || t "patch failed"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDATTN_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_PREFIX_PATH=$D/usr "-DCMAKE_CXX_FLAGS=-isystem $D/usr/include -DHWY_COMPILE_ONLY_SCALAR" \
  > /tmp/configure.log 2>&1 || { t "configure failed"; tail -20 /tmp/configure.log | tee -a "$O/qd.txt"; }
mkdir -p /tmp/v
ninja -C $B pagedattn_cli pagedattn_tests pagedattn_gpu_bench > /tmp/b_D.log 2>&1; rc=$?
t "D built $rc"; [ $rc = 0 ] || grep -E "error|FAILED" -A5 /tmp/b_D.log | head -40 | tee -a "$O/qd.txt"
cp $B/bin/pagedattn_gpu_bench /tmp/v/D; cp $B/bin/pagedattn_tests /tmp/v/Dtests; cp $B/bin/pagedattn /tmp/v/Dcli
patch -s -p1 -R < $P || t "reverse patch failed"
ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
run() {  # variant, label, then bench arguments
  local v=$1 l=$2; shift 2
  timeout 40 /tmp/v/$v "$@" --label $l 2>&1 | grep -v "^device\|^spec" | sed "s/^/$l /" | tee -a "$O/qd.txt"
}
# A call of 400 s or more keeps its last 100 s for D's tests.
R=10; [ "$L" -ge 400 ] && R=100
for r in 1 2 3 4; do
  for v in D M; do
    left $((L - R - 25)) || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    run $v $v$r 8q4k 2q16k --kv-cache-dtype auto,fp8
    run $v "$v$r-hd256" 8q4k --head-size 256
    run $v "$v$r-hd64" 8q4k --head-size 64
  done
done
if left $((L - 60)); then
  timeout $((L - 45 - $(date +%s) + S)) /tmp/v/Dtests --gtest_filter='*Cuda*:*FlashPlanner*:*RejectedForward*' \
    > /tmp/tests.log 2>&1; t "D tests rc $?"; tail -5 /tmp/tests.log > "$O/tests.txt"; grep "FAILED" /tmp/tests.log >> "$O/tests.txt"
fi
if left $((L - 40)); then
  timeout $((L - 10 - $(date +%s) + S)) /tmp/v/Dcli conformance --backend CUDA_FLASH --device cuda --threads 8 \
    > /tmp/conf.log 2>&1; t "D conformance rc $?"; tail -1 /tmp/conf.log | tee "$O/conformance.txt"
  grep -E "^  (FAILED|failed)" /tmp/conf.log | head -20 >> "$O/conformance.txt"
fi
t done
