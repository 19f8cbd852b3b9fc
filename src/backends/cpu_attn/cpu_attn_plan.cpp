#include "backends/cpu_attn/cpu_attn_plan.h"

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

}  // namespace

WorkPlan make_work_plan(std::span<const std::int32_t> query_start_loc, std::span<const std::int32_t> seq_lens,
                        int num_kv_heads, bool causal) {
  WorkPlan plan;
  std::vector<std::int64_t> costs;
  const auto num_reqs = static_cast<int>(seq_lens.size());
  for (int r = 0; r < num_reqs; ++r) {
    const int q_len = query_start_loc[static_cast<std::size_t>(r) + 1] - query_start_loc[static_cast<std::size_t>(r)];
    const int keys = seq_lens[static_cast<std::size_t>(r)];
    if (q_len <= 0) continue;
    const int context_len = keys - q_len;
    const int splits = q_len <= kSplitMaxQueryTokens ? std::max(1, (keys + kSplitKeys - 1) / kSplitKeys) : 1;
    for (int h = 0; h < num_kv_heads; ++h) {
      if (splits == 1) {
        for (int q0 = 0; q0 < q_len; q0 += kQueryTileTokens) {
          const WorkItem item{r, h, q0, std::min(q_len, q0 + kQueryTileTokens), 0, keys, -1};
          plan.items.push_back(item);
          costs.push_back(item_cost(item, context_len, causal));
        }
        continue;
      }
      const MergeItem merge{r, h, 0, q_len, plan.partial_tokens, splits};
      for (int s = 0; s < splits; ++s) {
        const WorkItem item{r, h, 0, q_len, s * kSplitKeys, std::min(keys, (s + 1) * kSplitKeys),
                            plan.partial_tokens + static_cast<std::int64_t>(s) * q_len};
        plan.items.push_back(item);
        costs.push_back(item_cost(item, context_len, causal));
      }
      plan.merges.push_back(merge);
      plan.partial_tokens += static_cast<std::int64_t>(splits) * q_len;
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
