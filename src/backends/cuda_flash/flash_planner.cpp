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

int launch_item_slots(int count, int num_kv_heads, int num_sms, int ctas_per_sm, bool capturing) {
  if (!capturing) return count;
  const std::int64_t wave = static_cast<std::int64_t>(std::max(num_sms, 1)) * std::max(ctas_per_sm, 1);
  return std::max(count, ceil_div(wave, std::max(num_kv_heads, 1)));
}

namespace {

// A run of one request's query tokens over its keys [kv_begin, kv_end),
// before splitting.
struct Tile {
  int req, token_begin, num_tokens, position_begin, kv_begin, kv_end;
  TileMode mode;
  int kv_row_begin;  // dense K/V (encoder): the request's first query row holds its key 0
  int keys() const { return std::max(kv_end - kv_begin, 0); }
};

// Each request's query tokens over its keys from keys_begin on: one decode
// tile for at most kDecodeMaxTokens tokens, prefill tiles of
// prefill_tokens_per_item(group) tokens otherwise.
void add_request_tiles(const PlanInputs& in, int keys_begin, std::vector<Tile>& tiles) {
  const int per_item = prefill_tokens_per_item(in.group);
  for (std::size_t r = 0; r < in.seq_lens.size(); ++r) {
    const int q_begin = in.query_start_loc[r];
    const int q_len = in.query_start_loc[r + 1] - q_begin;
    const int seq_len = in.seq_lens[r];
    if (q_len <= 0) continue;
    const int context = seq_len - q_len;
    const int req = static_cast<int>(r);
    if (q_len <= kDecodeMaxTokens) {
      tiles.push_back({req, q_begin, q_len, context, keys_begin, seq_len, TileMode::Decode, q_begin});
      continue;
    }
    for (int t = 0; t < q_len; t += per_item) {
      tiles.push_back({req, q_begin + t, std::min(per_item, q_len - t), context + t, keys_begin, seq_len,
                       TileMode::Prefill, q_begin});
    }
  }
}

// Sets the plan's step kind from its tiles and returns the resident CTAs per
// multiprocessor of the kernel the step will run, which the splits aim at.
// The planner knows neither the cache dtype nor the device: prefill-only
// steps aim at the mixed kernel's even where the wgmma kernel runs
// (docs/cuda_flash.md).
int set_step_kind(const std::vector<Tile>& tiles, int head_size, WorkList& plan) {
  const auto is_decode = [](const Tile& t) { return t.mode == TileMode::Decode; };
  plan.decode_only = std::all_of(tiles.begin(), tiles.end(), is_decode);
  plan.prefill_only = !tiles.empty() && std::none_of(tiles.begin(), tiles.end(), is_decode);
  const int head_class = head_size_class(head_size);
  const bool decode_only_kernel =
      choose_kernel(head_class, false, plan.decode_only, plan.prefill_only, 0) == KernelKind::DecodeOnly;
  return decode_only_kernel ? decode_only_ctas_per_sm(head_class) : kTargetCtasPerSm;
}

// Appends tile t's items: its keys in about `splits` chunks on the absolute
// tile grid (whole kBlockN tiles but the first and the last chunk). They
// write partials when there are several or `always_partial`; the returned
// split group says where (empty when they write the output).
PartialGroup add_items(const Tile& t, int splits, bool always_partial, WorkList& plan) {
  const int kv_end = std::max(t.kv_end, t.kv_begin);
  const int grid_begin = t.kv_begin - t.kv_begin % kBlockN;
  const int span = kv_end - grid_begin;
  int chunk = span;
  int count = 1;
  if (splits > 1) {
    chunk = ceil_div(ceil_div(span, splits), kBlockN) * kBlockN;
    count = ceil_div(span, chunk);
  }
  WorkItem w;
  w.req = t.req;
  w.token_begin = t.token_begin;
  w.num_tokens = t.num_tokens;
  w.position_begin = t.position_begin;
  w.mode = static_cast<int>(t.mode);
  w.kv_row_begin = t.kv_row_begin;
  w.num_splits = count;
  PartialGroup group;
  if (always_partial || count > 1) {
    w.writes_partial = 1;
    w.partial_index = static_cast<std::int32_t>(plan.partial_token_rows);
    group = {w.partial_index, count, t.num_tokens};
    plan.partial_token_rows += static_cast<std::int64_t>(count) * t.num_tokens;
  }
  for (int s = 0; s < count; ++s) {
    w.split = s;
    w.kv_begin = std::max(t.kv_begin, grid_begin + s * chunk);
    w.kv_end = std::min(kv_end, grid_begin + (s + 1) * chunk);
    plan.items.push_back(w);
  }
  return group;
}

// The hardware hands out CTAs in index order and the persistent kernels
// stride over the list, so the list runs heaviest first (item_cost) and the
// short items fill the tail: decode items first, then each prefill request's
// items, requests in batch order. A request's items stay together because
// they read the same keys: CTAs working on one request at a time keep its K/V
// in L2, where interleaving eight 4096-token requests (134 MB of K/V against
// a 50 MB L2) made 8q4k 15 % slower (docs/cuda_flash.md, "Plan, split-KV and
// CUDA graphs"). A mixed step's two kinds are then interleaved (interleave_kinds).
void sort_heaviest_first(WorkList& plan, const PlanInputs& in) {
  const int group = std::max(in.group, 1);
  const auto prefill = [](const WorkItem& w) { return w.mode == static_cast<int>(TileMode::Prefill); };
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const WorkItem& a, const WorkItem& b) {
    if (prefill(a) != prefill(b)) return prefill(b);
    if (prefill(a) && a.req != b.req) return a.req < b.req;
    return item_cost(a, group, in.causal) > item_cost(b, group, in.causal);
  });
}

