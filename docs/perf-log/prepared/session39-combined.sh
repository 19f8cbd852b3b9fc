#!/usr/bin/env bash
# One call for both when starts are scarce (session 38 got none): the perf
# run and attempt 73's A/B on one machine. On main with
# session39-exp2-poly.diff applied:
#   M   kPolyExpEvery = 0 (main's SASS, instruction for instruction: host
#       check), built by `scripts/gpu perf` (CUDA tests with the exp2_poly
#       probe tests, conformance twice, every workload with the peers,
#       charts): docs/perf.md's table;
#   P4  the diff's line: class 64 exponentiates one n-tile in four on the FMA
#       pipe, rebuilt in place (the wgmma units) after the perf run;
# then P4 and M alternated while the call has time (LIMIT seconds), head
# size 64 bf16 and fp8, head size 128 as the control. Carry .gpu-deps.
# GPU_MODE=kernels swaps the first build for P4 under `scripts/gpu kernels`.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
LINE='kPolyExpEvery = kHC == 64 ? 4 : 0;'
LIMIT=${LIMIT:-575}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
# GPU_MODE=kernels (`scripts/gpu kernels 8q4k`: tests, one conformance pass,
# our rows with the SDPA peers) when the call has too little time for perf:
# then P4 is built first, so its kernels run the tests and conformance.
MODE=${GPU_MODE:-perf}
if [ "$MODE" = kernels ]; then SPEC=8q4k; FIRST=P4; SECOND=M; else SPEC=; FIRST=M; SECOND=P4; fi
line_of() { [ "$1" = M ] && echo 'kPolyExpEvery = 0;' || echo "$LINE"; }
cp $H /tmp/wgmma.cuh
sed "s/$LINE/$(line_of $FIRST)/" /tmp/wgmma.cuh > $H
OUT=/tmp/perf-out PAGEDATTN_GPU_KEEP_BUILD=1 timeout 380 scripts/gpu $MODE $SPEC > /tmp/perf.log 2>&1; t "$MODE rc $? ($FIRST)"
cp /tmp/perf-out/summary.txt "$O/perf_summary.txt" 2>/dev/null
grep -E "PASSED|FAILED|conformance:" /tmp/perf.log | tee -a "$O/ab.txt"
tar czf "$O/perf.tar.gz" -C /tmp/perf-out . /tmp/perf.log 2>/dev/null
mkdir -p /tmp/v && cp $B/bin/pagedattn_gpu_bench /tmp/v/$FIRST
sed "s/$LINE/$(line_of $SECOND)/" /tmp/wgmma.cuh > $H
ninja -C $B pagedattn_gpu_bench > /tmp/b_$SECOND.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$SECOND; t "$SECOND built $?"
cp /tmp/wgmma.cuh $H
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
run() {  # variant, label, bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 40 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}
for r in 1 2 3 4; do
  for v in P4 M; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    run $v "r$r hd64" 8q4k 2q16k --head-size 64 --kv-cache-dtype auto,fp8
    run $v "r$r hd128" 8q4k
  done
done
t done
