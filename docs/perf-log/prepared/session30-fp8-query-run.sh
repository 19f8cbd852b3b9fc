#!/usr/bin/env bash
# Session 30, prepared (docs/perf-log/prepared/README.md), run from the
# repository root with session30-fp8-query.diff applied: scripts/gpu kernels
# (the CUDA tests, QuantizedQueriesMatchReferenceOnTheirE4m3Values among them;
# conformance, where every e4m3 case now quantizes its queries with q_scale
# 0.02), then the fp8 figures with quantized queries (Q) against the same
# build whose impl does not take them (N: supports_quant_query_input false,
# host-only rebuild), alternated two rounds.
set -uo pipefail
O=${OUT:-$PWD/s30-out}; mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/summary.txt"; }
BUILD=/tmp/pagedattn-gpu-build
t "kernels mode"
OUT=/tmp/k-out timeout 300 scripts/gpu kernels 64q1s4k 8q4k > "$O/kernels.log" 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt" 2>/dev/null
mkdir -p /tmp/v
cp $BUILD/bin/pagedattn_gpu_bench /tmp/v/Q
I=src/backends/cuda_flash/flash_impl.cpp
cp $I /tmp/impl.cpp
sed -i 's/bool supports_quant_query_input() const override { return true; }/bool supports_quant_query_input() const override { return false; }/' $I
grep -c "return false; }" $I | tee -a "$O/summary.txt"
ninja -C $BUILD pagedattn_gpu_bench > /tmp/build_n.log 2>&1 && cp $BUILD/bin/pagedattn_gpu_bench /tmp/v/N; t "N built $?"
cp /tmp/impl.cpp $I
for r in 1 2; do
  for v in Q N; do
    [ -x /tmp/v/$v ] || continue
    t "round $r $v"
    timeout 90 /tmp/v/$v 64q1s4k 8q1s32k 1q1s8k 8q4k q2k_63q1s4k --kv-cache-dtype auto,fp8 --label "$v$r" 2>&1 |
      grep -v "^device\|^spec" | tee -a "$O/bench.txt"
  done
done
t done
