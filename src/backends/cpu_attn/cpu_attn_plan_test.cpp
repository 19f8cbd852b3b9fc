#include "backends/cpu_attn/cpu_attn_plan.h"

#include <gtest/gtest.h>

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
  WorkPlan plan(int kv_heads, bool causal = true) const { return make_work_plan(query_start_loc, seq_lens, kv_heads, causal); }
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
    for (int q = it.q_begin; q < it.q_end; ++q) keys_covered[{it.request, it.kv_head, q}] += it.k_end - it.k_begin;
  }
  for (int h = 0; h < kv_heads; ++h) {
    EXPECT_EQ((keys_covered[{0, h, 0}]), 5000);
    for (int q = 0; q < 40; ++q) EXPECT_EQ((keys_covered[{1, h, q}]), 40);
    for (int q = 0; q < 3; ++q) EXPECT_EQ((keys_covered[{2, h, q}]), 100);
  }
  EXPECT_EQ(keys_covered.size(), static_cast<std::size_t>(kv_heads * (1 + 40 + 3)));
  EXPECT_EQ(plan.max_item_tokens, kQueryTileTokens);
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
      if (it.request == request) out.insert({it.kv_head, it.q_begin, it.q_end, it.k_begin, it.k_end});
    }
    return out;
  };
  EXPECT_EQ(ranges(alone.plan(2), 0), ranges(mixed.plan(2), 1));
}

}  // namespace
}  // namespace pagedattn::cpu_attn