// A mixed step's decode items (reading the cache) and prefill items (on the
// tensor cores) alternate through the list, each kind in sort_heaviest_first's
// order and the fewer spread evenly among the more: the CTAs resident on a
// multiprocessor then tend to be one of each kind, the decode's reads under
// the prefill's math. Decode items first ran two waves of reading before any
// prefill began: q2k_63q1s4k took 17 % longer on an H100
// (docs/perf-log/cuda_flash-issue-31.md). Takes the list as
// sort_heaviest_first leaves it: decode items first.
void interleave_kinds(WorkList& plan) {
  const std::vector<WorkItem> sorted = plan.items;
  const auto decodes = sorted.begin();
  const auto prefills = std::partition_point(decodes, sorted.end(), [](const WorkItem& w) {
    return w.mode == static_cast<int>(TileMode::Decode);
  });
  const std::int64_t nd = prefills - decodes;
  const std::int64_t np = sorted.end() - prefills;
  if (nd == 0 || np == 0) return;
  std::int64_t i = 0;
  std::int64_t j = 0;
  // Item k of a kind of n sits at (k + 1/2) / n of the list; ties go to decode.
  for (WorkItem& slot : plan.items) {
    const bool take_decode = j == np || (i < nd && (2 * i + 1) * np <= (2 * j + 1) * nd);
    slot = take_decode ? decodes[i++] : prefills[j++];
  }
}

// Splits of a cascade plan's tile cut into chunks of `chunk` keys.
int cascade_splits(const Tile& t, int chunk) { return std::clamp(ceil_div(t.keys(), chunk), 1, kMaxSplits); }

