// BatchAttention: a planned step writes the step's keys at the plan's slots
// and attends like the REFERENCE backend, PrefixLM ranges included; bad
// plans and runs are rejected before anything is written.
#include <pagedattn/batch_attention.h>

#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "testing/expect_error.h"
#include "testing/normal_tensors.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 4;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 32;
constexpr int kBlockSize = 4;
constexpr std::int64_t kNumBlocks = 16;
constexpr float kTolerance = 1e-5f;

BatchAttentionOptions options(std::string backend) {
  BatchAttentionOptions o;
  o.num_heads = kHeads;
  o.num_kv_heads = kKvHeads;
  o.head_size = kHeadSize;
  o.dtype = DType::F32;
  o.block_size = kBlockSize;
  o.sliding_window = 6;
  o.logits_soft_cap = 20.0f;
  o.backend = std::move(backend);
  return o;
}

// Two requests: a 3-token prefill after 5 cached tokens and a 1-token decode after 8.
const std::vector<std::int32_t> kQueryStartLoc{0, 3, 4};
const std::vector<std::int32_t> kSeqLens{8, 9};
const std::vector<std::int32_t> kBlockTable{5, 2, 0, 7, 9, 11};  // [2, 3]
constexpr std::int64_t kStride = 3;
constexpr int kTokens = 4;
// PrefixLM ranges, CSR: request 0's [4, 8) starts in its context and holds
// its three queries (positions 5..7 see up to key 7); request 1's [2, 5)
// ends before its decode, which stays plain causal.
const std::vector<std::int32_t> kRangeStartLoc{0, 1, 2};
const std::vector<std::int32_t> kRanges{4, 8, 2, 5};

struct Ranges {
  std::span<const std::int32_t> start_loc;
  std::span<const std::int32_t> ranges;
};

struct StepResult {
  Tensor out;
  Tensor key_cache;
};

// Runs `attn`'s last plan on a cache and step drawn from `seed`.
StepResult run_planned(BatchAttention& attn, std::uint32_t seed) {
  test::NormalTensors random(seed);
  Tensor key_cache = random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, DType::F32);
  Tensor value_cache = random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, DType::F32);
  const Tensor q = random({kTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor k = random({kTokens, kKvHeads, kHeadSize}, DType::F32);
  const Tensor v = random({kTokens, kKvHeads, kHeadSize}, DType::F32);
  Tensor out = Tensor::zeros({kTokens, kHeads, kHeadSize}, DType::F32);
  attn.run(q, k, v, {key_cache, value_cache}, out);
  return {out, key_cache};
}

StepResult run_step(const BatchAttentionOptions& o, std::uint32_t seed, Ranges ranges = {}) {
  BatchAttention attn(o);
  attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride, ranges.start_loc, ranges.ranges);
  return run_planned(attn, seed);
}

void expect_near(const Tensor& got_tensor, const Tensor& want_tensor) {
  const std::vector<float> want = to_float_vector(want_tensor);
  const std::vector<float> got = to_float_vector(got_tensor);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], kTolerance) << i;
}

BatchAttentionOptions mm_prefix_options(std::string backend) {
  BatchAttentionOptions o = options(std::move(backend));
  o.use_mm_prefix = true;
  return o;
}

TEST(BatchAttentionTest, CpuAttnMatchesReferenceAndWritesTheStepsKeysAtThePlansSlots) {
  const StepResult ref = run_step(options("REFERENCE"), 3);
  const StepResult cpu = run_step(options("CPU_ATTN"), 3);
  expect_near(cpu.out, ref.out);
  // Token 0 of request 0 sits at position 5: block 2 (row entry 1), offset 1.
  test::NormalTensors random(3);  // the step's stream again, up to its keys
  random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, DType::F32);
  random({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, DType::F32);
  random({kTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor k = random({kTokens, kKvHeads, kHeadSize}, DType::F32);
  EXPECT_EQ(to_float_vector(cpu.key_cache.select(0, 2).select(0, 1)), to_float_vector(k.select(0, 0)));
  // The decode token (position 8) lands in block 11 (row entry 2), offset 0.
  EXPECT_EQ(to_float_vector(cpu.key_cache.select(0, 11).select(0, 0)), to_float_vector(k.select(0, 3)));
}

TEST(BatchAttentionTest, PrefixLmRangesMatchReferenceAndWidenOnlyTheQueriesInARange) {
  const Ranges ranges{kRangeStartLoc, kRanges};
  const StepResult ref = run_step(mm_prefix_options("REFERENCE"), 4, ranges);
  const StepResult cpu = run_step(mm_prefix_options("CPU_ATTN"), 4, ranges);
  expect_near(cpu.out, ref.out);
  const StepResult causal = run_step(options("CPU_ATTN"), 4);
  // Query 2 (position 7, the range's last key) and the decode see what causal shows them.
  expect_near(cpu.out.slice(0, 2, kTokens), causal.out.slice(0, 2, kTokens));
  const std::vector<float> widened = to_float_vector(cpu.out.select(0, 0));
  const std::vector<float> plain = to_float_vector(causal.out.select(0, 0));
  EXPECT_NE(widened, plain);  // position 5 sees keys 6 and 7 of its range
  // A use_mm_prefix wrapper planned without ranges is plain causal.
  expect_near(run_step(mm_prefix_options("CPU_ATTN"), 4).out, causal.out);
}

TEST(BatchAttentionTest, BadPrefixLmRangesAreRejected) {
  BatchAttention plain(options("CPU_ATTN"));
  test::expect_invalid(
      [&] { plain.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride, kRangeStartLoc, kRanges); },
      "mm_prefix_ranges must be none for a BatchAttention without use_mm_prefix");
  BatchAttention attn(mm_prefix_options("CPU_ATTN"));
  const std::vector<std::int32_t> past_the_sequence{4, 8, 2, 10};  // request 1 holds 9 tokens
  test::expect_invalid(
      [&] { attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride, kRangeStartLoc, past_the_sequence); },
      "mm_prefix_ranges[1] (request 1)");
  BatchAttentionOptions non_causal = mm_prefix_options("CPU_ATTN");
  non_causal.causal = false;
  test::expect_invalid([&] { BatchAttention unused(non_causal); }, "causal must be true with use_mm_prefix");
}

