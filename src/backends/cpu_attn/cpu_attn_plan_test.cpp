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
  WorkPlan plan(int kv_heads, bool causal = true, int min_items = 1) const {
    return make_work_plan(query_start_loc, seq_lens, kv_heads, causal, min_items);
  }
};

TEST(CpuAttnPlanTest, EveryQueryTileAndKeyIsCoveredOnce) {
  Batch b;
  b.add(1, 5000);   // long decode: split
  b.add(40, 40);    // prefill: three query tiles
  b.add(3, 100);    // short speculative step, not split (one chunk)
  b.add(0, 7);      // no queries: no work
  const int kv_heads = 2;
  const WorkPlan plan = b.plan(kv_heads);
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
  const WorkPlan plan = b.plan(1);
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
  const WorkPlan plan = b.plan(1);
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
  const WorkPlan plan = b.plan(1);
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
  auto ranges = [](const WorkPlan& plan, int request) {
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
    const WorkPlan plan = b.plan(kv_heads, true, c.min_items);
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
  const WorkPlan plan = b.plan(kv_heads, true, 1);
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

}  // namespace
}  // namespace pagedattn::cpu_attn
