#!/usr/bin/env bash
# Session 30's prepared runs (docs/perf-log/prepared/README.md), from the
# repository root with the mode's patch applied:
#   mixed      session30-mixed-span-fp8-hint.diff: the mixed step's decode span
#              and decode pieces (host-only variants of three planner
#              constants: V1 = 436e185's plan), the fp8 decode's ratio with the
#              L2 hint on its 8-byte copies, and initcheck on the first-item
#              loads past the plan (graph replays record a wave of slots)
#   fp8-query  session30-fp8-query.diff: the fp8 figures with quantized queries
#              (Q) against the same build whose impl does not take them (N:
#              supports_quant_query_input false, host-only rebuild)
#   early      session30-early-launch.diff: the mma.sync kernels launched as
#              programmatic dependents (E) against the same build launching
#              them plainly (P: early_launch false, host-only rebuild)
#   boundary   session31-wgmma-boundary.diff: the wgmma kernels with the
#              scheduling boundary before the P V wait (W) against the same
#              build without it (X: the call removed, the wgmma units rebuilt)
#   all        every patch applied (fp8-mma after fp8-query): one kernels run
#              for all of them, then boundary's (its fp8 rows run the fp8
#              MMAs), early's, a shorter mixed and fp8-query's comparison on
#              the same build, each skipped once the call nears the device
#              tool's 600 s (what ran is in summary.txt)
# Every mode first runs scripts/gpu kernels on the patched tree (CUDA tests,
# conformance: with fp8-query every e4m3 case quantizes its queries).
set -uo pipefail
MODE=${1:?mixed, fp8-query, early, boundary or all}
O=${OUT:-$PWD/s30-out}; mkdir -p "$O"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/summary.txt"; }
BUILD=/tmp/pagedattn-gpu-build
t "kernels mode"
OUT=/tmp/k-out timeout 300 scripts/gpu kernels 1q1s8k 64q1s4k 8q4k > "$O/kernels.log" 2>&1; t "kernels rc $?"
cp /tmp/k-out/summary.txt "$O/kernels_summary.txt" 2>/dev/null
# A against B: A the kernels-mode build, B the same with the sed expression
# applied to flash_impl.cpp (a host-only rebuild; AB_FILE names another file,
# e.g. a kernel header), alternated `rounds` times over the specs, bf16 and
# fp8 K/V.
host_ab() {  # a b sed_expression rounds specs...
  local a=$1 b=$2 expression=$3 rounds=$4 r v
  shift 4
  mkdir -p /tmp/v
  cp $BUILD/bin/pagedattn_gpu_bench /tmp/v/$a
  local impl=${AB_FILE:-src/backends/cuda_flash/flash_impl.cpp}
  cp $impl /tmp/impl.cpp
  sed -i "$expression" $impl
  cmp -s $impl /tmp/impl.cpp && t "the edit for $b matched nothing"
  touch $impl
  ninja -C $BUILD pagedattn_gpu_bench > /tmp/build_$b.log 2>&1 && cp $BUILD/bin/pagedattn_gpu_bench /tmp/v/$b
  t "$b built $?"
  cp /tmp/impl.cpp $impl
  touch $impl
  # Mode all builds its next variants from this build: back to A first.
  if [ "$MODE" = all ]; then ninja -C $BUILD pagedattn_gpu_bench > /tmp/build_back_$a.log 2>&1; t "back to $a $?"; fi
  for r in $(seq "$rounds"); do
    for v in $a $b; do
      [ -x /tmp/v/$v ] || continue
      t "round $r $v"
      timeout 90 /tmp/v/$v "$@" --kv-cache-dtype auto,fp8 --label "$v$r" 2>&1 |
        grep -v "^device\|^spec" | tee -a "$O/bench.txt"
    done
  done
}

# Whether `need` more seconds fit before the call's 600 s.
fits() { [ $(( $(date +%s) - S + $1 )) -lt 570 ] || { t "skipped: $2 (no time left)"; false; }; }

BOUNDARY=(src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh '/scheduling_boundary(p.num_sms <= 0);/d')
EARLY_OFF='s/  k.early_launch = plan->sm_version >= kEarlyLaunchSmVersion;/  k.early_launch = false;/'
QUERY_OFF='s/supports_quant_query_input() const override { return true; }/supports_quant_query_input() const override { return false; }/'

