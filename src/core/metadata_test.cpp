// CommonAttentionMetadata building and validation, and the forward context.
#include <gtest/gtest.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/metadata.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

constexpr int kBlockSize = 4;

std::vector<std::int32_t> host_values(const TensorView& t) {
  std::vector<std::int32_t> out;
  for (float f : to_float_vector(t)) out.push_back(static_cast<std::int32_t>(f));
  return out;
}

std::vector<std::int64_t> slot_values(const TensorView& t) {
  std::vector<std::int64_t> out;
  const auto* p = static_cast<const std::int64_t*>(t.data());
  for (std::int64_t i = 0; i < t.size(0); ++i) out.push_back(p[i * t.stride(0)]);
  return out;
}

// A decode (context 6, one new token) and a prefill (5 new tokens) on
// permuted blocks.
std::vector<RequestSpec> mixed_batch() { return {RequestSpec{1, 7, {5, 2}}, RequestSpec{5, 5, {3, 0}}}; }

CommonAttentionMetadata mixed_metadata(int padded_slots = 0) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  options.num_padded_slots = padded_slots;
  return make_common_metadata(mixed_batch(), options);
}

std::int32_t* mutable_i32(const Tensor& t) { return t.data_as<std::int32_t>(); }

TEST(MetadataBuild, SlotMappingFollowsTheBlockTable) {
  const CommonAttentionMetadata md = mixed_metadata();
  EXPECT_EQ(md.num_reqs, 2);
  EXPECT_EQ(md.num_actual_tokens, 6);
  EXPECT_EQ(md.max_query_len, 5);
  EXPECT_EQ(md.max_seq_len, 7);
  EXPECT_TRUE(md.causal);
  EXPECT_EQ(md.block_size, kBlockSize);
  EXPECT_FALSE(md.encoder_seq_lens_cpu.has_value());
  EXPECT_EQ(host_values(md.query_start_loc), (std::vector<std::int32_t>{0, 1, 6}));
  EXPECT_EQ(host_values(md.seq_lens), (std::vector<std::int32_t>{7, 5}));
  EXPECT_EQ(host_values(md.block_table), (std::vector<std::int32_t>{5, 2, 3, 0}));
  // Request 0's only query token is position 6: block_table[0][1] * 4 + 2.
  // Request 1's positions 0..4: blocks 3 then 0.
  EXPECT_EQ(slot_values(md.slot_mapping), (std::vector<std::int64_t>{10, 12, 13, 14, 15, 0}));
  EXPECT_EQ(md.query_len(0), 1);
  EXPECT_EQ(md.context_len(0), 6);
  EXPECT_EQ(md.context_len(1), 0);
  EXPECT_EQ(md.block_table_host_row(1)[0], 3);
  EXPECT_NO_THROW(md.validate("test", 6));
}

TEST(MetadataBuild, ShortBlockListsArePaddedWithTheNullBlock) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  const std::vector<RequestSpec> requests{RequestSpec{1, 9, {7, 8, 9}}, RequestSpec{2, 2, {4}}};
  const CommonAttentionMetadata md = make_common_metadata(requests, options);
  EXPECT_EQ(md.block_table.shape(), (Dims{2, 3}));
  EXPECT_EQ(host_values(md.block_table), (std::vector<std::int32_t>{7, 8, 9, 4, kNullBlockId, kNullBlockId}));
}

TEST(MetadataBuild, PaddedSlotsAreNeverWritten) {
  const CommonAttentionMetadata md = mixed_metadata(3);
  EXPECT_EQ(md.num_actual_tokens, 6);
  const std::vector<std::int64_t> slots = slot_values(md.slot_mapping);
  ASSERT_EQ(slots.size(), 9u);
  for (std::size_t i = 6; i < 9; ++i) EXPECT_EQ(slots[i], kPadSlotId);
  EXPECT_NO_THROW(md.validate("test", 6));
}

