// Target-independent pieces of the CPU_ATTN kernel: tile constants, the
// per-item scratch layout and the table of per-target entry points.
// Internal to src/backends/cpu_attn/kernels.
#pragma once

#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"
#include "backends/cpu_attn/kernels/cpu_attn_variant.h"

#include <cstddef>
#include <cstdint>

namespace pagedattn::cpu_attn {

// Keys per tile: four AVX-512 float vectors, so a score row of a tile fills
// whole vectors on every target (scalar 1 lane, AVX2 8, AVX-512 16). 64
// rather than 32 halves the per-tile work of the decode passes (the P V
// accumulators' load and store, the softmax's row state; docs/cpu_attn.md).
inline constexpr int kTileKeys = 64;
// Head sizes are multiples of this (the backend's head_size_rule).
inline constexpr int kMinHeadSizeMultiple = 8;
// Floats after the score tile: the AVX2 four-row score pass (three keys per
// pass, so a 64-key tile's last pass has one key in it) writes four rows of
// two keys past the tile's last column.
inline constexpr int kScorePadFloats = 2 * kRowBlock;

// Floats of a score tile for `rows` rows: whole blocks of kRowBlock rows (the
// AVX-512 decode tiles store each block key-step-major).
inline constexpr std::size_t score_tile_floats(std::size_t rows) {
  return (rows + kRowBlock - 1) / kRowBlock * kRowBlock * kTileKeys + kScorePadFloats;
}

// The decode walk prefetches the (tile, head) unit this many units ahead into
// L2, spread over its P V loop (8 to 16 measured alike, docs/cpu_attn.md).
inline constexpr int kFarPrefetchUnits = 8;
// L1 data cache of the CPUs the AVX512-BF16 decode runs on (Zen 4, Cascade
// Lake, Cooper Lake; newer Intel cores have 48 KiB).
inline constexpr std::size_t kL1DataBytes = 32 * 1024;
// Head-size multiples the AVX512-BF16 tile-loop kernels need: the scores take
// a 512-bit vector of bf16 pairs per step, P V eight float vectors per pass.
inline constexpr int kBf16ScoresDimMultiple = 32;
inline constexpr int kBf16PvDimMultiple = 128;

// What differs between the compiled targets' kernels, read by the host to
// choose a variant (choose_kernel_variant) and by each target's code.
struct TargetShape {
  int full_lanes = 1;               // floats per full vector
  int wide_pv_vectors = 4;          // TilePv::kConvertedWide: vectors x rows per block
  int wide_pv_rows = 2;
  bool e4m3_as_float_bits = false;  // the chunk tiles read e4m3 as float bits, 4-way blocks
  bool byte_vectors = false;        // byte vectors wider than one float (not HWY_SCALAR)
  bool chunk_quads = false;         // DecodeTiles::kChunkQuads
  bool bf16_dot = false;            // the vdpbf16ps kernels (run under Isa::Avx512Bf16 only)
};

// AVX-512: 2 x 8 wide P V accumulators of its 32 registers. AVX2: 3 x 4 = 12
// of 16, since 8 FMA chains are the latency limit (4-cycle FMAs, two per
// cycle) and left no slack.
inline constexpr TargetShape kAvx512Shape{16, 8, 2, true, true, false, true};
inline constexpr TargetShape kAvx2Shape{8, 4, 3, true, true, true, false};
inline constexpr TargetShape kScalarShape{1, 4, 2, false, false, false, false};

inline constexpr TargetShape target_shape(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
    case Isa::Avx512:
      return kAvx512Shape;
    case Isa::Avx2:
      return kAvx2Shape;
    case Isa::Scalar:
      return kScalarShape;
  }
  return kScalarShape;
}

struct RowInfo {
  std::int32_t lo = 0;  // visible keys [lo, hi)
  std::int32_t hi = 0;
  float position = 0.0f;  // p, for ALiBi
  float slope = 0.0f;     // ALiBi slope (0 = none)
};

// Carves one work item's buffers out of the caller's scratch: per KV head of
// the item its own state, then the tile buffers (kt, vf, tmp, ks) once, so a
// one-head item keeps the layout its paths were tuned with.
struct Scratch {
  float* q = nullptr;       // [rows, D] query, times scale (and the K dequant scale)
  float* acc = nullptr;     // [rows, D] unnormalized output
  float* s = nullptr;       // score_tile_floats(rows): [rows, kTileKeys] scores, then probabilities (AVX-512
                            // decode tiles: row blocks, decode_score_step)
  float* m = nullptr;       // [rows] running max
  float* l = nullptr;       // [rows] running sum
  float* alpha = nullptr;   // [rows] rescale of the accumulator for the current tile
  RowInfo* rows = nullptr;  // [rows]
  float* kt = nullptr;      // [D, kTileKeys] transposed K tile (the decode walk: K rows staged)
  float* vf = nullptr;      // [kTileKeys, D] converted V tile (the decode walk: V rows staged; a
                            // per-token-head cache: V rows dequantized to f32)
  float* tmp = nullptr;     // [D] one converted row
  // [kTileKeys, D] K rows unpacked from a packed cache (unpack_key_rows), or
  // dequantized to f32 from a per-token-head one (dequantize_tile)
  unsigned char* ks = nullptr;

  // The buffers of KV head number `head` (0-based) of an item of `num_heads`.
  Scratch(void* base, int head_size, int num_rows, int head, int num_heads);
  static std::size_t bytes(int head_size, int num_rows, int num_heads);
};

// Entry points of one compiled target: one per item algorithm
// (cpu_attn_decode.cpp, cpu_attn_prefill.cpp) and the merge (cpu_attn_merge.cpp).
using RunItemFn = void (*)(const AttentionParams&, const KernelVariant&, const ItemKernel&, const WorkItem&,
                           const PartialState&, void* scratch);
using RunMergeFn = void (*)(const AttentionParams&, const MergeItem&, const PartialState&);
struct KernelTable {
  RunItemFn run_decode = nullptr;
  RunItemFn run_tiles = nullptr;
  RunMergeFn run_merge = nullptr;
};

bool isa_compiled(Isa isa);
// The table of a compiled ISA, from each unit's per-target tables.
KernelTable kernel_table_for(Isa isa);
RunItemFn decode_entry_for(Isa isa);
RunItemFn tiles_entry_for(Isa isa);
RunMergeFn merge_entry_for(Isa isa);

// A unit's entry for `isa` among its per-target ones (HWY_CHOOSE_AVX3 and
// HWY_CHOOSE_AVX2 give null for a target not compiled; isa_compiled says so).
// PAGEDATTN_CPU_ATTN_ENTRY(fn, isa) picks the unit's per-target function `fn`
// (in the unit's HWY_ONCE part, where the N_<TARGET> namespaces are named).
#define PAGEDATTN_CPU_ATTN_ENTRY(fn, isa) \
  entry_for<decltype(&N_SCALAR::fn)>(isa, HWY_CHOOSE_AVX3(fn), HWY_CHOOSE_AVX2(fn), &N_SCALAR::fn)
template <class Fn>
Fn entry_for(Isa isa, Fn avx3, Fn avx2, Fn scalar) {
  switch (isa) {
    case Isa::Avx512Bf16:
    case Isa::Avx512:
      return avx3;
    case Isa::Avx2:
      return avx2;
    case Isa::Scalar:
      return scalar;
  }
  return scalar;
}

}  // namespace pagedattn::cpu_attn