// The key chunk a cascade plan cuts its tiles into (both passes' tiles in one
// launch, of very different lengths): of the candidates kMinCascadeChunkKeys
// 2^k up to the longest tile, the one whose CTAs finish soonest when each
// costs its tile's largest piece (waves of `slots` CTAs times that piece),
// the largest of equals (fewer partials to merge). Keys stand for the cost:
// prefix and decode items run 16-row passes alike.
int cascade_chunk_keys(const std::vector<Tile>& tiles, int num_kv_heads, std::int64_t slots) {
  int longest = 0;
  for (const Tile& t : tiles) longest = std::max(longest, t.keys());
  int best_chunk = kMinCascadeChunkKeys;
  std::int64_t best_cost = -1;
  for (int chunk = kMinCascadeChunkKeys;; chunk *= 2) {
    std::int64_t ctas = 0;
    int piece = 0;
    for (const Tile& t : tiles) {
      const int splits = cascade_splits(t, chunk);
      ctas += static_cast<std::int64_t>(splits) * num_kv_heads;
      piece = std::max(piece, ceil_div(t.keys(), splits));
    }
    const std::int64_t cost = (ctas + slots - 1) / slots * piece;
    if (best_cost < 0 || cost <= best_cost) {
      best_cost = cost;
      best_chunk = chunk;
    }
    if (chunk >= longest) return best_chunk;
  }
}

// `group`'s partials of its tokens from `offset` on.
PartialGroup from_token(PartialGroup group, int offset) {
  group.first_row += offset;
  return group;
}

}  // namespace

WorkList make_work_list(const PlanInputs& in) {
  WorkList plan;
  plan.batch_invariant = in.batch_invariant;
  std::vector<Tile> tiles;
  add_request_tiles(in, 0, tiles);
  const int ctas_per_sm = set_step_kind(tiles, in.head_size, plan);
  const std::int64_t base_ctas = static_cast<std::int64_t>(tiles.size()) * std::max(in.num_kv_heads, 1);
  for (const Tile& t : tiles) {
    int splits = choose_num_splits(base_ctas, t.keys(), in.num_sms, ctas_per_sm);
    if (in.batch_invariant) splits = t.mode == TileMode::Decode ? invariant_num_splits(t.keys()) : 1;
    const PartialGroup group = add_items(t, splits, false, plan);
    if (group.num_splits > 0) plan.combine.push_back({t.token_begin, t.num_tokens, {group}});
  }
  sort_heaviest_first(plan, in);
  interleave_kinds(plan);
  return plan;
}

int cascade_prefix_tokens(int group) { return std::max(1, kDecodeRows / std::max(group, 1)); }

WorkList make_cascade_work_list(const PlanInputs& in, int prefix_len) {
  WorkList plan;
  std::vector<Tile> tiles;
  const int tokens = in.query_start_loc.empty() ? 0 : in.query_start_loc.back();
  const int per_prefix = cascade_prefix_tokens(in.group);
  std::size_t req = 0;
  for (int t = 0; t < tokens; t += per_prefix) {
    while (in.query_start_loc[req + 1] <= t) ++req;
    tiles.push_back({static_cast<int>(req), t, std::min(per_prefix, tokens - t), prefix_len, 0, prefix_len,
                     TileMode::Decode, in.query_start_loc[req]});
  }
  const std::size_t num_prefix = tiles.size();
  add_request_tiles(in, prefix_len, tiles);
  const std::int64_t slots =
      static_cast<std::int64_t>(std::max(in.num_sms, 1)) * set_step_kind(tiles, in.head_size, plan);
  const int chunk = cascade_chunk_keys(tiles, std::max(in.num_kv_heads, 1), slots);
  std::vector<PartialGroup> groups;
  for (const Tile& t : tiles) groups.push_back(add_items(t, cascade_splits(t, chunk), true, plan));
  // Suffix tiles lie in token order; each is cut where a prefix item ends.
  for (std::size_t i = num_prefix; i < tiles.size(); ++i) {
    const Tile& s = tiles[i];
    for (int t = s.token_begin; t < s.token_begin + s.num_tokens;) {
      const int p = t / per_prefix;
      const int end = std::min(s.token_begin + s.num_tokens, (p + 1) * per_prefix);
      plan.combine.push_back({t, end - t,
                              {from_token(groups[static_cast<std::size_t>(p)], t - p * per_prefix),
                               from_token(groups[i], t - s.token_begin)}});
      t = end;
    }
  }
  sort_heaviest_first(plan, in);
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