TEST(MetadataBuild, SlotsForPositions) {
  const std::vector<std::int32_t> blocks{4, 1, 7};
  EXPECT_EQ(slots_for_positions(blocks, kBlockSize, 3, 3), (std::vector<std::int64_t>{19, 4, 5}));
  EXPECT_TRUE(slots_for_positions(blocks, kBlockSize, 12, 0).empty());
  expect_invalid([&] { slots_for_positions(blocks, kBlockSize, 10, 3); }, "slots_for_positions: blocks size");
  expect_invalid([&] { slots_for_positions(blocks, 0, 0, 1); }, "block_size must be > 0");
  expect_invalid([&] { slots_for_positions(blocks, kBlockSize, -1, 1); }, "first must be >= 0");
  expect_invalid([&] { slots_for_positions(blocks, kBlockSize, 0, -1); }, "count must be >= 0");
}

TEST(MetadataBuild, CrossAttentionAddressesEncoderTokens) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  // Decoder query lengths 3 and 1; encoder lengths 2 and 6.
  const std::vector<RequestSpec> requests{RequestSpec{3, 3, {9}}, RequestSpec{1, 4, {1, 6}}};
  const std::vector<int> encoder_lens{2, 6};
  const CommonAttentionMetadata first = make_cross_attention_metadata(requests, encoder_lens, true, options);
  EXPECT_FALSE(first.causal);
  EXPECT_EQ(first.num_actual_tokens, 4);
  EXPECT_EQ(first.max_query_len, 3);
  EXPECT_EQ(first.max_seq_len, 6);
  EXPECT_EQ(host_values(first.seq_lens), (std::vector<std::int32_t>{2, 6}));
  ASSERT_TRUE(first.encoder_seq_lens_cpu.has_value());
  EXPECT_EQ(host_values(*first.encoder_seq_lens_cpu), (std::vector<std::int32_t>{2, 6}));
  EXPECT_EQ(slot_values(first.slot_mapping), (std::vector<std::int64_t>{36, 37, 4, 5, 6, 7, 24, 25}));
  // Keys (2) fewer than queries (3) is valid for cross-attention.
  EXPECT_NO_THROW(first.validate("test", 10));

  const CommonAttentionMetadata later = make_cross_attention_metadata(requests, encoder_lens, false, options);
  EXPECT_EQ(later.slot_mapping.size(0), 0);
  EXPECT_NO_THROW(later.validate("test", 10));
}

TEST(MetadataBuild, BuildErrorsNameTheRequest) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  const auto build = [&](std::vector<RequestSpec> requests) { make_common_metadata(requests, options); };
  expect_invalid(
      [&] {
        build({{1, 1, {0}}, {1, 1, {1}}, {5, 3, {2}}});
      },
      "make_common_metadata: requests[2].seq_len must be >= query_len (5), got 3");
  expect_invalid([&] { build({{-1, 1, {0}}}); }, "requests[0].query_len must be >= 0, got -1");
  expect_invalid(
      [&] {
        build({{1, 9, {0, 1}}});
      },
      "requests[0].blocks size must be >= ceil(9 / block_size 4) = 3");
  expect_invalid([&] { build({{1, 1, {-3}}}); }, "requests[0].blocks[0] must be >= 0, got -3");
  expect_invalid([&] { build({}); }, "requests must be non-empty");
  options.block_size = 0;
  expect_invalid([&] { build({{1, 1, {0}}}); }, "options.block_size must be > 0");
  options.block_size = kBlockSize;
  options.num_padded_slots = -1;
  expect_invalid([&] { build({{1, 1, {0}}}); }, "options.num_padded_slots must be >= 0");
}

TEST(MetadataBuild, CrossBuildErrors) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  const std::vector<RequestSpec> requests{RequestSpec{1, 1, {0}}};
  const std::vector<int> two{1, 1};
  const std::vector<int> negative{-2};
  const std::vector<int> long_encoder{9};
  expect_invalid([&] { make_cross_attention_metadata(requests, two, true, options); },
                 "make_cross_attention_metadata: encoder_lens size must be requests size (1), got 2");
  expect_invalid([&] { make_cross_attention_metadata(requests, negative, true, options); },
                 "encoder_lens[0] must be >= 0, got -2");
  expect_invalid([&] { make_cross_attention_metadata(requests, long_encoder, true, options); },
                 "requests[0].blocks size must be >= ceil(9 / block_size 4) = 3, got 1");
}