TEST(BatchAttentionTest, ReplansWithMoreRangesMatchReferenceAndABadPlanKeepsTheLastPlan) {
  constexpr std::uint32_t kSeed = 5;
  // No ranges, then one, then two: the wrapper's range arrays start empty and
  // grow twice. Request 0's [5, 7) widens position 5 to key 6 only, unlike
  // kRanges' [4, 8), so the last two plans' outputs differ.
  const std::vector<std::int32_t> no_range_start_loc{0, 0, 0};
  const std::vector<std::int32_t> one_range_start_loc{0, 1, 1};
  const std::vector<std::int32_t> one_range{5, 7};
  const Ranges plans[] = {
      {no_range_start_loc, {}}, {one_range_start_loc, one_range}, {kRangeStartLoc, kRanges}};
  BatchAttention attn(mm_prefix_options("CPU_ATTN"));
  std::vector<Tensor> outs;
  for (const Ranges& ranges : plans) {
    attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride, ranges.start_loc, ranges.ranges);
    outs.push_back(run_planned(attn, kSeed).out);
    expect_near(outs.back(), run_step(mm_prefix_options("REFERENCE"), kSeed, ranges).out);
  }
  EXPECT_NE(to_float_vector(outs[1]), to_float_vector(outs[2]));
  const std::vector<std::int32_t> past_the_sequence{4, 8, 2, 10};  // request 1 holds 9 tokens
  test::expect_invalid(
      [&] { attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride, kRangeStartLoc, past_the_sequence); },
      "mm_prefix_ranges[1] (request 1)");
  expect_near(run_planned(attn, kSeed).out, outs.back());
}

TEST(BatchAttentionTest, RunBeforePlanIsRejected) {
  BatchAttention attn(options("CPU_ATTN"));
  const Tensor q = Tensor::zeros({1, kHeads, kHeadSize}, DType::F32);
  const Tensor cache = Tensor::zeros({kNumBlocks, kBlockSize, kKvHeads, kHeadSize}, DType::F32);
  test::expect_invalid([&] { attn.run(q, {}, {}, {cache, cache}, q); }, "plan");
}

TEST(BatchAttentionTest, ABlockTableRowTooShortForItsSequenceIsRejected) {
  BatchAttention attn(options("CPU_ATTN"));
  const std::vector<std::int32_t> table{1, 2};  // [2, 1]: request 0 needs 2 blocks
  test::expect_invalid([&] { attn.plan(kQueryStartLoc, kSeqLens, table, 1); }, "block_table row 0 length");
}

TEST(BatchAttentionTest, AStepPastTheFixedCapacityIsRejected) {
  BatchAttentionOptions o = options("CPU_ATTN");
  o.max_num_reqs = 1;
  o.max_num_tokens = 4;
  o.max_blocks_per_req = 3;
  BatchAttention attn(o);
  test::expect_invalid([&] { attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride); }, "number of requests");
}

// A negative capacity is an error even when none is positive (found by
// fuzz_batch_attention: 0 / 0 / -1 built an unbounded wrapper).
TEST(BatchAttentionTest, NegativeFixedCapacitiesAreRejected) {
  for (const auto& [reqs, tokens, blocks, name] :
       {std::tuple{0, 0, -1, "max_blocks_per_req"}, std::tuple{-5, 0, 0, "max_num_reqs"},
        std::tuple{0, -1, 0, "max_num_tokens"}, std::tuple{1, 1, -1, "max_blocks_per_req"}}) {
    BatchAttentionOptions o = options("CPU_ATTN");
    o.max_num_reqs = reqs;
    o.max_num_tokens = tokens;
    o.max_blocks_per_req = blocks;
    test::expect_invalid([&] { BatchAttention unused(o); }, name);
  }
}

TEST(BatchAttentionTest, ABlockIdPastTheCacheIsRejectedBeforeTheCacheIsWritten) {
  BatchAttention attn(options("CPU_ATTN"));
  attn.plan(kQueryStartLoc, kSeqLens, kBlockTable, kStride);
  const Tensor q = Tensor::zeros({kTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor k = Tensor::from_floats(std::vector<float>(kTokens * kKvHeads * kHeadSize, 1.0f),
                                       {kTokens, kKvHeads, kHeadSize}, DType::F32);
  const Tensor small = Tensor::zeros({8, kBlockSize, kKvHeads, kHeadSize}, DType::F32);  // ids 9 and 11 are past it
  test::expect_invalid([&] { attn.run(q, k, k, {small, small}, q); }, "block");
  for (float x : to_float_vector(small)) ASSERT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace pagedattn
