#!/usr/bin/env bash
# The next session's first device call (docs/perf-log/prepared/README.md), on
# main as it is: `scripts/gpu perf` (docs/perf.md's table with attempts 57
# and 60), then three builds of the wgmma kernel alternated, three rounds
# while the call has time: R72 (main, registers 72 / 216), R56 (56 / 224,
# before attempt 57) and R88 (88 / 208, attempt 58), the wgmma units rebuilt
# for each; causal 8q4k
# and 2q16k with bf16 and fp8 K/V at head size 128, 8q4k at 64 and 256. Carry .gpu-deps
# (FlashInfer's wheels and modules, Highway, xxHash). Results in $OUT:
# the perf mode's report.md, report.json, summary.txt and charts.png, and
# regs.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/regs.txt"; }
OUT=/tmp/perf-out timeout 330 scripts/gpu perf > /tmp/perf.log 2>&1; t "perf rc $?"
cp /tmp/perf-out/{report.md,report.json,summary.txt,charts.png} "$O/" 2>/dev/null
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/R72
cp $H /tmp/wgmma.cuh
for v in "R56 56 224" "R88 88 208"; do
  set -- $v
  sed "s/kProducerRegs = 72;/kProducerRegs = $2;/; s/kConsumerRegs = 216;/kConsumerRegs = $3;/" /tmp/wgmma.cuh > $H
  ninja -C $B pagedattn_gpu_bench > /tmp/b_$1.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$1; t "$1 built $?"
done
cp /tmp/wgmma.cuh $H
for r in 1 2 3; do
  for v in R72 R56 R88; do
    [ $(( $(date +%s) - S )) -lt 560 ] || { t "round $r $v skipped (no time left)"; continue; }
    [ -x /tmp/v/$v ] || continue
    timeout 40 /tmp/v/$v 8q4k 2q16k --kv-cache-dtype auto,fp8 --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r /" | tee -a "$O/regs.txt"
    for d in 64 256; do
      timeout 20 /tmp/v/$v 8q4k --head-size $d --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r hd$d /" | tee -a "$O/regs.txt"
    done
  done
done
t done
