// The CPU_ATTN decode walk (ItemAlgorithm::kDecode): items of few rows
// (decodes, short speculative steps), all of an item's KV heads together, tile
// by tile and within a tile head by head. The tiles are the variant's
// (DecodeTiles): the chunk tiles of every target (cpu_attn_decode_tiles-inl.h),
// AVX2's four-row tiles or the AVX512-BF16 tiles. Highway foreach_target unit.

#include "backends/cpu_attn/kernels/cpu_attn_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu_attn/kernels/cpu_attn_decode.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target must come first; the rest follows.
#include <hwy/highway.h>

#include <algorithm>
#include <cstring>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_decode_tiles-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_decode_tiles_avx2-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_decode_tiles_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"
#include "backends/cpu_attn/kernels/cpu_attn_target-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The decode walk's interface to the chunk tiles (DecodeTiles::kChunks, and
// kChunkQuads with kQuads): queries scaled by the softmax and K scales and put
// in chunk order, the accumulator put back into head order at the end.
template <DType KV, bool kQuads>
struct ChunkTiles {
  template <class D>
  static void load_queries(D d, const AttentionParams& p, const WorkItem& one, const ItemShape& shape,
                           const Scratch& sc, bool) {
    cpu_attn::HWY_NAMESPACE::load_queries(p, one, shape, p.variant.scale * dequant_scale(p, p.k_scale, one.kv_head),
                                          sc.q);
    reorder_rows<KV>(sc.q, sc.tmp, shape.rows, p.head_size, static_cast<int>(hn::Lanes(d)), true);
  }
  template <class D>
  static void tile(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                   const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                   const TilePrefetch& ahead, const TilePrefetch& far, int, bool) {
    tile_decode<KV, kQuads>(d, p, sc, rows, t0, n, k_rows, v_rows, ahead, far);
  }
  template <class D>
  static void finish(D d, const AttentionParams& p, const Scratch& sc, int rows) {
    reorder_rows<KV>(sc.acc, sc.tmp, rows, p.head_size, static_cast<int>(hn::Lanes(d)), false);
  }
};

// Copies n rows of row_bytes into out, one after another, and points
// staged[i] at row i's copy. Reads nothing past a row (rows need not be a
// whole number of vectors: e5m2 head size 80 is 80 bytes). HWY_SCALAR has no
// byte vector wider than one float: it copies with memcpy alone.
template <class D>
void stage_rows(D, const unsigned char* const* rows, int n, std::size_t row_bytes, unsigned char* out,
                const unsigned char** staged) {
  const hn::Repartition<std::uint8_t, D> du8;
  std::size_t whole = 0;  // bytes copied a vector at a time
  if constexpr (kTarget.byte_vectors) whole = row_bytes / hn::Lanes(du8) * hn::Lanes(du8);
  for (int i = 0; i < n; ++i) {
    unsigned char* dst = out + static_cast<std::size_t>(i) * row_bytes;
    if constexpr (kTarget.byte_vectors) {
      for (std::size_t b = 0; b < whole; b += hn::Lanes(du8))
        hn::StoreU(hn::LoadU(du8, rows[i] + b), du8, dst + b);
    }
    if (whole < row_bytes) std::memcpy(dst + whole, rows[i] + whole, row_bytes - whole);
    staged[i] = dst;
  }
}