constexpr int kIntMax = std::numeric_limits<int>::max();

// query_start_loc and num_actual_tokens are int32: a batch whose token count
// does not fit is rejected before anything is summed or allocated.
TEST(MetadataBuild, TokenTotalsBeyondInt32AreRejected) {
  constexpr int kBillion = 1'000'000'000;
  MetadataOptions options;
  options.block_size = kIntMax;  // one block covers any request
  const std::vector<RequestSpec> three(3, RequestSpec{kBillion, kBillion, {1}});
  const std::vector<int> encoder_lens(3, 4);
  expect_invalid([&] { make_cross_attention_metadata(three, encoder_lens, false, options); },
                 "make_cross_attention_metadata: total query tokens must be <= 2147483647, got 3000000000");
  expect_invalid([&] { make_common_metadata(three, options); },
                 "make_common_metadata: total query tokens must be <= 2147483647, got 3000000000");
  // Padding rows count too: the slot mapping's rows are token rows.
  const std::vector<RequestSpec> one{RequestSpec{1, 1, {1}}};
  options.num_padded_slots = kIntMax;
  expect_invalid(
      [&] { make_common_metadata(one, options); },
      "total slots (query tokens + options.num_padded_slots) must be <= 2147483647, got 2147483648");
  options.num_padded_slots = 0;
  // Encoder tokens written in the first cross-attention step.
  const std::vector<RequestSpec> two(2, RequestSpec{1, 1, {1}});
  const std::vector<int> long_encoders(2, kIntMax);
  expect_invalid(
      [&] { make_cross_attention_metadata(two, long_encoders, true, options); },
      "total slots (encoder tokens + options.num_padded_slots) must be <= 2147483647, got 4294967294");
}

TEST(MetadataBuild, SlotsForPositionsPastInt32AreRejected) {
  const std::vector<std::int32_t> blocks{1, 2};
  // Positions up to INT_MAX + 1 once wrapped the loop bound to a negative number.
  expect_invalid([&] { slots_for_positions(blocks, 1 << 30, kIntMax, 1); },
                 "first + count must be <= 2147483647, got 2147483648");
  EXPECT_EQ(slots_for_positions(blocks, 1 << 30, kIntMax - 1, 1),
            (std::vector<std::int64_t>{std::int64_t{2} * (1 << 30) + (1 << 30) - 2}));
}

TEST(MetadataValidate, HugeBlockCountsDoNotWrapTheSlotBound) {
  const CommonAttentionMetadata md = mixed_metadata();
  // num_blocks * block_size once overflowed int64 and rejected every slot.
  EXPECT_NO_THROW(md.validate("check", std::numeric_limits<std::int64_t>::max()));
  EXPECT_NO_THROW(md.validate("check", std::numeric_limits<std::int64_t>::max() / kBlockSize + 1));
}

