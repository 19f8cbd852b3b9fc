#!/usr/bin/env bash
# Attempts 64-66 (docs/perf-log/cuda_flash-issue-31b.md, session 34), on the
# tree with session35-fp8-producer.diff applied: `scripts/gpu kernels` (CUDA
# tests, conformance), then V (the tree: the wgmma fp8 producer copies
# 16-byte raw rows through L1), R4 (V with the mma.sync kernels' fp8 ring four
# deep: fp8 decode rows only), C (V with session35-bf16-producer.diff: the
# wgmma 16-bit producer's copies through L1 too: bf16 prefill rows only) and
# M (the first diff reversed) alternated, three rounds while the call has
# time. Results in $OUT: kernels_summary.txt, ab.txt.
set -uo pipefail
O=$OUT; S=$(date +%s); B=/tmp/pagedattn-gpu-build
D=docs/perf-log/prepared/session35-fp8-producer.diff
A=src/backends/cuda_flash/kernels/flash_attention.cuh
LIMIT=${LIMIT:-540}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
OUT=/tmp/k-out timeout 200 scripts/gpu kernels 8q4k 64q1s4k > /tmp/kernels.log 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt"; grep -E "PASSED|FAILED|conformance:" /tmp/kernels.log | tee -a "$O/ab.txt"
mkdir -p /tmp/v
cp $B/bin/pagedattn_gpu_bench /tmp/v/V
cp $A /tmp/attn.cuh
sed -i 's/static constexpr int kRawStages = 3;/static constexpr int kRawStages = 4;/' $A
cmp -s $A /tmp/attn.cuh && t "the edit for R4 matched nothing"
ninja -C $B pagedattn_gpu_bench > /tmp/b_R4.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/R4; t "R4 built $?"
cp /tmp/attn.cuh $A
patch -p1 < docs/perf-log/prepared/session35-bf16-producer.diff > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_C.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/C; t "C built $?"
patch -R -p1 < docs/perf-log/prepared/session35-bf16-producer.diff > /dev/null
patch -R -p1 < $D > /dev/null && ninja -C $B pagedattn_gpu_bench > /tmp/b_M.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/M; t "M built $?"
patch -p1 < $D > /dev/null
left() { [ $(( $(date +%s) - S )) -lt $LIMIT ]; }
for r in 1 2 3; do
  for v in V R4 C M; do
    [ -x /tmp/v/$v ] || continue
    left || { t "round $r $v skipped (no time left)"; continue; }
    if [ $v = C ]; then
      timeout 60 /tmp/v/$v 8q4k 2q16k --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r pre /" | tee -a "$O/ab.txt"
      for d in 64 256; do
        left && timeout 20 /tmp/v/$v 8q4k --head-size $d --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r hd$d bf16 /" | tee -a "$O/ab.txt"
      done
      continue
    fi
    timeout 30 /tmp/v/$v 64q1s4k 8q1s32k 1q1s8k --kv-cache-dtype fp8 --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r dec /" | tee -a "$O/ab.txt"
    [ $v = R4 ] && continue
    left || continue
    timeout 60 /tmp/v/$v 8q4k 2q16k --kv-cache-dtype auto,fp8 --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r pre /" | tee -a "$O/ab.txt"
    for d in 64 256; do
      for kv in auto fp8; do
        left && timeout 20 /tmp/v/$v 8q4k --head-size $d --kv-cache-dtype $kv --label $v$r 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v$r hd$d $kv /" | tee -a "$O/ab.txt"
      done
    done
  done
done
t done
