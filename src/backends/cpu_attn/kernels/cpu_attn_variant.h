// Which micro-kernels run a work item. The host chooses the variant once per
// forward call (choose_kernel_variant, cpu_attn_plan.h) from the layer, the
// cache and the ISA; the kernels dispatch on it and test no flags of their own.
#pragma once

#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn::cpu_attn {

// Items with at least this many rows (query tokens x GQA group) take the
// transposed-K score path: its packing cost amortizes over the rows.
inline constexpr int kTransposeMinRows = 16;
// Rows share one pass over a K row or a transposed K column in blocks of this many.
inline constexpr int kRowBlock = 4;

// The float vectors: the target's full width, or 8 lanes where the head size
// is not a multiple of the full width (every target has 8-lane vectors).
enum class VectorWidth : std::uint8_t { kFull, kEight };

// An item's algorithm: the decode walk (its heads together, unit by unit,
// cpu_attn_decode.cpp) or the tile loop (cpu_attn_prefill.cpp).
enum class ItemAlgorithm : std::uint8_t { kDecode, kTiles };

// The decode walk's tiles.
enum class DecodeTiles : std::uint8_t {
  kChunks,      // K/V in chunks of two float vectors, rows in blocks of 4, 2, 1
  kChunkQuads,  // AVX2, rows a multiple of four: key-major four-row tiles
  kBf16Dot,     // AVX512-BF16: vdpbf16ps tiles (bf16 queries, bf16 or e4m3 K/V)
};

// The tile loop's score step.
enum class TileScores : std::uint8_t {
  kRowwise,         // dot products straight from the K rows (few rows)
  kTransposed,      // a transposed fp32 K tile, no reductions (many rows)
  kTransposedBf16,  // AVX512-BF16: the transposed tile as bf16 pairs
};

// The tile loop's P V step.
enum class TilePv : std::uint8_t {
  kRows,           // V straight from its rows, four rows at a time (few rows)
  kConverted,      // V converted into a tile first, four rows at a time
  kConvertedWide,  // the same, the target's wide register block
  kBf16,           // AVX512-BF16: V as bf16 key pairs
};

struct ItemKernel {
  ItemAlgorithm algorithm = ItemAlgorithm::kTiles;
  DecodeTiles decode_tiles = DecodeTiles::kChunks;  // kDecode
  TileScores scores = TileScores::kRowwise;         // kTiles
  TilePv pv = TilePv::kRows;                        // kTiles

  bool operator==(const ItemKernel&) const = default;
};

// How the decode walk reads and prefetches the cache.
struct DecodeStreams {
  // Copy each unit's K and V rows together first: one KV head's rows are not
  // adjacent (NHD caches with several KV heads), and share a few L1 sets.
  bool staged = false;
  // The dot tiles read a Keys16-packed e4m3 K as it is (an item whose first
  // key starts a group); other packed K is unpacked per tile.
  bool packed_key_scores = false;
  // The unit kFarPrefetchUnits ahead is prefetched into L2 from the P V loops.
  bool far_stream = false;
  // The near prefetch takes the L2 hint (units that would crowd L1).
  bool near_into_l2 = false;
};

struct KernelVariant {
  DType kv_dtype = DType::BF16;
  VectorWidth width = VectorWidth::kFull;
  ItemKernel few_rows;          // fewer than kTransposeMinRows rows
  ItemKernel few_rows_by_four;  // the same, a multiple of kRowBlock rows
  ItemKernel many_rows;
  DecodeStreams decode;

  const ItemKernel& for_rows(int rows) const {
    if (rows >= kTransposeMinRows) return many_rows;
    return rows % kRowBlock == 0 ? few_rows_by_four : few_rows;
  }
};

}  // namespace pagedattn::cpu_attn
