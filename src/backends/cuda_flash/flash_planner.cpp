#include "flash_planner.h"

#include <algorithm>

namespace pagedattn::cuda_flash {
namespace {

std::size_t align_up(std::size_t x) {
  const auto a = static_cast<std::size_t>(kWorkspaceAlign);
  return (x + a - 1) / a * a;
}

int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace

int prefill_tokens_per_item(int group) { return std::max(1, kPrefillRows / std::max(group, 1)); }

// How full the last wave of `ctas` CTAs on `slots` slots is, as a fraction of
// all the waves' slots (1 = whole waves).
double wave_fill(std::int64_t ctas, std::int64_t slots) {
  const std::int64_t waves = (ctas + slots - 1) / slots;
  return static_cast<double>(ctas) / static_cast<double>(waves * slots);
}

int choose_num_splits(std::int64_t base_ctas, int kv_len, int num_sms, int ctas_per_sm) {
  const std::int64_t slots = static_cast<std::int64_t>(std::max(num_sms, 1)) * std::max(ctas_per_sm, 1);
  if (base_ctas <= 0 || kv_len <= kMinKeysPerSplit) return 1;
  if (base_ctas >= slots) {
    // More than a wave: split only to fill the last wave (512 equal decode
    // items on 396 slots leave a 0.3-wave tail; three splits each make 3.9
    // waves), when that fills it by kMinWaveFillGain more.
    int best = 1;
    double best_fill = wave_fill(base_ctas, slots);
    for (int s = 2; s <= kMaxWaveFillSplits && kv_len >= s * kMinKeysPerSplit; ++s) {
      const double fill = wave_fill(base_ctas * s, slots);
      if (fill > best_fill + kMinWaveFillGain) {
        best = s;
        best_fill = fill;
      }
    }
    return best;
  }
  // Rounded down: one full wave of CTAs, not a wave and a sliver.
  const auto by_fill = static_cast<int>(slots / base_ctas);
  const int by_keys = ceil_div(kv_len, kMinKeysPerSplit);
  return std::clamp(std::min(by_fill, by_keys), 1, kMaxSplits);
}

std::int64_t item_cost(const WorkItem& w, int group, bool causal) {
  const std::int64_t query_end = static_cast<std::int64_t>(w.position_begin) + w.num_tokens;
  const std::int64_t visible_end = causal ? std::min<std::int64_t>(w.kv_end, query_end) : w.kv_end;
  const std::int64_t keys = std::max<std::int64_t>(visible_end - w.kv_begin, 0);
  return keys * (static_cast<std::int64_t>(w.num_tokens) * group + kKeyReadRows);
}

int invariant_num_splits(int kv_len) {
  return std::clamp(ceil_div(std::max(kv_len, 0), kInvariantSplitKeys), 1, kMaxSplits);
}

WorkList make_work_list(const PlanInputs& in) {
  WorkList plan;
  plan.batch_invariant = in.batch_invariant;
  const auto num_reqs = static_cast<int>(in.seq_lens.size());
  struct Tile {
    int req, token_begin, num_tokens, position_begin, kv_len, mode;
  };
  std::vector<Tile> tiles;
  const int per_item = prefill_tokens_per_item(in.group);
  for (int r = 0; r < num_reqs; ++r) {
    const int q_begin = in.query_start_loc[static_cast<std::size_t>(r)];
    const int q_len = in.query_start_loc[static_cast<std::size_t>(r) + 1] - q_begin;
    const int seq_len = in.seq_lens[static_cast<std::size_t>(r)];
    if (q_len <= 0) continue;
    const int context = seq_len - q_len;
    if (q_len <= kDecodeMaxTokens) {
      tiles.push_back({r, q_begin, q_len, context, seq_len, static_cast<int>(TileMode::Decode)});
      continue;
    }
    for (int t = 0; t < q_len; t += per_item) {
      const int n = std::min(per_item, q_len - t);
      tiles.push_back({r, q_begin + t, n, context + t, seq_len, static_cast<int>(TileMode::Prefill)});
    }
  }
  const std::int64_t base_ctas = static_cast<std::int64_t>(tiles.size()) * std::max(in.num_kv_heads, 1);
  plan.decode_only = std::all_of(tiles.begin(), tiles.end(),
                                 [](const Tile& t) { return t.mode == static_cast<int>(TileMode::Decode); });
  plan.prefill_only = !tiles.empty() && std::none_of(tiles.begin(), tiles.end(), [](const Tile& t) {
    return t.mode == static_cast<int>(TileMode::Decode);
  });
  // Splits aim at the occupancy of the kernel the step will run. The planner
  // knows neither the cache dtype nor the device: prefill-only steps aim at
  // the mixed kernel's even where the wgmma kernel runs (docs/cuda_flash.md).
  const bool decode_only_kernel =
      choose_kernel(head_size_class(in.head_size), false, plan.decode_only, plan.prefill_only, 0) ==
      KernelKind::DecodeOnly;
  const int ctas_per_sm = decode_only_kernel ? kDecodeOnlyCtasPerSm : kTargetCtasPerSm;

  for (const Tile& t : tiles) {
    const int kv_len = std::max(t.kv_len, 0);
    int splits = choose_num_splits(base_ctas, kv_len, in.num_sms, ctas_per_sm);
    if (in.batch_invariant) splits = t.mode == static_cast<int>(TileMode::Decode) ? invariant_num_splits(kv_len) : 1;
    // Tile-aligned chunks; the last split may be shorter.
    const int chunk = splits > 1 ? ceil_div(ceil_div(kv_len, splits), kBlockN) * kBlockN : kv_len;
    if (splits > 1) splits = ceil_div(kv_len, chunk);
    WorkItem w;
    w.req = t.req;
    w.token_begin = t.token_begin;
    w.num_tokens = t.num_tokens;
    w.position_begin = t.position_begin;
    w.mode = t.mode;
    // Dense K/V (encoder) rows of request r start at its first query row.
    w.kv_row_begin = in.query_start_loc[static_cast<std::size_t>(t.req)];
    w.num_splits = splits;
    if (splits == 1) {
      w.kv_begin = 0;
      w.kv_end = kv_len;
      plan.items.push_back(w);
      continue;
    }
    w.partial_index = static_cast<std::int32_t>(plan.partial_token_rows);
    for (int s = 0; s < splits; ++s) {
      w.split = s;
      w.kv_begin = s * chunk;
      w.kv_end = std::min(kv_len, (s + 1) * chunk);
      plan.items.push_back(w);
    }
    plan.combine.push_back({t.token_begin, t.num_tokens, splits, w.partial_index});
    plan.partial_token_rows += static_cast<std::int64_t>(splits) * t.num_tokens;
  }
  // Heaviest first: the hardware hands out CTAs in index order, and the
  // persistent kernels stride over the list, so the short items fill the tail.
  const int group = std::max(in.group, 1);
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const WorkItem& a, const WorkItem& b) {
    return item_cost(a, group, in.causal) > item_cost(b, group, in.causal);
  });
  return plan;
}

WorkspaceLayout workspace_layout(const WorkspaceEntries& n, int partial_heads, int head_size) {
  WorkspaceLayout l;
  l.items = align_up(sizeof(PlanHeader));
  l.combine = l.items + align_up(n.items * sizeof(WorkItem));
  l.mm_prefix_offsets = l.combine + align_up(n.combine * sizeof(CombineItem));
  l.mm_prefix_ranges = l.mm_prefix_offsets + align_up(n.mm_prefix_offsets * sizeof(std::int32_t));
  l.block_table = l.mm_prefix_ranges + align_up(n.mm_prefix_elems * sizeof(std::int32_t));
  l.upload_bytes = l.block_table + n.block_table * sizeof(std::int32_t);
  const auto rows = static_cast<std::size_t>(std::max<std::int64_t>(n.partial_token_rows, 0)) *
                    static_cast<std::size_t>(std::max(partial_heads, 0));
  l.partial_out = align_up(l.upload_bytes);
  l.partial_lse = l.partial_out + align_up(rows * static_cast<std::size_t>(head_size) * sizeof(float));
  l.total_bytes = l.partial_lse + align_up(rows * sizeof(float));
  return l;
}

}  // namespace pagedattn::cuda_flash