// Each case corrupts one field of a valid batch; the message names it.
TEST(MetadataValidate, EveryErrorNamesTheField) {
  constexpr std::int64_t kNumBlocks = 6;
  const auto corrupt = [&](const std::function<void(CommonAttentionMetadata&)>& edit,
                           const std::string& fragment) {
    CommonAttentionMetadata md = mixed_metadata();
    edit(md);
    expect_invalid([&] { md.validate("check", kNumBlocks); }, fragment);
  };
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.query_start_loc_cpu)[0] = 1; },
          "check: query_start_loc[0] must be 0, got 1");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.query_start_loc_cpu)[1] = 7; },
          "query_start_loc[2] must be >= query_start_loc[1] (7), got 6");
  corrupt([](CommonAttentionMetadata& md) { md.num_actual_tokens = 5; },
          "num_actual_tokens must be query_start_loc[2] (6), got 5");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.seq_lens_cpu)[1] = 4; },
          "seq_lens[1] must be >= query_len (5), got 4");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.seq_lens_cpu)[0] = -1; },
          "seq_lens[0] must be >= 0, got -1");
  corrupt([](CommonAttentionMetadata& md) { md.max_query_len = 4; },
          "max_query_len must be >= the largest query length (5), got 4");
  corrupt([](CommonAttentionMetadata& md) { md.max_seq_len = 6; },
          "max_seq_len must be >= the largest seq_len (7), got 6");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.block_table_cpu)[1] = 6; },
          "block_table[0][1] must be in [0, 6), got 6");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.block_table_cpu)[2] = -1; },
          "block_table[1][0] must be in [0, 6), got -1");
  corrupt([](CommonAttentionMetadata& md) { mutable_i32(md.seq_lens_cpu)[0] = 9; },
          "block_table row 0 width must be >= ceil(seq_len 9 / block_size 4) = 3, got 2");
  corrupt([](CommonAttentionMetadata& md) { md.slot_mapping.data_as<std::int64_t>()[3] = 24; },
          "slot_mapping[3] must be -1 or in [0, 24), got 24");
  corrupt([](CommonAttentionMetadata& md) { md.slot_mapping.data_as<std::int64_t>()[0] = -2; },
          "slot_mapping[0] must be -1 or in [0, 24), got -2");
  corrupt([](CommonAttentionMetadata& md) { md.slot_mapping = md.slot_mapping.slice(0, 0, 5); },
          "slot_mapping size must be >= num_actual_tokens (6), got 5");
  corrupt(
      [](CommonAttentionMetadata& md) {
        md.query_start_loc = Tensor::from_i64(std::vector<std::int64_t>{0, 1, 6}, {3});
      },
      "query_start_loc");
  corrupt(
      [](CommonAttentionMetadata& md) {
        md.seq_lens = Tensor::from_i32(std::vector<std::int32_t>{7, 5, 1}, {3});
      },
      "seq_lens");
  corrupt([](CommonAttentionMetadata& md) { md.block_table = md.block_table.view({4}); }, "block_table");
  corrupt(
      [](CommonAttentionMetadata& md) {
        md.slot_mapping = Tensor::from_i32(std::vector<std::int32_t>{0, 1, 2, 3, 4, 5}, {6});
      },
      "slot_mapping");
  corrupt(
      [](CommonAttentionMetadata& md) {
        md.seq_lens_cpu = Tensor::from_i32(std::vector<std::int32_t>{7}, {1});
      },
      "seq_lens_cpu");
  corrupt([](CommonAttentionMetadata& md) { md.block_table_cpu = md.block_table_cpu.slice(1, 0, 1); },
          "block_table_cpu shape");
  corrupt([](CommonAttentionMetadata& md) { md.query_start_loc_cpu = Tensor{}; },
          "query_start_loc_cpu must be a defined tensor");
  corrupt([](CommonAttentionMetadata& md) { md.num_reqs = 3; }, "query_start_loc");
  corrupt([](CommonAttentionMetadata& md) { md.block_size = 0; }, "block_size must be > 0, got 0");
  corrupt(
      [](CommonAttentionMetadata& md) {
        md.encoder_seq_lens_cpu = Tensor::from_i32(std::vector<std::int32_t>{7, 2}, {2});
      },
      "seq_lens[1] must be == encoder_seq_lens_cpu[1] (2), got 5");
}

TEST(MetadataValidate, BlockAndSlotRangesAreSkippedWithoutACache) {
  CommonAttentionMetadata md = mixed_metadata();
  mutable_i32(md.block_table_cpu)[0] = 1000;
  md.slot_mapping.data_as<std::int64_t>()[0] = 4000;
  EXPECT_NO_THROW(md.validate("check"));
  expect_invalid([&] { md.validate("check", 6); }, "block_table[0][0]");
}

