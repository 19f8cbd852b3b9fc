// The CPU_ATTN tile loop (ItemAlgorithm::kTiles): prefills, and items of few
// rows whose head size the decode walk's chunks do not divide. Per tile of
// kTileKeys keys: the variant's score step (TileScores), the online softmax,
// the variant's P V step (TilePv). Highway foreach_target unit.

#include "backends/cpu_attn/kernels/cpu_attn_targets.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu_attn/kernels/cpu_attn_prefill.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target must come first; the rest follows.
#include <hwy/highway.h>

#include <algorithm>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"
#include "backends/cpu_attn/kernels/cpu_attn_prefill_tiles-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_target-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Besides the next tile (into L1), the tile loop prefetches the tile this many
// tiles ahead into L2: more DRAM reads in flight (docs/cpu_attn.md).
constexpr int kFarPrefetchTiles = 4;

// The variant's score step. A target runs only the kernels its TargetShape
// has: choose_kernel_variant names no others for it.
template <DType KV, class D>
void tile_scores(D d, TileScores scores, const Scratch& sc, int rows, int d_size, int n,
                 const unsigned char* const* k_rows, float scale) {
  if constexpr (kTarget.bf16_dot && KV == DType::BF16) {
    if (scores == TileScores::kTransposedBf16)
      return Bf16Tiles<KV>::scores(sc, rows, d_size, n, k_rows, scale);
  }
  if (scores == TileScores::kTransposed) return scores_transposed<KV>(d, sc, rows, d_size, n, k_rows);
  scores_rowwise<KV>(d, sc, rows, d_size, n, k_rows);
}

// The variant's P V step.
template <DType KV, class D>
void tile_pv(D d, TilePv pv, const Scratch& sc, int rows, int d_size, int n,
             const unsigned char* const* v_rows) {
  if constexpr (kTarget.bf16_dot && KV == DType::BF16) {
    if (pv == TilePv::kBf16) return Bf16Tiles<KV>::pv(sc, rows, d_size, n, v_rows);
  }
  if (pv == TilePv::kRows) return accumulate_pv<KV>(d, sc, rows, d_size, n, v_rows);
  // A per-token-head tile was dequantized into sc.vf already (dequantize_tile).
  const bool converted = n > 0 && v_rows[0] == reinterpret_cast<const unsigned char*>(sc.vf);
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < n && !converted; ++i) {
    for (int c = 0; c < d_size; c += lanes)
      hn::Store(load_kv<KV>(d, v_rows[i] + c * esize), d, sc.vf + i * d_size + c);
  }
  if (pv == TilePv::kConvertedWide) return accumulate_pv_wide(d, sc, rows, d_size, n);
  accumulate_pv<KV>(d, sc, rows, d_size, n, nullptr);
}

// One KV head of an item.
template <DType KV, class D>
void run_tiles_head(D d, const AttentionParams& p, const ItemKernel& kernel, const WorkItem& item,
                    const PartialState& partials, void* scratch) {
  const ItemShape shape = item_shape(p, item.request, item.q_begin, item.q_end);
  const int d_size = p.head_size;
  const Scratch sc(scratch, d_size, shape.rows, 0, 1);
  int lo = 0;
  int hi = 0;
  begin_head(p, item, shape, sc, lo, hi);
  const float k_scale = dequant_scale(p, p.k_scale, item.kv_head);
  // The bf16 scores take the bf16 query rows unscaled, and scale the scores.
  if (kernel.scores == TileScores::kTransposedBf16) {
    load_queries_bf16(p, item, shape, reinterpret_cast<std::uint16_t*>(sc.q));
  } else {
    load_queries(p, item, shape, p.variant.scale * k_scale, sc.q);
  }

  // The rows in the cache (KV is f32 where the item dequantizes a per-token-head cache).
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(p.kv_dtype);
  // Row pointers of the tile computed and of the next one, which is
  // prefetched meanwhile and computed in the next iteration.
  const unsigned char* tile_k[2][kTileKeys];
  const unsigned char* tile_v[2][kTileKeys];
  const unsigned char* far_k[kTileKeys];
  const unsigned char* far_v[kTileKeys];
  int cur = 0;
  if (lo < hi) tile_pointers(p, item, shape, lo, std::min(kTileKeys, hi - lo), tile_k[cur], tile_v[cur]);
  const bool packed_k = keys_packed(p);
  const unsigned char* unpacked_k[kTileKeys];
  const unsigned char* dequantized_v[kTileKeys];
  for (int t0 = lo; t0 < hi; t0 += kTileKeys, cur ^= 1) {
    const int n = std::min(kTileKeys, hi - t0);
    const unsigned char* const* k_rows = tile_k[cur];  // [n] this tile's rows
    const unsigned char* const* v_rows = tile_v[cur];
    const int next = t0 + kTileKeys;
    const int next_n = next < hi ? std::min(kTileKeys, hi - next) : 0;
    if (next_n > 0) tile_pointers(p, item, shape, next, next_n, tile_k[cur ^ 1], tile_v[cur ^ 1]);
    prefetch_rows<kKeepInL1>(tile_k[cur ^ 1], next_n, row_bytes);
    prefetch_rows<kKeepInL1>(tile_v[cur ^ 1], next_n, row_bytes);
    const int far = t0 + kFarPrefetchTiles * kTileKeys;
    if (far < hi) {
      const int far_n = std::min(kTileKeys, hi - far);
      tile_pointers(p, item, shape, far, far_n, far_k, far_v);
      prefetch_rows<kKeepInL2>(far_k, far_n, row_bytes);
      prefetch_rows<kKeepInL2>(far_v, far_n, row_bytes);
    }
    if (token_scaled(p)) {
      dequantize_tile(d, p, item.request, item.kv_head, t0, n, k_rows, v_rows, sc, unpacked_k, dequantized_v);
      k_rows = unpacked_k;
      v_rows = dequantized_v;
    } else if (packed_k) {
      unpack_key_rows<KV>(p, t0, n, k_rows, sc.ks, unpacked_k);
      k_rows = unpacked_k;
    }
    tile_scores<KV>(d, kernel.scores, sc, shape.rows, d_size, n, k_rows, p.variant.scale);
    softmax_tile(d, p, sc, shape.rows, t0, n);
    tile_pv<KV>(d, kernel.pv, sc, shape.rows, d_size, n, v_rows);
  }

  end_head(p, item, shape, sc, partials);
}

// The tile loop takes an item's KV heads one after another.
template <DType KV, class D>
void run_tiles_typed(D d, const AttentionParams& p, const ItemKernel& kernel, const WorkItem& item,
                     const PartialState& partials, void* scratch) {
  for (int h = 0; h < item.kv_heads; ++h)
    run_tiles_head<KV>(d, p, kernel, head_of(item, h), partials, scratch);
}

void run_tiles_item(const AttentionParams& p, const KernelVariant& variant, const ItemKernel& kernel,
                    const WorkItem& item, const PartialState& partials, void* scratch) {
  with_variant_types(variant, [&](auto d, auto kv) {
    run_tiles_typed<decltype(kv)::value>(d, p, kernel, item, partials, scratch);
  });
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagedattn::cpu_attn {

RunItemFn tiles_entry_for(Isa isa) { return PAGEDATTN_CPU_ATTN_ENTRY(run_tiles_item, isa); }

}  // namespace pagedattn::cpu_attn
#endif  // HWY_ONCE