# Mixed-step plan variants: the planner's three constants set (a host-only
# rebuild) from its patched header, saved once.
H=src/backends/cuda_flash/flash_planner.h
setv() {  # name num den keys
  mkdir -p /tmp/v
  [ -f /tmp/planner.h ] || cp $H /tmp/planner.h
  cp /tmp/planner.h $H
  sed -i "s/kMixedDecodeSpanNum = [0-9]*;/kMixedDecodeSpanNum = $2;/; s/kMixedDecodeSpanDen = [0-9]*;/kMixedDecodeSpanDen = $3;/; s/kMixedDecodeKeys = [0-9]*;/kMixedDecodeKeys = $4;/" $H
  ninja -C $BUILD pagedattn_gpu_bench > /tmp/build_$1.log 2>&1 && cp $BUILD/bin/pagedattn_gpu_bench /tmp/v/$1; t "$1 built $? ($2/$3, $4)"
}
mix_rounds() {  # "variants" json_dir specs...
  local variants=$1 json=$2 r v
  shift 2
  for r in 1 2; do
    for v in $variants; do
      [ -x /tmp/v/$v ] || continue
      t "round $r $v"
      timeout 60 /tmp/v/$v "$@" --label "$v$r" ${json:+--json "$json/b_${v}_$r.json"} 2>&1 |
        grep -v "^device\|^spec" | tee -a "$O/bench.txt"
    done
  done
}

if [ "$MODE" = all ]; then
  fits 200 boundary && AB_FILE=${BOUNDARY[0]} host_ab W X "${BOUNDARY[1]}" 2 8q4k 2q16k
  fits 120 early && host_ab E P "$EARLY_OFF" 2 1q1s8k 64q1s4k q2k_63q1s4k
  if fits 120 mixed; then
    setv V1 1 1 1073741824
    setv V6 3 4 2048  # the patch's values: the build is A again
    cp /tmp/planner.h $H
    mix_rounds "V1 V6" "" q2k_63q1s4k q1k_16q1s4k q512_32q1s2k
  fi
  fits 150 fp8-query && host_ab Q N "$QUERY_OFF" 2 8q4k 64q1s4k 1q1s8k
elif [ "$MODE" = mixed ]; then
  mkdir -p /tmp/j
  setv V1 1 1 1073741824
  setv V2 3 4 1073741824
  setv V4 1 1 2048
  setv V6 3 4 2048
  cp /tmp/planner.h $H
  mix_rounds "V1 V2 V4 V6" /tmp/j q2k_63q1s4k q1k_16q1s4k q512_32q1s2k q4k_32q1s8k
  for r in 1 2; do
    t "fp8 round $r"
    timeout 60 /tmp/v/V6 64q1s4k 8q1s32k --kv-cache-dtype auto,fp8 --label "F$r" 2>&1 | grep -v "^device\|^spec" | tee -a "$O/bench.txt"
  done
  CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout 90 $CS --tool initcheck --print-limit 10 /tmp/v/V6 1q1s8k q2k_63q1s4k --kv-cache-dtype auto,fp8 --warmup 1 --repeats 2 > /tmp/cs.log 2>&1
  echo "initcheck rc $?: $(grep -E 'ERROR SUMMARY' /tmp/cs.log | tail -1)" | tee -a "$O/summary.txt"
  grep -E "ok$|FAILED" /tmp/cs.log | head -6 >> "$O/summary.txt"
  tar -czf "$O/json.tgz" -C /tmp j 2>/dev/null
elif [ "$MODE" = boundary ]; then
  AB_FILE=${BOUNDARY[0]} host_ab W X "${BOUNDARY[1]}" 3 8q4k 2q16k
elif [ "$MODE" = early ]; then
  host_ab E P "$EARLY_OFF" 3 1q1s8k 2q1s4k 64q1s4k 8q1s32k q2k_63q1s4k
else
  host_ab Q N "$QUERY_OFF" 2 64q1s4k 8q1s32k 1q1s8k 8q4k q2k_63q1s4k
fi
t done