// The walk over an item's KV heads: tile by tile, and within a tile head by
// head, each head with its own state. One KV head per item reads 4 KiB of each
// HND block (16 keys, head size 128, bf16) and jumps; all heads of a block
// range read whole blocks, measured faster (docs/cpu_attn.md; the software
// prefetches still carry the reads). The next (tile, head) unit is prefetched
// into L1 while one is computed, and the unit kFarPrefetchUnits ahead into L2
// (on Zen 4 the L2 hint leaves the L1 miss buffers to the near prefetches and
// the demand loads).
template <class Tiles, DType KV, class D>
void walk_decode_units(D d, const AttentionParams& p, const DecodeStreams& streams, const WorkItem& item,
                       const PartialState& partials, void* scratch) {
  const ItemShape shape = item_shape(p, item.request, item.q_begin, item.q_end);
  const int d_size = p.head_size;
  const int heads = item.kv_heads;
  const auto head_scratch = [&](int h) { return Scratch(scratch, d_size, shape.rows, h, heads); };
  int lo = 0;
  int hi = 0;  // the same for every head: no mask depends on the head
  const bool packed_k = keys_packed(p);
  // Tiles that start a Keys16 group may read the packed K as it is; other
  // packed K is unpacked per tile. lo is the same for all of the item's tiles.
  bool packed_scores = false;
  for (int h = 0; h < heads; ++h) {
    const WorkItem one = head_of(item, h);
    const Scratch sc = head_scratch(h);
    begin_head(p, one, shape, sc, lo, hi);
    packed_scores = streams.packed_key_scores && lo % kPackedKeyGroup == 0;
    Tiles::load_queries(d, p, one, shape, sc, packed_scores);
  }
  // The rows in the cache (KV is f32 where the item dequantizes a per-token-head cache).
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(p.kv_dtype);
  // Staged units are copied into the transposed-K and V-tile buffers, which
  // the decode tiles leave unused.
  const unsigned char* staged_k[kTileKeys];
  const unsigned char* staged_v[kTileKeys];
  // Units in order: (tile 0, head 0), (tile 0, head 1), ... Row pointers of
  // the units from the one computed to the last one prefetched, each computed
  // once: the next unit is prefetched into L1 and the one kFarPrefetchUnits
  // ahead into L2.
  constexpr int kUnitRing = kFarPrefetchUnits + 1;
  const unsigned char* unit_k[kUnitRing][kTileKeys];
  const unsigned char* unit_v[kUnitRing][kTileKeys];
  const int lookahead = streams.far_stream ? kFarPrefetchUnits : 1;
  const int units = lo < hi ? (hi - lo + kTileKeys - 1) / kTileKeys * heads : 0;
  const auto unit_t0 = [&](int u) { return lo + u / heads * kTileKeys; };
  const auto unit_n = [&](int u) { return u < units ? std::min(kTileKeys, hi - unit_t0(u)) : 0; };
  const auto pointers = [&](int u) {
    tile_pointers(p, head_of(item, u % heads), shape, unit_t0(u), unit_n(u), unit_k[u % kUnitRing],
                  unit_v[u % kUnitRing]);
  };
  const auto prefetch_of = [&](int u, int lines) {
    return TilePrefetch{unit_k[u % kUnitRing], unit_v[u % kUnitRing], unit_n(u), lines, streams.near_into_l2};
  };
  for (int u = 0; u < std::min(units, lookahead); ++u) pointers(u);
  for (int u = 0; u < units; ++u) {
    if (u + lookahead < units) pointers(u + lookahead);
    const TilePrefetch ahead = prefetch_of(u + 1, cache_lines(row_bytes));
    const unsigned char* const* k_rows = unit_k[u % kUnitRing];  // [n] this unit's rows
    const unsigned char* const* v_rows = unit_v[u % kUnitRing];
    const int n = unit_n(u);
    const Scratch sc = head_scratch(u % heads);
    if (token_scaled(p)) {
      dequantize_tile(d, p, item.request, item.kv_head + u % heads, unit_t0(u), n, k_rows, v_rows, sc,
                      staged_k, staged_v);
      k_rows = staged_k;
      v_rows = staged_v;
    } else if (packed_k && !packed_scores) {
      unpack_key_rows<KV>(p, unit_t0(u), n, k_rows, sc.ks, staged_k);
      k_rows = staged_k;
    } else if (streams.staged) {
      // A packed K's rows are adjacent, so its groups are copied whole.
      stage_rows(d, k_rows, n, row_bytes, reinterpret_cast<unsigned char*>(sc.kt), staged_k);
      k_rows = staged_k;
    }
    // Per-token-head caches are never staged (cpu_attn_plan.cpp): their rows
    // were just dequantized.
    if (streams.staged) {
      stage_rows(d, v_rows, n, row_bytes, reinterpret_cast<unsigned char*>(sc.vf), staged_v);
      v_rows = staged_v;
    }
    const TilePrefetch far =
        streams.far_stream ? prefetch_of(u + kFarPrefetchUnits, cache_lines(row_bytes)) : TilePrefetch{};
    Tiles::tile(d, p, sc, shape.rows, unit_t0(u), n, k_rows, v_rows, ahead, far, item.kv_head + u % heads,
                packed_scores);
  }
  for (int h = 0; h < heads; ++h) {
    const Scratch sc = head_scratch(h);
    Tiles::finish(d, p, sc, shape.rows);
    end_head(p, head_of(item, h), shape, sc, partials);
  }
}

// The variant's tiles. A target runs only the tiles its TargetShape has:
// choose_kernel_variant names no others for it.
template <DType KV, class D>
void run_decode_typed(D d, const AttentionParams& p, const DecodeStreams& streams, const ItemKernel& kernel,
                      const WorkItem& item, const PartialState& partials, void* scratch) {
  if constexpr (kTarget.bf16_dot && kDecodeDotKV<KV>) {
    if (kernel.decode_tiles == DecodeTiles::kBf16Dot) {
      return walk_decode_units<DotTiles<KV>, KV>(d, p, streams, item, partials, scratch);
    }
  }
  if constexpr (kTarget.chunk_quads) {
    if (kernel.decode_tiles == DecodeTiles::kChunkQuads) {
      return walk_decode_units<ChunkTiles<KV, true>, KV>(d, p, streams, item, partials, scratch);
    }
  }
  walk_decode_units<ChunkTiles<KV, false>, KV>(d, p, streams, item, partials, scratch);
}

void run_decode_item(const AttentionParams& p, const KernelVariant& variant, const ItemKernel& kernel,
                     const WorkItem& item, const PartialState& partials, void* scratch) {
  with_variant_types(variant, [&](auto d, auto kv) {
    run_decode_typed<decltype(kv)::value>(d, p, variant.decode, kernel, item, partials, scratch);
  });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagedattn::cpu_attn {

RunItemFn decode_entry_for(Isa isa) { return PAGEDATTN_CPU_ATTN_ENTRY(run_decode_item, isa); }

}  // namespace pagedattn::cpu_attn
#endif  // HWY_ONCE
