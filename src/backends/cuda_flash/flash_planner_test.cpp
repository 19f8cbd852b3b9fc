// The host planner of CUDA_FLASH (no GPU needed): item tiling, the split-KV
// choice, key coverage of every split group and the workspace layout.
#include "flash_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace pagedattn::cuda_flash {
namespace {

constexpr int kH200Sms = 132;  // and the H100 SXM

struct Batch {
  std::vector<std::int32_t> query_start_loc{0};
  std::vector<std::int32_t> seq_lens;
  Batch& add(int q_len, int seq_len, int count = 1) {
    for (int i = 0; i < count; ++i) {
      query_start_loc.push_back(query_start_loc.back() + q_len);
      seq_lens.push_back(seq_len);
    }
    return *this;
  }
};

WorkList plan(const Batch& b, int num_kv_heads = 8, int num_sms = kH200Sms, int group = 4) {
  return make_work_list({b.query_start_loc, b.seq_lens, num_kv_heads, num_sms, group});
}

// Every (request, token range) is covered by splits that tile [0, seq_len) exactly once.
void expect_exact_cover(const WorkList& p, const Batch& b) {
  std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> ranges;  // (req, token) -> [kv)
  for (const WorkItem& w : p.items) ranges[{w.req, w.token_begin}].push_back({w.kv_begin, w.kv_end});
  for (auto& [key, r] : ranges) {
    std::sort(r.begin(), r.end());
    EXPECT_EQ(r.front().first, 0);
    for (std::size_t i = 1; i < r.size(); ++i) EXPECT_EQ(r[i].first, r[i - 1].second);
    EXPECT_EQ(r.back().second, b.seq_lens[static_cast<std::size_t>(key.first)]);
  }
  std::int64_t tokens = 0;
  for (const auto& [key, r] : ranges) {
    const auto it = std::find_if(p.items.begin(), p.items.end(), [&](const WorkItem& w) {
      return w.req == key.first && w.token_begin == key.second;
    });
    tokens += it->num_tokens;
  }
  EXPECT_EQ(tokens, b.query_start_loc.back());
}

TEST(FlashPlannerTest, FullMachineDecodeIsNotSplit) {
  const Batch b = Batch().add(1, 4096, 64);  // 64q1s4k: 512 CTAs >= 2 per SM
  const WorkList p = plan(b);
  EXPECT_EQ(p.items.size(), 64u);
  EXPECT_TRUE(p.combine.empty());
  EXPECT_EQ(p.partial_token_rows, 0);
  for (const WorkItem& w : p.items) {
    EXPECT_EQ(w.mode, static_cast<int>(TileMode::Decode));
    EXPECT_EQ(w.num_splits, 1);
  }
  expect_exact_cover(p, b);
}

TEST(FlashPlannerTest, FewLongDecodesAreSplitToFillTheMachine) {
  const Batch b = Batch().add(1, 32768, 8);  // 8q1s32k: 64 CTAs unsplit
  const WorkList p = plan(b);
  ASSERT_EQ(p.combine.size(), 8u);
  const int splits = p.combine.front().groups[0].num_splits;
  EXPECT_EQ(splits, choose_num_splits(64, 32768, kH200Sms));
  // One full wave: at most one CTA per slot, and more than half the slots busy.
  const std::int64_t ctas = static_cast<std::int64_t>(p.items.size()) * 8;
  EXPECT_LE(ctas, kH200Sms * kTargetCtasPerSm);
  EXPECT_GT(2 * ctas, kH200Sms * kTargetCtasPerSm);
  EXPECT_EQ(p.partial_token_rows, 8 * splits);
  for (const WorkItem& w : p.items) EXPECT_EQ(w.kv_begin % kBlockN, 0);
  expect_exact_cover(p, b);
}

// Decode-only steps of the smaller head classes run the decode-only kernels,
// whose occupancy (decode_only_ctas_per_sm of the class) the splits fill.
TEST(FlashPlannerTest, DecodeOnlyStepsAimAtTheDecodeOnlyKernelsOccupancy) {
  const Batch decodes = Batch().add(1, 32768, 8);
  const auto with_head = [](const Batch& b, int head_size) {
    return make_work_list({b.query_start_loc, b.seq_lens, 8, kH200Sms, 4, head_size});
  };
  for (const int head_size : {64, 128}) {
    const WorkList w = with_head(decodes, head_size);
    EXPECT_TRUE(w.decode_only);
    EXPECT_EQ(w.combine.front().groups[0].num_splits,
              choose_num_splits(64, 32768, kH200Sms, decode_only_ctas_per_sm(head_size)));
    expect_exact_cover(w, decodes);
  }
  // Head size 64 fits more CTAs than the mixed kernels: more splits.
  EXPECT_GT(with_head(decodes, 64).combine.front().groups[0].num_splits, choose_num_splits(64, 32768, kH200Sms));
  const WorkList large = with_head(decodes, 256);  // no decode-only kernel for its class
  EXPECT_TRUE(large.decode_only);
  EXPECT_EQ(large.combine.front().groups[0].num_splits, choose_num_splits(64, 32768, kH200Sms));
  const WorkList mixed = with_head(Batch().add(1, 32768, 8).add(100, 100), 128);
  EXPECT_FALSE(mixed.decode_only);
}

// The step kind the plan reports picks the kernel: decode-only kernels for
// classes up to kDecodeOnlyMaxClass, the wgmma kernel for prefill-only steps
// of its class with 16-bit K/V on sm_90 only, the mixed kernel otherwise.
TEST(FlashPlannerTest, StepKindAndDeviceChooseTheKernel) {
  const WorkList prefill = plan(Batch().add(4096, 4096, 2));
  EXPECT_TRUE(prefill.prefill_only);
  EXPECT_FALSE(prefill.decode_only);
  const WorkList mixed = plan(Batch().add(4096, 4096).add(1, 500));
  EXPECT_FALSE(mixed.prefill_only);
  EXPECT_FALSE(mixed.decode_only);
  const WorkList empty = plan(Batch().add(0, 10));
  EXPECT_FALSE(empty.prefill_only);

  constexpr int kSm80 = 80;
  EXPECT_EQ(choose_kernel(128, false, false, true, kWgmmaSmVersion), KernelKind::WgmmaPrefill);
  EXPECT_EQ(choose_kernel(128, false, false, true, kSm80), KernelKind::Mixed);
  EXPECT_EQ(choose_kernel(128, true, false, true, kWgmmaSmVersion), KernelKind::Mixed);  // per-token-head K/V
  EXPECT_EQ(choose_kernel(64, false, false, true, kWgmmaSmVersion), KernelKind::WgmmaPrefill);
  EXPECT_EQ(choose_kernel(256, false, false, true, kWgmmaSmVersion), KernelKind::WgmmaPrefill);
  EXPECT_EQ(choose_kernel(128, false, false, false, kWgmmaSmVersion), KernelKind::Mixed);
  EXPECT_EQ(choose_kernel(128, false, true, false, kWgmmaSmVersion), KernelKind::DecodeOnly);
  EXPECT_EQ(choose_kernel(256, false, true, false, kWgmmaSmVersion), KernelKind::Mixed);
  // Batch-invariant plans: always the mixed kernel.
  EXPECT_EQ(choose_kernel(128, false, false, true, kWgmmaSmVersion, true), KernelKind::Mixed);
  EXPECT_EQ(choose_kernel(128, false, true, false, kWgmmaSmVersion, true), KernelKind::Mixed);
  // K/V rows that 16-byte copies cannot take (fp8, head size % 16 != 0 or
  // unaligned): the wide-fp8 classes' decode-only kernels are out.
  EXPECT_EQ(choose_kernel(128, false, true, false, kWgmmaSmVersion, false, false), KernelKind::Mixed);
  EXPECT_EQ(choose_kernel(64, false, true, false, kWgmmaSmVersion, false, false), KernelKind::DecodeOnly);
  EXPECT_EQ(choose_kernel(128, false, false, true, kWgmmaSmVersion, false, false), KernelKind::Mixed);
}

// A batch-invariant plan gives a request the same items alone and in a
// crowd: decode splits of kInvariantSplitKeys, prefill items unsplit.
TEST(FlashPlannerTest, BatchInvariantPlansSplitByTheRequestAlone) {
  const auto items_of = [](const WorkList& p, int req) {
    std::vector<std::tuple<int, int, int, int>> v;  // (tokens, kv_begin, kv_end, splits)
    for (const WorkItem& w : p.items) {
      if (w.req == req) v.emplace_back(w.num_tokens, w.kv_begin, w.kv_end, w.num_splits);
    }
    std::sort(v.begin(), v.end());
    return v;
  };
  const auto invariant = [](const Batch& b) {
    return make_work_list({b.query_start_loc, b.seq_lens, 8, kH200Sms, 4, 128, true});
  };
  const WorkList alone = invariant(Batch().add(1, 5000).add(300, 9000));
  const WorkList crowd = invariant(Batch().add(1, 5000).add(300, 9000).add(1, 700, 500));
  EXPECT_TRUE(alone.batch_invariant);
  for (const int req : {0, 1}) EXPECT_EQ(items_of(alone, req), items_of(crowd, req)) << "request " << req;
  EXPECT_EQ(invariant_num_splits(5000), 10);
  EXPECT_EQ(std::get<3>(items_of(alone, 0).front()), invariant_num_splits(5000));
  for (const auto& item : items_of(alone, 1)) EXPECT_EQ(std::get<3>(item), 1);
  EXPECT_EQ(invariant_num_splits(1), 1);
  EXPECT_EQ(invariant_num_splits(1 << 30), kMaxSplits);
  expect_exact_cover(alone, Batch().add(1, 5000).add(300, 9000));
}

TEST(FlashPlannerTest, SplitsKeepAMinimumLength) {
  EXPECT_EQ(choose_num_splits(8, 8192, kH200Sms), 8192 / kMinKeysPerSplit);
  EXPECT_EQ(choose_num_splits(8, kMinKeysPerSplit, kH200Sms), 1);
  EXPECT_EQ(choose_num_splits(1, 1 << 20, kH200Sms), kMaxSplits);
  EXPECT_EQ(choose_num_splits(kH200Sms * kTargetCtasPerSm, 1 << 20, kH200Sms), 1);
}

// Past one wave, splits only fill the last wave: 512 CTAs on 2 x 132 slots
// (1.94 waves) stay whole; on 3 x 132 (1.29 waves) three splits make 3.88.
TEST(FlashPlannerTest, MoreThanAWaveSplitsOnlyToFillTheLastWave) {
  EXPECT_EQ(choose_num_splits(512, 4096, kH200Sms, 2), 1);
  EXPECT_EQ(choose_num_splits(512, 4096, kH200Sms, 3), 3);
  EXPECT_EQ(choose_num_splits(512, 2 * kMinKeysPerSplit, kH200Sms, 3), 2);  // too short for three
  EXPECT_EQ(choose_num_splits(4 * kH200Sms * 3, 1 << 20, kH200Sms, 3), 1);  // whole waves already
}

TEST(FlashPlannerTest, PrefillTilesAndMixedBatches) {
  const Batch b = Batch().add(2048, 4096).add(1, 4096, 63);  // q2k_63q1s4k
  const WorkList p = plan(b);
  int prefill = 0;
  int decode = 0;
  for (const WorkItem& w : p.items) {
    if (w.mode == static_cast<int>(TileMode::Prefill)) {
      ++prefill;
      EXPECT_EQ(w.num_tokens, kPrefillRows / 4);
      EXPECT_EQ(w.position_begin, 2048 + (w.token_begin - 0));
    } else {
      ++decode;
      EXPECT_EQ(w.position_begin, 4095);
    }
  }
  EXPECT_EQ(prefill, 2048 / (kPrefillRows / 4));
  EXPECT_EQ(decode, 63);
  // Each kind heaviest first, the two kinds spread evenly through the list:
  // every prefix holds its share of decode items, to within one.
  const WorkItem* last[2] = {nullptr, nullptr};
  int decodes_so_far = 0;
  for (std::size_t i = 0; i < p.items.size(); ++i) {
    const WorkItem& w = p.items[i];
    const WorkItem*& previous = last[w.mode];
    if (previous != nullptr) {
      EXPECT_GE(item_cost(*previous, 4, true), item_cost(w, 4, true));
    }
    previous = &w;
    decodes_so_far += w.mode == static_cast<int>(TileMode::Decode) ? 1 : 0;
    const double share = static_cast<double>(i + 1) * decode / static_cast<double>(p.items.size());
    EXPECT_NEAR(decodes_so_far, share, 1.0) << "after item " << i;
  }
  expect_exact_cover(p, b);
}

// A causal prefill's late tiles see more keys than its early ones and go
// first; a decode over 4096 keys outweighs a prefill tile over a few hundred.
TEST(FlashPlannerTest, CausalCostOrdersTheWorkList) {
  WorkItem early;
  early.num_tokens = 32;
  early.position_begin = 0;
  early.kv_end = 4096;
  WorkItem late = early;
  late.position_begin = 4064;
  WorkItem decode;
  decode.num_tokens = 1;
  decode.position_begin = 4095;
  decode.kv_end = 4096;
  EXPECT_EQ(item_cost(early, 4, true), 32 * (32 * 4 + kKeyReadRows));
  EXPECT_EQ(item_cost(late, 4, true), 4096 * (32 * 4 + kKeyReadRows));
  EXPECT_EQ(item_cost(early, 4, false), item_cost(late, 4, false));
  EXPECT_GT(item_cost(decode, 4, true), item_cost(early, 4, true));
  const WorkList p = plan(Batch().add(4096, 4096));
  ASSERT_FALSE(p.items.empty());
  EXPECT_EQ(p.items.front().position_begin + p.items.front().num_tokens, 4096);
  EXPECT_EQ(p.items.back().position_begin, 0);
}

// A request's prefill items stay together (they share keys in L2), requests
// in batch order, each heaviest first.
TEST(FlashPlannerTest, PrefillRequestsStayTogether) {
  const WorkList p = plan(Batch().add(1024, 1024).add(1024, 1024).add(1024, 1024));
  ASSERT_FALSE(p.items.empty());
  for (std::size_t i = 1; i < p.items.size(); ++i) {
    const WorkItem& a = p.items[i - 1];
    const WorkItem& c = p.items[i];
    EXPECT_LE(a.req, c.req);
    if (a.req == c.req) {
      EXPECT_GE(item_cost(a, 4, true), item_cost(c, 4, true));
    }
  }
  EXPECT_EQ(p.items.front().req, 0);
  EXPECT_EQ(p.items.back().req, 2);
}

TEST(FlashPlannerTest, PrefillItemsHoldKPrefillRowsPackedRows) {
  EXPECT_EQ(prefill_tokens_per_item(1), kPrefillRows);
  EXPECT_EQ(prefill_tokens_per_item(4), kPrefillRows / 4);
  EXPECT_EQ(prefill_tokens_per_item(kPrefillRows * 2), 1);
  EXPECT_EQ(prefill_tokens_per_item(0), kPrefillRows);
  const int q_len = kPrefillRows - 3;  // one MHA item, several GQA items
  const Batch b = Batch().add(q_len, q_len);
  const WorkList mha = plan(b, 8, kH200Sms, 1);
  EXPECT_EQ(mha.items.size(), 1u);
  expect_exact_cover(mha, b);
  const WorkList gqa = plan(b, 8, kH200Sms, 8);
  const int per_item = kPrefillRows / 8;
  EXPECT_EQ(gqa.items.size(), static_cast<std::size_t>((q_len + per_item - 1) / per_item));
  expect_exact_cover(gqa, b);
}

TEST(FlashPlannerTest, EmptyRequestsAndShortTails) {
  const Batch b = Batch().add(0, 10).add(70, 70).add(3, 5);
  const WorkList p = plan(b, 2, 4);
  expect_exact_cover(p, b);
  for (const WorkItem& w : p.items) EXPECT_NE(w.req, 0);
  for (const WorkItem& w : p.items) EXPECT_EQ(w.kv_row_begin, b.query_start_loc[static_cast<std::size_t>(w.req)]);
}

WorkList cascade_plan(const Batch& b, int prefix_len, int num_sms = kH200Sms) {
  return make_cascade_work_list({b.query_start_loc, b.seq_lens, 8, num_sms, 4, 128}, prefix_len);
}

// A cascade plan: every item writes partials, each partial row once; prefix
// items see keys [0, prefix_len) from prefix_len on, suffix items the rest of
// their request at its own positions; and the combine list merges, for every
// token, partials whose keys tile its request's [0, seq_len) exactly once.
void expect_cascade_cover(const WorkList& p, const Batch& b, int prefix_len) {
  std::map<std::int64_t, std::pair<std::size_t, int>> writer;  // partial row -> (item, token)
  for (std::size_t i = 0; i < p.items.size(); ++i) {
    const WorkItem& w = p.items[i];
    EXPECT_EQ(w.writes_partial, 1);
    const auto r = static_cast<std::size_t>(w.req);
    if (w.kv_begin < prefix_len) {
      EXPECT_EQ(w.mode, static_cast<int>(TileMode::Decode));
      EXPECT_LE(w.kv_end, prefix_len);
      EXPECT_EQ(w.position_begin, prefix_len);
      EXPECT_GE(w.token_begin, b.query_start_loc[r]);
      EXPECT_LT(w.token_begin, b.query_start_loc[r + 1]);
    } else {
      EXPECT_EQ(w.position_begin, b.seq_lens[r] - (b.query_start_loc[r + 1] - w.token_begin));
      EXPECT_LE(w.token_begin + w.num_tokens, b.query_start_loc[r + 1]);
    }
    if (w.split > 0) {
      EXPECT_EQ(w.kv_begin % kBlockN, 0);  // chunks after the first start on the tile grid
    }
    for (int k = 0; k < w.num_tokens; ++k) {
      const std::int64_t row = w.partial_index + static_cast<std::int64_t>(w.split) * w.num_tokens + k;
      EXPECT_TRUE(writer.emplace(row, std::pair{i, w.token_begin + k}).second)
          << "row " << row << " written twice";
    }
  }
  EXPECT_EQ(static_cast<std::int64_t>(writer.size()), p.partial_token_rows);
  std::map<int, std::vector<std::pair<int, int>>> merged;  // token -> key ranges of its partials
  std::set<std::int64_t> read;
  for (const CombineItem& c : p.combine) {
    for (int k = 0; k < c.num_tokens; ++k) {
      for (const PartialGroup& g : c.groups) {
        for (int s = 0; s < g.num_splits; ++s) {
          const std::int64_t row = g.first_row + static_cast<std::int64_t>(s) * g.split_stride + k;
          const auto it = writer.find(row);
          ASSERT_NE(it, writer.end()) << "row " << row;
          EXPECT_EQ(it->second.second, c.token_begin + k);
          EXPECT_TRUE(read.insert(row).second) << "row " << row << " merged twice";
          const WorkItem& w = p.items[it->second.first];
          merged[c.token_begin + k].push_back({w.kv_begin, w.kv_end});
        }
      }
    }
  }
  EXPECT_EQ(read.size(), writer.size());
  for (std::size_t r = 0; r + 1 < b.query_start_loc.size(); ++r) {
    for (int token = b.query_start_loc[r]; token < b.query_start_loc[r + 1]; ++token) {
      std::vector<std::pair<int, int>>& keys = merged[token];
      ASSERT_FALSE(keys.empty()) << "token " << token;
      std::sort(keys.begin(), keys.end());
      EXPECT_EQ(keys.front().first, 0);
      for (std::size_t i = 1; i < keys.size(); ++i) EXPECT_EQ(keys[i].first, keys[i - 1].second);
      EXPECT_EQ(keys.back().second, b.seq_lens[r]);
    }
  }
}

// The issue-32 step: 64 decodes over a 4096-token prefix and 512 keys each.
// The chunk that finishes soonest is 512 keys: 16 prefix items of 4 tokens
// (4 query heads per KV head: 16 rows) in 8 splits and the 64 suffix items
// whole, 1536 CTAs on 3 x 132 slots (3.9 waves of 512 keys).
TEST(FlashPlannerTest, CascadePlanOfTheBenchmarkStep) {
  constexpr int kPrefix = 4096;
  const Batch b = Batch().add(1, kPrefix + 512, 64);
  const WorkList p = cascade_plan(b, kPrefix);
  EXPECT_TRUE(p.decode_only);
  EXPECT_FALSE(p.batch_invariant);
  EXPECT_EQ(cascade_prefix_tokens(4), 4);
  int prefix_items = 0;
  for (const WorkItem& w : p.items) {
    if (w.kv_begin >= kPrefix) {
      EXPECT_EQ(w.num_splits, 1);
      continue;
    }
    ++prefix_items;
    EXPECT_EQ(w.num_tokens, 4);
    EXPECT_EQ(w.num_splits, 8);
    EXPECT_EQ(w.kv_end - w.kv_begin, 512);
  }
  EXPECT_EQ(prefix_items, 16 * 8);
  EXPECT_EQ(p.items.size(), 16u * 8 + 64);
  ASSERT_EQ(p.combine.size(), 64u);
  EXPECT_EQ(p.partial_token_rows, 64 * 8 + 64);
  expect_cascade_cover(p, b, kPrefix);
}

// Few requests: one wave of the shortest chunks that fit one (on 132
// multiprocessors of two CTAs, 512 keys: 256-key chunks make 384 CTAs).
TEST(FlashPlannerTest, SmallCascadeStepsSplitToFillOneWave) {
  const Batch b = Batch().add(1, 4096 + 512, 8);
  const WorkList p = cascade_plan(b, 4096);
  for (const WorkItem& w : p.items) EXPECT_LE(w.kv_end - w.kv_begin, 2 * kMinCascadeChunkKeys);
  EXPECT_LE(static_cast<std::int64_t>(p.items.size()) * 8, kH200Sms * decode_only_ctas_per_sm(128));
  expect_cascade_cover(p, b, 4096);
}

// Speculative steps and prefill chunks in a cascade step: a suffix item of
// several tokens is merged in runs cut where prefix items end; a prefix not
// on the 64-key grid; requests without tokens.
TEST(FlashPlannerTest, CascadePlansOfMixedStepsMergeEveryTokenOnce) {
  constexpr int kPrefix = 272;  // 17 blocks of 16
  const Batch b = Batch().add(0, 400).add(1, 900, 5).add(3, 700).add(9, 1000).add(70, 2000).add(1, 300);
  const WorkList p = cascade_plan(b, kPrefix);
  EXPECT_FALSE(p.decode_only);
  EXPECT_FALSE(p.prefill_only);
  for (const WorkItem& w : p.items) EXPECT_NE(w.req, 0);
  expect_cascade_cover(p, b, kPrefix);
  const Batch few = Batch().add(0, 400).add(2, 300).add(70, 400);
  expect_cascade_cover(cascade_plan(few, kPrefix, 4), few, kPrefix);
}

TEST(FlashPlannerTest, CascadePrefixItemsFillOneDecodePass) {
  EXPECT_EQ(cascade_prefix_tokens(1), kDecodeRows);
  EXPECT_EQ(cascade_prefix_tokens(8), kDecodeRows / 8);
  EXPECT_EQ(cascade_prefix_tokens(kDecodeRows * 2), 1);
  EXPECT_EQ(cascade_prefix_tokens(0), kDecodeRows);
}

TEST(FlashPlannerTest, WorkspaceLayoutIsAlignedAndOrdered) {
  const WorkspaceLayout l = workspace_layout({10, 3, 6, 8, 77, 5}, 16, 128);
  for (const std::size_t off :
       {l.items, l.combine, l.mm_prefix_offsets, l.mm_prefix_ranges, l.block_table, l.partial_out, l.partial_lse}) {
    EXPECT_EQ(off % kWorkspaceAlign, 0u);
  }
  EXPECT_GE(l.combine, l.items + 10 * sizeof(WorkItem));
  EXPECT_GE(l.mm_prefix_offsets, l.combine + 3 * sizeof(CombineItem));
  EXPECT_GE(l.mm_prefix_ranges, l.mm_prefix_offsets + 6 * sizeof(std::int32_t));
  EXPECT_GE(l.block_table, l.mm_prefix_ranges + 8 * sizeof(std::int32_t));
  EXPECT_EQ(l.upload_bytes, l.block_table + 77 * sizeof(std::int32_t));
  EXPECT_GE(l.partial_lse, l.partial_out + 5 * 16 * 128 * sizeof(float));
  EXPECT_GE(l.total_bytes, l.partial_lse + 5 * 16 * sizeof(float));
}

// A capture records at least a wave of item slots (later plans of more items
// stride over them); outside a capture, the plan's own count.
TEST(FlashPlannerTest, CapturedLaunchesHoldAWave) {
  EXPECT_EQ(launch_item_slots(16, 8, kH200Sms, kCaptureCtasPerSm, false), 16);
  EXPECT_EQ(launch_item_slots(0, 8, kH200Sms, kCaptureCtasPerSm, false), 0);
  EXPECT_EQ(launch_item_slots(0, 8, kH200Sms, kCaptureCtasPerSm, true), 17);  // 136 CTAs of 8 heads
  EXPECT_EQ(launch_item_slots(16, 8, kH200Sms, kCaptureCtasPerSm, true), 17);
  EXPECT_EQ(launch_item_slots(512, 8, kH200Sms, kCaptureCtasPerSm, true), 512);
  EXPECT_EQ(launch_item_slots(1, 3, kH200Sms, kCaptureCtasPerSm, true), 44);  // 132 CTAs of 3 heads
  EXPECT_EQ(launch_item_slots(1, 8, kH200Sms, 2, true), 33);                  // a wave of two: 264 CTAs
}

}  // namespace
}  // namespace pagedattn::cuda_flash
