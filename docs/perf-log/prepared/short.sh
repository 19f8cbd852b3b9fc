#!/usr/bin/env bash
# Attempts 73 and 74 for a short call, on main with attempts-73-74.diff
# applied: T (the tree) built as scripts/gpu builds it, then M (ab.sh's M
# lines: main's SASS, host check; the wgmma units rebuilt), alternated while
# the call has time; then, time allowing, T's CUDA tests (the exp2_poly probe
# tests among them) and one conformance pass (what keeping either needs).
# LIMIT: the seconds the call may run. Results in $OUT: ab.txt, tests.txt,
# conformance.txt. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
L=${LIMIT:-360}
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
POLY='kPolyExpEvery = kHC == 64 ? 4 : 0;'
TILE='kTileKeys = kHC <= 128 ? 128 : (kFp8 ? 64 : 80);'
REGS='kProducerRegs = kHC > 128 \&\& !kFp8 ? 40 : 72;'
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
sed "s/$POLY/kPolyExpEvery = 0;/; s/$TILE/kTileKeys = kHC <= 128 ? 128 : 64;/; s/$REGS/kProducerRegs = 72;/" \
  /tmp/wgmma.cuh > $H
t "M edits $(diff /tmp/wgmma.cuh $H | grep -c '^>') lines (3 expected)"
ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
cp /tmp/wgmma.cuh $H
run() {  # variant, label, then bench arguments
  local v=$1 l=$2; shift 2
  timeout 40 /tmp/v/$v "$@" --label $l 2>&1 | grep -v "^device\|^spec" | sed "s/^/$l /" | tee -a "$O/ab.txt"
}
# A call of 400 s or more keeps its last 100 s for T's tests and conformance.
R=10; [ "$L" -ge 400 ] && R=100
for r in 1 2 3 4 5; do
  for v in T M; do
    left $((L - R - 25)) || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    run $v "$v$r-hd64" 8q4k 2q16k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "$v$r-hd256" 8q4k 2q16k --head-size 256
    run $v "$v$r-hd128" 8q4k
  done
done
if left $((L - 60)); then
  timeout $((L - 45 - $(date +%s) + S)) /tmp/v/Ttests --gtest_filter='*Cuda*:*FlashPlanner*:*RejectedForward*' \
    > /tmp/tests.log 2>&1; t "T tests rc $?"; tail -5 /tmp/tests.log > "$O/tests.txt"; grep "FAILED" /tmp/tests.log >> "$O/tests.txt"
fi
if left $((L - 40)); then
  timeout $((L - 10 - $(date +%s) + S)) /tmp/v/Tcli conformance --backend CUDA_FLASH --device cuda --threads 8 \
    > /tmp/conf.log 2>&1; t "T conformance rc $?"; tail -1 /tmp/conf.log | tee "$O/conformance.txt"
fi
t done
