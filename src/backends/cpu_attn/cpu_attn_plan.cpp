#include "backends/cpu_attn/cpu_attn_plan.h"

#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"

#include <algorithm>
#include <numeric>

namespace pagedattn::cpu_attn {

namespace {

// Estimated work of an item: query tokens x keys it reads (causal tiles stop
// at their last query position).
std::int64_t item_cost(const WorkItem& item, int context_len, bool causal) {
  const int k_end = causal ? std::min(item.k_end, context_len + item.q_end) : item.k_end;
  return static_cast<std::int64_t>(item.q_end - item.q_begin) * std::max(1, k_end - item.k_begin);
}

// Decodes and short speculative steps: split along their keys, KV heads grouped.
bool decode_like(int q_len) { return q_len > 0 && q_len <= kSplitMaxQueryTokens; }

// Key splits of a request (1: not split).
int key_splits(int q_len, int keys) {
  // In 64 bits: keys + kSplitKeys - 1 passes INT_MAX for the longest contexts.
  const std::int64_t splits = (static_cast<std::int64_t>(keys) + kSplitKeys - 1) / kSplitKeys;
  return decode_like(q_len) ? std::max(1, static_cast<int>(splits)) : 1;
}

// Key bound of split `s` (the last split's end is clamped to `keys` by the
// caller), in 64 bits for the same reason.
int split_key(int s, int keys) {
  return static_cast<int>(std::min<std::int64_t>(keys, static_cast<std::int64_t>(s) * kSplitKeys));
}

// Float vectors one chunk-tile load of `kv` yields (1: head-dimension order):
// bf16 as even / odd halves, e4m3 as four byte positions where the target reads
// it as float bits.
int chunk_ways(DType kv, const TargetShape& target) {
  if (kv == DType::BF16) return 2;
  return kv == DType::FP8_E4M3 && target.e4m3_as_float_bits ? 4 : 1;
}

// Whether K or V rows of one KV head are not adjacent in memory (NHD caches
// with several KV heads, or strided new keys).
bool rows_scattered(const AttentionParams& p) {
  const int d = p.head_size;
  if (p.variant.key_source == KeySource::DenseRows) return p.key.row_stride != d || p.value.row_stride != d;
  return p.key_cache.slot_stride != d || p.value_cache.slot_stride != d;
}

}  // namespace

WorkspaceSize plan_workspace(const WorkList& plan, int head_size, int group, int thread_slots) {
  WorkspaceSize size;
  size.scratch_bytes = scratch_bytes(head_size, plan.max_item_tokens * group, plan.max_item_kv_heads);
  size.thread_slots = thread_slots;
  size.partial_floats = static_cast<std::size_t>(plan.partial_tokens) * static_cast<std::size_t>(group) *
                        partial_row_floats(head_size);
  return size;
}

KernelVariant choose_kernel_variant(const AttentionParams& p, Isa isa) {
  const TargetShape target = target_shape(isa);
  const int d = p.head_size;
  // Per-token-head caches are dequantized tile by tile into f32 rows.
  const DType kv = token_scaled(p) ? DType::F32 : p.kv_dtype;
  KernelVariant v;
  v.kv_dtype = kv;
  v.width = d % target.full_lanes == 0 ? VectorWidth::kFull : VectorWidth::kEight;
  const int lanes = v.width == VectorWidth::kFull ? target.full_lanes : kMinHeadSizeMultiple;
  const bool bf16_dot = isa == Isa::Avx512Bf16 && p.query.dtype == DType::BF16;

  // Few rows: the AVX512-BF16 decode tiles (a rowwise vdpbf16ps loop measured
  // slower than fp32; converting whole 64-value chunks and pairing V keys is
  // what makes them pay, docs/cpu_attn.md), else the chunk tiles where their
  // blocks divide the head size, else the tile loop's rowwise scores.
  const bool decode_dot = bf16_dot && (kv == DType::BF16 || kv == DType::FP8_E4M3) && d % kDecodeDotChunk == 0;
  const bool chunked = d % (std::max(2, chunk_ways(kv, target)) * lanes) == 0;
  if (decode_dot || chunked) {
    v.few_rows.algorithm = ItemAlgorithm::kDecode;
    v.few_rows.decode_tiles = decode_dot ? DecodeTiles::kBf16Dot : DecodeTiles::kChunks;
    v.few_rows_by_four = v.few_rows;
    if (!decode_dot && target.chunk_quads) v.few_rows_by_four.decode_tiles = DecodeTiles::kChunkQuads;
  } else {
    v.few_rows = ItemKernel{ItemAlgorithm::kTiles, DecodeTiles::kChunks, TileScores::kRowwise, TilePv::kRows};
    v.few_rows_by_four = v.few_rows;
  }

  // Many rows: the transposed K tile, as bf16 pairs with AVX512-BF16 and bf16
  // keys; V converted once per tile.
  const bool bf16_tiles = bf16_dot && kv == DType::BF16;
  v.many_rows.algorithm = ItemAlgorithm::kTiles;
  v.many_rows.scores = bf16_tiles && d % kBf16ScoresDimMultiple == 0 ? TileScores::kTransposedBf16
                                                                      : TileScores::kTransposed;
  if (v.many_rows.scores == TileScores::kTransposedBf16 && d % kBf16PvDimMultiple == 0) {
    v.many_rows.pv = TilePv::kBf16;
  } else {
    v.many_rows.pv = d % (target.wide_pv_vectors * lanes) == 0 ? TilePv::kConvertedWide : TilePv::kConverted;
  }

  // The decode walk's streams. The chunk tiles take the far stream for 2- and
  // 4-byte K/V only (with 1-byte K/V it measured slower); the AVX512-BF16
  // tiles prefetch the next unit into L1 only when it and the unit computed
  // take at most half of L1 (bf16 units at head size 128 evicted the unit
  // computed, and the L2 hint measured faster; with 64-key tiles so did e4m3
  // units of 16 KiB; docs/cpu_attn.md).
  const std::size_t row_bytes = static_cast<std::size_t>(d) * dtype_size(kv);
  const std::size_t unit_bytes = 2 * kTileKeys * row_bytes;
  v.decode.staged = !token_scaled(p) && rows_scattered(p);
  v.decode.packed_key_scores = decode_dot && kv == DType::FP8_E4M3 && p.variant.key_source == KeySource::PagedCache &&
                               p.key_cache.packing != KeyPacking::None;
  v.decode.far_stream = decode_dot || dtype_size(kv) > 1;
  v.decode.near_into_l2 = decode_dot && 2 * unit_bytes > kL1DataBytes / 2;
  return v;
}

WorkList make_work_list(std::span<const std::int32_t> query_start_loc, std::span<const std::int32_t> seq_lens,
                        int num_kv_heads, bool causal, int min_items) {
  WorkList plan;
  std::vector<std::int64_t> costs;
  const auto num_reqs = static_cast<int>(seq_lens.size());
  const auto q_len_of = [&](int r) {
    return query_start_loc[static_cast<std::size_t>(r) + 1] - query_start_loc[static_cast<std::size_t>(r)];
  };
  // Key splits of the decode-like requests: each makes (KV heads / heads per
  // item) items.
  std::int64_t decode_pieces = 0;
  for (int r = 0; r < num_reqs; ++r) {
    const int q_len = q_len_of(r);
    if (decode_like(q_len)) {
      decode_pieces += key_splits(q_len, seq_lens[static_cast<std::size_t>(r)]);
    }
  }
  int group_heads = 1;  // a divisor of num_kv_heads
  for (int g = num_kv_heads; g > 1; --g) {
    if (num_kv_heads % g == 0 && decode_pieces * (num_kv_heads / g) >= min_items) {
      group_heads = g;
      break;
    }
  }
  for (int r = 0; r < num_reqs; ++r) {
    const int q_len = q_len_of(r);
    const int keys = seq_lens[static_cast<std::size_t>(r)];
    if (q_len <= 0) continue;
    const int context_len = keys - q_len;
    const int splits = key_splits(q_len, keys);
    const int heads = decode_like(q_len) ? group_heads : 1;
    plan.max_item_kv_heads = std::max(plan.max_item_kv_heads, heads);
    // Each KV head's split partials are adjacent (one merge reads them).
    const std::int64_t head_slots = static_cast<std::int64_t>(splits) * q_len;
    for (int h = 0; h < num_kv_heads; h += heads) {
      if (splits == 1) {
        for (int q0 = 0; q0 < q_len; q0 += kQueryTileTokens) {
          const WorkItem item{.request = r,
                              .kv_head = h,
                              .kv_heads = heads,
                              .q_begin = q0,
                              .q_end = std::min(q_len, q0 + kQueryTileTokens),
                              .k_begin = 0,
                              .k_end = keys};
          plan.items.push_back(item);
          costs.push_back(heads * item_cost(item, context_len, causal));
        }
        continue;
      }
      for (int s = 0; s < splits; ++s) {
        const WorkItem item{.request = r,
                            .kv_head = h,
                            .kv_heads = heads,
                            .q_begin = 0,
                            .q_end = q_len,
                            .k_begin = split_key(s, keys),
                            .k_end = split_key(s + 1, keys),
                            .partial_token = plan.partial_tokens + static_cast<std::int64_t>(s) * q_len,
                            .partial_head_stride = head_slots};
        plan.items.push_back(item);
        costs.push_back(heads * item_cost(item, context_len, causal));
      }
      for (int g = 0; g < heads; ++g) {
        plan.merges.push_back(MergeItem{r, h + g, 0, q_len, plan.partial_tokens, splits});
        plan.partial_tokens += head_slots;
      }
    }
    plan.max_item_tokens = std::max(plan.max_item_tokens, std::min(q_len, kQueryTileTokens));
  }
  std::vector<std::size_t> order(plan.items.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&costs](std::size_t a, std::size_t b) { return costs[a] > costs[b]; });
  std::vector<WorkItem> sorted;
  sorted.reserve(order.size());
  for (std::size_t i : order) sorted.push_back(plan.items[i]);
  plan.items = std::move(sorted);
  return plan;
}

}  // namespace pagedattn::cpu_attn
