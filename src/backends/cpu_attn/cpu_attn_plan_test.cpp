#include "backends/cpu_attn/cpu_attn_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <vector>

namespace pagedattn::cpu_attn {
namespace {

struct Batch {
  std::vector<std::int32_t> query_start_loc{0};
  std::vector<std::int32_t> seq_lens;
  void add(int q_len, int seq_len) {
    query_start_loc.push_back(query_start_loc.back() + q_len);
    seq_lens.push_back(seq_len);
  }
  WorkList plan(int kv_heads, bool causal = true, int min_items = 1) const {
    return make_work_list(query_start_loc, seq_lens, kv_heads, causal, min_items);
  }
};

TEST(CpuAttnPlanTest, EveryQueryTileAndKeyIsCoveredOnce) {
  Batch b;
  b.add(1, 5000);   // long decode: split
  b.add(40, 40);    // prefill: three query tiles
  b.add(3, 100);    // short speculative step, not split (one chunk)
  b.add(0, 7);      // no queries: no work
  const int kv_heads = 2;
  const WorkList plan = b.plan(kv_heads);
  // (request, head, query token) -> covered key ranges.
  std::map<std::tuple<int, int, int>, int> keys_covered;
  for (const WorkItem& it : plan.items) {
    for (int h = it.kv_head; h < it.kv_head + it.kv_heads; ++h) {
      for (int q = it.q_begin; q < it.q_end; ++q) keys_covered[{it.request, h, q}] += it.k_end - it.k_begin;
    }
  }
  for (int h = 0; h < kv_heads; ++h) {
    EXPECT_EQ((keys_covered[{0, h, 0}]), 5000);
    for (int q = 0; q < 40; ++q) EXPECT_EQ((keys_covered[{1, h, q}]), 40);
    for (int q = 0; q < 3; ++q) EXPECT_EQ((keys_covered[{2, h, q}]), 100);
  }
  EXPECT_EQ(keys_covered.size(), static_cast<std::size_t>(kv_heads * (1 + 40 + 3)));
  EXPECT_EQ(plan.max_item_tokens, kQueryTileTokens);
}

// The split arithmetic runs in 64 bits: a decode of INT_MAX keys (the largest
// seq_len) once overflowed int computing its split count and bounds.
TEST(CpuAttnPlanTest, DecodeOfIntMaxKeysSplitsWithoutOverflow) {
  constexpr int kKeys = std::numeric_limits<std::int32_t>::max();
  Batch b;
  b.add(1, kKeys);
  const WorkList plan = b.plan(1);
  ASSERT_EQ(plan.merges.size(), 1u);
  const std::int64_t splits = (static_cast<std::int64_t>(kKeys) + kSplitKeys - 1) / kSplitKeys;
  EXPECT_EQ(plan.merges[0].num_splits, splits);
  EXPECT_EQ(std::ssize(plan.items), splits);
  std::int64_t covered = 0;
  int last_end = 0;
  for (const WorkItem& it : plan.items) {
    EXPECT_LT(it.k_begin, it.k_end);
    covered += it.k_end - it.k_begin;
    last_end = std::max(last_end, it.k_end);
  }
  EXPECT_EQ(covered, kKeys);
  EXPECT_EQ(last_end, kKeys);
}

TEST(CpuAttnPlanTest, LongDecodesSplitIntoFixedChunksWithDisjointPartials) {
  Batch b;
  b.add(1, 3 * kSplitKeys + 5);
  const WorkList plan = b.plan(1);
  ASSERT_EQ(plan.items.size(), 4u);
  ASSERT_EQ(plan.merges.size(), 1u);
  EXPECT_EQ(plan.merges[0].num_splits, 4);
  EXPECT_EQ(plan.partial_tokens, 4);
  std::set<std::int64_t> slots;
  for (const WorkItem& it : plan.items) {
    EXPECT_EQ(it.k_begin % kSplitKeys, 0);
    slots.insert(it.partial_token);
  }
  EXPECT_EQ(slots, (std::set<std::int64_t>{0, 1, 2, 3}));
}

TEST(CpuAttnPlanTest, CostliestItemsComeFirst) {
  Batch b;
  b.add(1, 10);
  b.add(64, 64);
  const WorkList plan = b.plan(1);
  ASSERT_FALSE(plan.items.empty());
  EXPECT_EQ(plan.items.front().request, 1);
  EXPECT_EQ(plan.items.back().request, 0);
}

// A request's items (ranges and split points) do not depend on the rest of the
// batch: the basis of the backend's batch-invariance claim.
TEST(CpuAttnPlanTest, RequestItemsIgnoreTheRestOfTheBatch) {
  Batch alone;
  alone.add(1, 2500);
  Batch mixed;
  mixed.add(300, 300);
  mixed.add(1, 2500);
  auto ranges = [](const WorkList& plan, int request) {
    std::set<std::tuple<int, int, int, int, int>> out;
    for (const WorkItem& it : plan.items) {
      if (it.request != request) continue;
      for (int h = it.kv_head; h < it.kv_head + it.kv_heads; ++h)
        out.insert({h, it.q_begin, it.q_end, it.k_begin, it.k_end});
    }
    return out;
  };
  EXPECT_EQ(ranges(alone.plan(2), 0), ranges(mixed.plan(2), 1));
  // The KV-head grouping moves with the batch and the thread count; the
  // per-head ranges do not.
  EXPECT_EQ(ranges(alone.plan(2, true, 100), 0), ranges(mixed.plan(2, true, 1), 1));
}

TEST(CpuAttnPlanTest, DecodesGroupTheMostKvHeadsThatLeaveMinItems) {
  Batch b;
  for (int r = 0; r < 8; ++r) b.add(1, 4 * kSplitKeys);  // 32 key pieces
  b.add(40, 40);                                         // a prefill keeps one KV head per item
  const int kv_heads = 8;
  struct Case {
    int min_items;
    int heads_per_item;
  };
  for (const Case c : {Case{1, 8}, Case{32, 8}, Case{33, 4}, Case{64, 4}, Case{65, 2}, Case{128, 2},
                       Case{129, 1}, Case{257, 1}}) {
    const WorkList plan = b.plan(kv_heads, true, c.min_items);
    int decode_items = 0;
    for (const WorkItem& it : plan.items) {
      if (it.request == 8) {
        EXPECT_EQ(it.kv_heads, 1);
        continue;
      }
      EXPECT_EQ(it.kv_heads, c.heads_per_item) << "min_items " << c.min_items;
      EXPECT_EQ(it.kv_head % c.heads_per_item, 0);
      ++decode_items;
    }
    EXPECT_EQ(decode_items, 32 * kv_heads / c.heads_per_item) << "min_items " << c.min_items;
    EXPECT_EQ(plan.max_item_kv_heads, c.heads_per_item);
  }
}

// Every (request, KV head, split, query token) of a grouped item has its own
// partial slot, the one its merge reads.
TEST(CpuAttnPlanTest, GroupedSplitItemsWriteTheSlotsTheirMergesRead) {
  Batch b;
  b.add(2, 2 * kSplitKeys + 1);  // three splits of two query tokens
  b.add(1, kSplitKeys + 7);
  const int kv_heads = 4;
  const WorkList plan = b.plan(kv_heads, true, 1);
  std::map<std::tuple<int, int, int>, std::int64_t> written;  // (request, head, k_begin) -> first slot
  std::set<std::int64_t> slots;
  for (const WorkItem& it : plan.items) {
    EXPECT_EQ(it.kv_heads, kv_heads);
    ASSERT_GE(it.partial_token, 0);
    for (int g = 0; g < it.kv_heads; ++g) {
      const std::int64_t first = it.partial_token + g * it.partial_head_stride;
      written[{it.request, it.kv_head + g, it.k_begin}] = first;
      for (int q = it.q_begin; q < it.q_end; ++q) EXPECT_TRUE(slots.insert(first + q).second);
    }
  }
  EXPECT_EQ(static_cast<std::int64_t>(slots.size()), plan.partial_tokens);
  ASSERT_EQ(plan.merges.size(), static_cast<std::size_t>(2 * kv_heads));
  for (const MergeItem& m : plan.merges) {
    const int q_len = m.q_end - m.q_begin;
    for (int s = 0; s < m.num_splits; ++s) {
      EXPECT_EQ((written[{m.request, m.kv_head, s * kSplitKeys}]), m.first_partial_token + s * q_len);
    }
  }
}

// A bf16 decoder layer over an HND cache (one KV head's rows adjacent).
AttentionParams layer(DType kv, int head_size) {
  AttentionParams p;
  p.num_heads = 32;
  p.num_kv_heads = 8;
  p.head_size = head_size;
  p.query.dtype = DType::BF16;
  p.kv_dtype = kv;
  p.key_cache.slot_stride = head_size;
  p.value_cache.slot_stride = head_size;
  return p;
}

ItemKernel decode(DecodeTiles tiles) { return {ItemAlgorithm::kDecode, tiles}; }
ItemKernel tiles(TileScores scores, TilePv pv) { return {ItemAlgorithm::kTiles, DecodeTiles::kChunks, scores, pv}; }

TEST(CpuAttnPlanTest, VariantNamesTheIsasKernels) {
  const KernelVariant bf16 = choose_kernel_variant(layer(DType::BF16, 128), Isa::Avx512Bf16);
  EXPECT_EQ(bf16.width, VectorWidth::kFull);
  EXPECT_EQ(bf16.for_rows(4), decode(DecodeTiles::kBf16Dot));
  EXPECT_EQ(bf16.for_rows(16), tiles(TileScores::kTransposedBf16, TilePv::kBf16));
  EXPECT_TRUE(bf16.decode.far_stream);
  EXPECT_TRUE(bf16.decode.near_into_l2);  // 32 KiB units
  EXPECT_FALSE(bf16.decode.staged);

  const KernelVariant fp8 = choose_kernel_variant(layer(DType::FP8_E4M3, 128), Isa::Avx512Bf16);
  EXPECT_EQ(fp8.for_rows(1), decode(DecodeTiles::kBf16Dot));
  EXPECT_EQ(fp8.for_rows(32).scores, TileScores::kTransposed);
  EXPECT_TRUE(fp8.decode.near_into_l2);  // two 16 KiB units fill L1
  EXPECT_FALSE(choose_kernel_variant(layer(DType::FP8_E4M3, 64), Isa::Avx512Bf16).decode.near_into_l2);
  EXPECT_FALSE(fp8.decode.packed_key_scores);
  AttentionParams packed = layer(DType::FP8_E4M3, 128);
  packed.key_cache.packing = KeyPacking::Keys16;
  EXPECT_TRUE(choose_kernel_variant(packed, Isa::Avx512Bf16).decode.packed_key_scores);
  EXPECT_FALSE(choose_kernel_variant(packed, Isa::Avx512).decode.packed_key_scores);

  const KernelVariant avx2 = choose_kernel_variant(layer(DType::FP8_E4M3, 128), Isa::Avx2);
  EXPECT_EQ(avx2.for_rows(2), decode(DecodeTiles::kChunks));
  EXPECT_EQ(avx2.for_rows(8), decode(DecodeTiles::kChunkQuads));
  EXPECT_EQ(avx2.for_rows(64).pv, TilePv::kConvertedWide);
  EXPECT_FALSE(avx2.decode.far_stream);  // 1-byte K/V
  EXPECT_EQ(choose_kernel_variant(layer(DType::F16, 128), Isa::Avx512).for_rows(8), decode(DecodeTiles::kChunks));
}

// Head sizes the chunks or the wide P V block do not divide take the tile
// loop's other kernels; 8-lane vectors where the full width does not divide.
TEST(CpuAttnPlanTest, VariantFollowsTheHeadSize) {
  const KernelVariant d80 = choose_kernel_variant(layer(DType::BF16, 80), Isa::Avx512Bf16);
  EXPECT_EQ(d80.width, VectorWidth::kFull);
  EXPECT_EQ(d80.for_rows(1), tiles(TileScores::kRowwise, TilePv::kRows));
  EXPECT_EQ(d80.for_rows(16), tiles(TileScores::kTransposed, TilePv::kConverted));
  const KernelVariant d40 = choose_kernel_variant(layer(DType::F32, 40), Isa::Avx512);
  EXPECT_EQ(d40.width, VectorWidth::kEight);
  // 96: the bf16 scores, but neither the bf16 P V nor the wide block (128 each)
  const KernelVariant d96 = choose_kernel_variant(layer(DType::BF16, 96), Isa::Avx512Bf16);
  EXPECT_EQ(d96.for_rows(20), tiles(TileScores::kTransposedBf16, TilePv::kConverted));
  AttentionParams nhd = layer(DType::BF16, 128);
  nhd.key_cache.slot_stride = nhd.value_cache.slot_stride = 8 * 128;
  EXPECT_TRUE(choose_kernel_variant(nhd, Isa::Avx2).decode.staged);
}

TEST(CpuAttnPlanTest, WorkspaceHoldsTheSplitPartials) {
  Batch b;
  b.add(1, 5000);
  b.add(20, 20);
  const WorkList plan = b.plan(2);
  const WorkspaceSize size = plan_workspace(plan, 64, 4, 3);
  EXPECT_EQ(size.thread_slots, 3);
  EXPECT_EQ(size.partial_floats, static_cast<std::size_t>(plan.partial_tokens) * 4 * partial_row_floats(64));
  EXPECT_EQ(size.scratch_bytes, scratch_bytes(64, kQueryTileTokens * 4, plan.max_item_kv_heads));
  EXPECT_TRUE(size.holds(plan_workspace(plan, 64, 2, 1)));
  EXPECT_FALSE(size.holds(plan_workspace(plan, 64, 8, 1)));
}

}  // namespace
}  // namespace pagedattn::cpu_attn
