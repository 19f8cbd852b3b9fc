#!/usr/bin/env bash
# The first device call (README.md here), on main as it is (attempt
# 72 kept): `scripts/gpu perf` (docs/perf.md's table and charts; its CUDA
# tests and two conformance passes are the first GPU run of main with 72
# alone), then `scripts/gpu profile` on the same build while the call has
# time (Nsight Compute on the decodes and on the wgmma prefill at head sizes
# 128, 64 and 256). The device tool brings back 8 files at most, so each
# mode's output comes back as one archive beside its summary. Carry .gpu-deps.
set -uo pipefail
O=$OUT; S=$(date +%s)
LIMIT=${LIMIT:-560}
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/calls.txt"; }
OUT=/tmp/perf-out timeout 400 scripts/gpu perf > /tmp/perf.log 2>&1; t "perf rc $?"
cp /tmp/perf-out/summary.txt "$O/perf_summary.txt" 2>/dev/null
tar czf "$O/perf.tar.gz" -C /tmp/perf-out . /tmp/perf.log 2>/dev/null
left=$(( LIMIT - ($(date +%s) - S) ))
if [ "$left" -gt 120 ]; then
  OUT=/tmp/profile-out PAGEDATTN_GPU_KEEP_BUILD=1 timeout "$left" scripts/gpu profile > /tmp/profile.log 2>&1
  t "profile rc $? (limit $left s)"
  tar czf "$O/profile.tar.gz" -C /tmp/profile-out . /tmp/profile.log 2>/dev/null
else
  t "profile skipped ($left s left)"
fi