// validate() records the extreme block ids and where they sit, so that a
// forward checks its cache in O(1) with the message validate would give.
TEST(MetadataValidate, FactsBoundTheBlockIdsForAnO1Check) {
  const CommonAttentionMetadata md = mixed_metadata();  // rows {5, 2}, {3, 0}
  const StepFacts facts = md.validate("check");
  ASSERT_TRUE(facts.lowest_block && facts.highest_block);
  EXPECT_EQ(facts.lowest_block->id, 0);
  EXPECT_EQ(facts.lowest_block->request, 1);
  EXPECT_EQ(facts.lowest_block->index, 1);
  EXPECT_EQ(facts.highest_block->id, 5);
  EXPECT_EQ(facts.first_seq_len_not_query_len, 0);
  EXPECT_NO_THROW(check_block_ids("check", facts, 6));
  expect_invalid([&] { check_block_ids("check", facts, 5); }, "block_table[0][0] must be in [0, 5), got 5");
  expect_invalid([&] { md.validate("check", 5); }, "block_table[0][0] must be in [0, 5), got 5");
}

TEST(MetadataValidate, OwnHostArraysAreCopies) {
  CommonAttentionMetadata md = mixed_metadata();
  const CommonAttentionMetadata own = md.with_own_host_arrays();
  mutable_i32(md.block_table_cpu)[0] = 1000;
  mutable_i32(md.seq_lens_cpu)[0] = 1;
  EXPECT_EQ(own.block_table_host_row(0)[0], 5);
  EXPECT_EQ(own.seq_len(0), 7);
  EXPECT_EQ(own.block_table.data(), own.block_table_cpu.data());  // one tensor on the CPU, as before
}

// ------------------------------------------------------------ ForwardContext

std::shared_ptr<const BackendMetadata> metadata_with_tokens(int tokens) {
  auto md = std::make_shared<BackendMetadata>();
  md->common.num_actual_tokens = tokens;
  return md;
}

TEST(ForwardContextTest, NoContextIsAnError) {
  EXPECT_FALSE(has_forward_context());
  expect_invalid([] { get_forward_context(); }, "no forward context is set");
}

TEST(ForwardContextTest, ScopesNestAndRestore) {
  ForwardContext outer;
  outer.metadata = metadata_with_tokens(1);
  outer.virtual_engine = 0;
  {
    ForwardContextScope outer_scope(outer);
    EXPECT_EQ(get_forward_context().virtual_engine, 0);
    {
      ForwardContext inner;
      inner.metadata = metadata_with_tokens(2);
      inner.virtual_engine = 1;
      ForwardContextScope inner_scope(inner);
      EXPECT_EQ(get_forward_context().virtual_engine, 1);
      EXPECT_EQ(get_forward_context().metadata_for("any").common.num_actual_tokens, 2);
      EXPECT_EQ(&get_forward_context(), &inner_scope.context());
    }
    EXPECT_EQ(get_forward_context().virtual_engine, 0);
    EXPECT_EQ(get_forward_context().metadata_for("any").common.num_actual_tokens, 1);
  }
  EXPECT_FALSE(has_forward_context());
}

TEST(ForwardContextTest, PerLayerMetadataWinsOverTheShared) {
  ForwardContext context;
  context.metadata = metadata_with_tokens(1);
  context.layer_metadata.emplace("layers.0.attn", metadata_with_tokens(7));
  EXPECT_EQ(context.metadata_for("layers.0.attn").common.num_actual_tokens, 7);
  EXPECT_EQ(context.metadata_for("layers.1.attn").common.num_actual_tokens, 1);
  context.metadata.reset();
  expect_invalid([&] { context.metadata_for("layers.1.attn"); },
                 "no attention metadata for layer 'layers.1.attn'");
}

TEST(ForwardContextTest, PerLayerSlotMappings) {
  ForwardContext context;
  context.slot_mappings.emplace("layers.0.attn", Tensor::from_i64(std::vector<std::int64_t>{3, -1}, {2}));
  const Tensor* slots = context.slot_mapping_for("layers.0.attn");
  ASSERT_NE(slots, nullptr);
  EXPECT_EQ(slots->size(0), 2);
  EXPECT_EQ(context.slot_mapping_for("layers.1.attn"), nullptr);
}

}  // namespace
}  // namespace pagedattn
