// Target-independent pieces of the CPU_ATTN kernel: tile constants, the
// per-item scratch layout and the table of per-target entry points.
// Internal to src/backends/cpu_attn/kernels.
#pragma once

#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

#include <cstddef>
#include <cstdint>

namespace pagedattn::cpu_attn {

// Keys per tile: four AVX-512 float vectors, so a score row of a tile fills
// whole vectors on every target (scalar 1 lane, AVX2 8, AVX-512 16). 64
// rather than 32 halves the per-tile work of the decode passes (the P V
// accumulators' load and store, the softmax's row state): docs/perf.md,
// attempt 50.
inline constexpr int kTileKeys = 64;
// Head sizes are multiples of this (the backend's head_size_rule).
inline constexpr int kMinHeadSizeMultiple = 8;
// The score tile holds its rows in blocks of this many (the AVX-512 decode
// tiles store each block key-step-major), so it is sized for whole blocks.
inline constexpr int kScoreRowBlock = 4;
// Floats after the score tile: the AVX2 four-row score pass (three keys per
// pass, so a 64-key tile's last pass has one key in it) writes four rows of
// two keys past the tile's last column.
inline constexpr int kScorePadFloats = 2 * kScoreRowBlock;

// Floats of a score tile for `rows` rows.
inline constexpr std::size_t score_tile_floats(std::size_t rows) {
  return (rows + kScoreRowBlock - 1) / kScoreRowBlock * kScoreRowBlock * kTileKeys + kScorePadFloats;
}

struct RowInfo {
  std::int32_t lo = 0;  // visible keys [lo, hi)
  std::int32_t hi = 0;
  float position = 0.0f;  // p, for ALiBi
  float slope = 0.0f;     // ALiBi slope (0 = none)
};

// Carves one work item's buffers out of the caller's scratch: per KV head of
// the item its own state, then the tile buffers (kt, vf, tmp) once, so a
// one-head item keeps the layout its paths were tuned with.
struct Scratch {
  float* q = nullptr;       // [rows, D] query, times scale (and the K dequant scale)
  float* acc = nullptr;     // [rows, D] unnormalized output
  float* s = nullptr;       // score_tile_floats(rows): [rows, kTileKeys] scores, then probabilities (AVX-512
                            // decode tiles: row blocks, DecodeScoreStep)
  float* m = nullptr;       // [rows] running max
  float* l = nullptr;       // [rows] running sum
  float* alpha = nullptr;   // [rows] rescale of the accumulator for the current tile
  RowInfo* rows = nullptr;  // [rows]
  float* kt = nullptr;      // [D, kTileKeys] transposed K tile (the chunked decode path: raw K rows, staged)
  float* vf = nullptr;      // [kTileKeys, D] converted V tile (the chunked decode path: raw V rows, staged)
  float* tmp = nullptr;     // [D] one converted row
  unsigned char* ks = nullptr;  // [kTileKeys, D] K rows unpacked from a packed cache (unpack_key_rows)

  // The buffers of KV head number `head` (0-based) of an item of `num_heads`.
  Scratch(void* base, int head_size, int num_rows, int head, int num_heads);
  static std::size_t bytes(int head_size, int num_rows, int num_heads);
};

// Entry points of one compiled target.
struct KernelTable {
  void (*run_item)(const AttentionParams&, const WorkItem&, const PartialState&, void* scratch) = nullptr;
  void (*run_merge)(const AttentionParams&, const MergeItem&, const PartialState&) = nullptr;
};

bool isa_compiled(Isa isa);
// The table of a compiled ISA.
KernelTable kernel_table_for(Isa isa);

}  // namespace pagedattn::cpu_attn
