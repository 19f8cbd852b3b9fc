# What ab.sh and short.sh share, sourced by both: the A/B's variants of
# attempts-73-75.diff's tree, each a sed script editing lines of
# flash_wgmma_prefill.cuh ($H) with the count of lines it must change, and
# the steps of an A/B. The caller sets O (results), S (start, epoch seconds)
# and DEADLINE (seconds after S by which timing stops), and builds its first
# variant into $B with `scripts/gpu` (PAGEDATTN_GPU_KEEP_BUILD=1).
#   T  the diff: 73 (class 64: one n-tile in four exponentiated on the FMA
#      pipe), 74 (class 256, 16-bit K/V: 80-key tiles on registers 40 / 232)
#      and 75 (plain variants on their own instantiation);
#   P  75 alone: T against P is 73 at head size 64 and 74 at 256;
#   M  none: main's SASS in all three wgmma units (host check; the kernels'
#      names gain the kPlain argument).
B=/tmp/pagedattn-gpu-build
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
PRISTINE=/tmp/wgmma.cuh
POLY='kPolyExpEvery = kHC == 64 ? 4 : 0;'
TILE='kTileKeys = kHC <= 128 ? 128 : (kFp8 ? 64 : 80);'
REGS='kProducerRegs = kHC > 128 \&\& !kFp8 ? 40 : 72;'
PLAIN='if (is_plain_variant(p.variant)) return'
OFF73_74="s/$POLY/kPolyExpEvery = 0;/; s/$TILE/kTileKeys = kHC <= 128 ? 128 : 64;/; s/$REGS/kProducerRegs = 72;/"
declare -A EDIT=([T]="" [P]="$OFF73_74" [M]="$OFF73_74; s/$PLAIN/if (false) return/")
declare -A EDITS=([T]=0 [P]=3 [M]=4)
cp $H $PRISTINE
mkdir -p /tmp/v

t() { echo "[$(( $(date +%s) - S )) s] $*" | tee -a "$O/ab.txt"; }
left() { [ $(( $(date +%s) - S )) -lt "$DEADLINE" ]; }

# Writes variant $1 of the pristine header to $H; fails when its edits miss
# a line.
set_variant() {
  sed "${EDIT[$1]}" $PRISTINE > $H
  [ "$(diff $PRISTINE $H | grep -c '^>')" = "${EDITS[$1]}" ] || { t "$1: an edit missed its line"; return 1; }
}

# Rebuilds the timing driver as variant $1 into /tmp/v/$1; the header is
# pristine again after.
build_variant() {
  set_variant $1 && ninja -C $B pagedattn_gpu_bench > /tmp/b_$1.log 2>&1 && cp $B/bin/pagedattn_gpu_bench /tmp/v/$1
  t "$1 built $?"
  cp $PRISTINE $H
}

bench() {  # variant, label, then gpu_bench arguments
  local v=$1 tag=$2; shift 2
  left && timeout 60 /tmp/v/$v "$@" --label $v 2>&1 | grep -v "^device\|^spec" | sed "s/^/$v $tag /" | tee -a "$O/ab.txt"
}

# Rounds of the given variants' workloads, alternated until DEADLINE: head
# size 128 (75 alone), 64 with fp8 K/V (73), 256 (74).
rounds() {
  local r v
  for r in 1 2 3 4 5; do
    for v in "$@"; do
      [ -x /tmp/v/$v ] || continue
      left || { t "round $r $v skipped (no time left)"; continue; }
      bench $v "r$r hd128" 8q4k 2q16k
      bench $v "r$r hd64" 8q4k --head-size 64 --kv-cache-dtype auto,fp8
      bench $v "r$r hd256" 8q4k --head-size 256
    done
  done
}
