#!/usr/bin/env bash
# Nsight Compute on the wgmma prefill kernel after attempt 70 (one launch
# each of `8q4k` at head sizes 128, 64 and 256, clocks as found): which
# stalls and pipes bound it now that a diagonal tile's code is in one piece,
# and whether shared memory bounds head size 256. Builds pagedattn_gpu_bench
# alone (no tests: nothing here is a result to keep, only where the time
# goes). Writes $OUT/bench.txt, ncu_prefill{,_hd64,_hd256}.txt and
# src_prefill{,_hd64,_hd256}.csv.gz (stalls per SASS line).
set -uo pipefail
S=$(date +%s); W=/tmp/pw; mkdir -p $W; d=/tmp/pagedattn-deps; rm -rf $d; mkdir -p $d
for f in .gpu-deps/*.deb; do dpkg -x "$f" $d; done
export LD_LIBRARY_PATH="$d/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DPAGEDATTN_CUDA_ARCHITECTURES=90-real \
  -DCMAKE_PREFIX_PATH=$d/usr "-DCMAKE_CXX_FLAGS=-isystem $d/usr/include -DHWY_COMPILE_ONLY_SCALAR" > $W/cfg.log 2>&1 ||
  tail $W/cfg.log
ninja -C /tmp/b -j"$(nproc)" pagedattn_gpu_bench > $W/b.log 2>&1 || tail -30 $W/b.log
echo "built $(( $(date +%s) - S )) s"
/tmp/b/bin/pagedattn_gpu_bench 8q4k | tee $OUT/bench.txt
/tmp/b/bin/pagedattn_gpu_bench 8q4k --head-size 64 | tee -a $OUT/bench.txt
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
prof() {  # name, then gpu_bench options
  local name=$1; shift
  timeout 120 "$ncu" --clock-control none --kernel-name-base demangled -k regex:"wgmma_prefill_kernel" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" -o "$W/$name" -f \
    /tmp/b/bin/pagedattn_gpu_bench --warmup 1 --repeats 1 8q4k "$@" > "$W/$name.log" 2>&1 || tail -20 "$W/$name.log"
  "$ncu" --import "$W/$name.ncu-rep" --page details --print-details all > "$OUT/ncu_$name.txt" 2>&1
  "$ncu" --import "$W/$name.ncu-rep" --page source --csv --print-source sass > "$W/$name.csv" 2>&1
  gzip -c "$W/$name.csv" > "$OUT/src_$name.csv.gz"
}
prof prefill
prof prefill_hd64 --head-size 64
prof prefill_hd256 --head-size 256
echo "done $(( $(date +%s) - S )) s"
