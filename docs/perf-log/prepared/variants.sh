# The A/B variants of attempts-73-75.diff's tree, sourced by ab.sh and
# short.sh: each a sed script editing WgmmaLayout's and the launch's lines
# in flash_wgmma_prefill.cuh ($H), and the count of lines it must change.
#   T  the diff: 73 (class 64: one n-tile in four exponentiated on the FMA
#      pipe), 74 (class 256, 16-bit K/V: 80-key tiles on registers 40 / 232)
#      and 75 (plain variants on their own instantiation);
#   P  75 alone: T against P is 73 at head size 64 and 74 at 256;
#   M  none: main's SASS in all three wgmma units (host check; the kernels'
#      names gain the kPlain argument).
H=src/backends/cuda_flash/kernels/flash_wgmma_prefill.cuh
POLY='kPolyExpEvery = kHC == 64 ? 4 : 0;'
TILE='kTileKeys = kHC <= 128 ? 128 : (kFp8 ? 64 : 80);'
REGS='kProducerRegs = kHC > 128 \&\& !kFp8 ? 40 : 72;'
PLAIN='kWgmmaPlainKernels = true;'
OFF73_74="s/$POLY/kPolyExpEvery = 0;/; s/$TILE/kTileKeys = kHC <= 128 ? 128 : 64;/; s/$REGS/kProducerRegs = 72;/"
declare -A EDIT=([T]="" [P]="$OFF73_74" [M]="$OFF73_74; s/$PLAIN/kWgmmaPlainKernels = false;/")
declare -A EDITS=([T]=0 [P]=3 [M]=4)
# Writes variant $1 of the pristine header /tmp/wgmma.cuh to $H; fails when
# its edits miss a line.
set_variant() {
  sed "${EDIT[$1]}" /tmp/wgmma.cuh > $H
  [ "$(diff /tmp/wgmma.cuh $H | grep -c '^>')" = "${EDITS[$1]}" ]
}
