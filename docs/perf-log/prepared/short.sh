#!/usr/bin/env bash
# Attempts 73-75 for a short call, on main with attempts-73-75.diff applied:
# T (the tree) built as scripts/gpu builds it, then P and M (variants.sh; the
# wgmma units rebuilt), alternated while the call has time; then, time
# allowing, T's CUDA tests (the exp2_poly probe tests among them) and one
# conformance pass (what keeping any of them needs).
# LIMIT: the seconds the call may run. Results in $OUT: ab.txt, tests.txt,
# conformance.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
L=${LIMIT:-360}
source "$(dirname "$0")/variants.sh"
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
left() { [ $(( $(date +%s) - S )) -lt "$1" ]; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee -a "$O/ab.txt"
D=/tmp/pagedattn-deps; rm -rf $D && mkdir -p $D
for f in .gpu-deps/*.deb; do dpkg -x "$f" $D; done
export LD_LIBRARY_PATH="$D/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDATTN_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_PREFIX_PATH=$D/usr "-DCMAKE_CXX_FLAGS=-isystem $D/usr/include -DHWY_COMPILE_ONLY_SCALAR" \
  > /tmp/configure.log 2>&1 || { t "configure failed"; tail -20 /tmp/configure.log | tee -a "$O/ab.txt"; }
mkdir -p /tmp/v
# BENCH_ONLY=1 (a call under about 300 s): the timing driver alone.
targets="pagedattn_cli pagedattn_tests pagedattn_gpu_bench"; [ "${BENCH_ONLY:-0}" = 1 ] && targets=pagedattn_gpu_bench
ninja -C $B $targets > /tmp/b_T.log 2>&1; rc=$?
t "T built $rc"; [ $rc = 0 ] || grep -E "error|FAILED" -A5 /tmp/b_T.log | head -40 | tee -a "$O/ab.txt"
cp $B/bin/pagedattn_gpu_bench /tmp/v/T; cp $B/bin/pagedattn_tests /tmp/v/Ttests; cp $B/bin/pagedattn /tmp/v/Tcli
cp $H /tmp/wgmma.cuh
for v in P M; do
  set_variant $v || { t "$v: an edit missed its line; not built"; continue; }
  ninja -C $B pagedattn_gpu_bench > /tmp/b_$v.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$v; t "$v built $?"
done
cp /tmp/wgmma.cuh $H
run() {  # variant, label, then bench arguments
  local v=$1 l=$2; shift 2
  timeout 40 /tmp/v/$v "$@" --label $l 2>&1 | grep -v "^device\|^spec" | sed "s/^/$l /" | tee -a "$O/ab.txt"
}
# A call of 400 s or more keeps its last 100 s for T's tests and conformance.
R=10; [ "$L" -ge 400 ] && R=100
for r in 1 2 3 4 5; do
  for v in T P M; do
    left $((L - R - 25)) || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    run $v "$v$r-hd128" 8q4k
    run $v "$v$r-hd64" 8q4k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "$v$r-hd256" 8q4k --head-size 256
  done
done
if left $((L - 60)); then
  timeout $((L - 45 - $(date +%s) + S)) /tmp/v/Ttests --gtest_filter='*Cuda*:*FlashPlanner*:*RejectedForward*:*PlainVariant*' \
    > /tmp/tests.log 2>&1; t "T tests rc $?"; tail -5 /tmp/tests.log > "$O/tests.txt"; grep "FAILED" /tmp/tests.log >> "$O/tests.txt"
fi
if left $((L - 40)); then
  timeout $((L - 10 - $(date +%s) + S)) /tmp/v/Tcli conformance --backend CUDA_FLASH --device cuda --threads 8 \
    > /tmp/conf.log 2>&1; t "T conformance rc $?"; tail -1 /tmp/conf.log | tee "$O/conformance.txt"
fi
t done
