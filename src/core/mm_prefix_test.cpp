// PrefixLM ranges of a step: building, validation, and the step transforms
// that refuse them.
#include <gtest/gtest.h>
#include <pagedattn/cascade.h>
#include <pagedattn/metadata.h>

#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

constexpr int kBlockSize = 4;

std::vector<std::int32_t> values(const Tensor& t) {
  const auto* p = t.data_as<const std::int32_t>();
  return {p, p + t.numel()};
}

// A prefill with two ranges, a decode without any, and a chunked prefill
// whose range crosses its context (positions 0..5) into its new tokens.
std::vector<RequestSpec> ranged_batch() {
  return {RequestSpec{10, 10, {1, 2, 3}, {{1, 4}, {6, 9}}}, RequestSpec{1, 7, {4, 5}},
          RequestSpec{4, 10, {6, 7, 8}, {{3, 8}}}};
}

CommonAttentionMetadata metadata(const std::vector<RequestSpec>& requests, bool causal = true) {
  MetadataOptions options;
  options.block_size = kBlockSize;
  options.causal = causal;
  return make_common_metadata(requests, options);
}

CommonAttentionMetadata plain_metadata() {
  std::vector<RequestSpec> requests = ranged_batch();
  for (RequestSpec& r : requests) r.mm_prefix_ranges.clear();
  return metadata(requests);
}

TEST(MmPrefixRanges, RequestRangesBecomeTheStepsCsrArrays) {
  const CommonAttentionMetadata md = metadata(ranged_batch());
  ASSERT_TRUE(md.has_mm_prefix_ranges());
  EXPECT_EQ(values(md.mm_prefix_range_start_loc_cpu), (std::vector<std::int32_t>{0, 2, 2, 3}));
  EXPECT_EQ(values(md.mm_prefix_ranges_cpu), (std::vector<std::int32_t>{1, 4, 6, 9, 3, 8}));
  EXPECT_EQ(md.mm_prefix_ranges_cpu.shape(), (Dims{3, 2}));
  EXPECT_EQ(values(md.mm_prefix_ranges), values(md.mm_prefix_ranges_cpu));
  const auto r0 = md.mm_prefix_ranges_host(0);
  EXPECT_EQ(std::vector<std::int32_t>(r0.begin(), r0.end()), (std::vector<std::int32_t>{1, 4, 6, 9}));
  EXPECT_TRUE(md.mm_prefix_ranges_host(1).empty());
  EXPECT_NO_THROW(md.validate("test"));
  // The plan's copy owns its arrays.
  const CommonAttentionMetadata copy = md.with_own_host_arrays();
  EXPECT_NE(copy.mm_prefix_ranges_cpu.data(), md.mm_prefix_ranges_cpu.data());
  EXPECT_EQ(values(copy.mm_prefix_ranges_cpu), values(md.mm_prefix_ranges_cpu));
}

TEST(MmPrefixRanges, StepsWithoutRangesHaveNone) {
  EXPECT_FALSE(plain_metadata().has_mm_prefix_ranges());
  EXPECT_TRUE(plain_metadata().mm_prefix_ranges_host(0).empty());
}

TEST(MmPrefixRanges, BadRequestRangesAreRejectedNamingTheRange) {
  const auto with = [](std::vector<MmPrefixRange> ranges) {
    std::vector<RequestSpec> requests = ranged_batch();
    requests[2].mm_prefix_ranges = std::move(ranges);
    return requests;
  };
  const std::string bad = "mm_prefix_ranges[2] (request 2)";
  expect_invalid([&] { metadata(with({{5, 3}})); }, bad);   // end before start
  expect_invalid([&] { metadata(with({{4, 4}})); }, bad);   // empty
  expect_invalid([&] { metadata(with({{-1, 3}})); }, bad);  // before the sequence
  expect_invalid([&] { metadata(with({{8, 11}})); }, bad);  // past seq_len 10
  expect_invalid(
      [&] {
        metadata(with({{0, 5}, {4, 8}}));
      },
      "mm_prefix_ranges[3] (request 2)");  // overlapping
  expect_invalid([&] { metadata(with({{6, 8}, {0, 5}})); }, "mm_prefix_ranges[3] (request 2)");  // unsorted
  expect_invalid([&] { metadata(with({{8, 11}})); }, "got [8, 11)");
  EXPECT_NO_THROW(metadata(with({{0, 5}, {5, 10}})));  // adjacent ranges are disjoint
}

TEST(MmPrefixRanges, OnlyCausalDecoderStepsTakeRanges) {
  expect_invalid([] { metadata(ranged_batch(), /*causal=*/false); }, "set only on causal steps");
  const std::vector<RequestSpec> requests = ranged_batch();
  const std::vector<int> encoder_lens{10, 7, 10};
  expect_invalid([&] { make_cross_attention_metadata(requests, encoder_lens, true, MetadataOptions{}); },
                 "requests[0].mm_prefix_ranges");
}

TEST(MmPrefixRanges, SetFromCsrArraysChecksOffsetsAndLeavesMetadataUnchangedOnError) {
  CommonAttentionMetadata md = plain_metadata();
  const std::vector<std::int32_t> ranges{0, 10, 8, 10};
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 1, 1}, ranges);
      },
      "mm_prefix_range_start_loc size must be 4");
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{1, 1, 1, 2}, ranges);
      },
      "mm_prefix_range_start_loc[0]");
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 2, 1, 2}, ranges);
      },
      "mm_prefix_range_start_loc[2]");
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 1, 1, 1}, ranges);
      },
      "the number of ranges (2)");
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 1, 1, 1}, std::vector<std::int32_t>{0});
      },
      "a multiple of 2");
  EXPECT_FALSE(md.has_mm_prefix_ranges());

  set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 1, 1, 2}, ranges);
  EXPECT_EQ(values(md.mm_prefix_ranges_cpu), ranges);
  // A failed replacement keeps the ranges set before.
  expect_invalid(
      [&] {
        set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 1, 1, 2},
                             std::vector<std::int32_t>{0, 11, 8, 10});
      },
      "mm_prefix_ranges[0] (request 0)");
  EXPECT_EQ(values(md.mm_prefix_ranges_cpu), ranges);
  // No ranges at all is a valid, empty set.
  set_mm_prefix_ranges(md, std::vector<std::int32_t>{0, 0, 0, 0}, {});
  EXPECT_EQ(md.mm_prefix_ranges_cpu.size(0), 0);
  EXPECT_NO_THROW(md.validate("test"));
}

TEST(MmPrefixRanges, ValidateWantsAllFourTensorsOfOneShape) {
  CommonAttentionMetadata md = metadata(ranged_batch());
  CommonAttentionMetadata host_only = md;
  host_only.mm_prefix_ranges = Tensor{};
  expect_invalid([&] { host_only.validate("test"); }, "mm_prefix_ranges must be a defined tensor");
  CommonAttentionMetadata mismatched = md;
  mismatched.mm_prefix_ranges = Tensor::from_i32(std::vector<std::int32_t>{1, 4}, {1, 2});
  expect_invalid([&] { mismatched.validate("test"); }, "mm_prefix_ranges shape");
  CommonAttentionMetadata wrong_width = md;
  wrong_width.mm_prefix_ranges_cpu = Tensor::from_i32(std::vector<std::int32_t>{1, 4, 6, 9, 3, 8}, {2, 3});
  expect_invalid([&] { wrong_width.validate("test"); }, "mm_prefix_ranges_cpu");
  CommonAttentionMetadata noncausal = md;
  noncausal.causal = false;
  expect_invalid([&] { noncausal.validate("test"); }, "set only on causal steps");
}

TEST(MmPrefixRanges, TransformsThatCannotCarryRangesRefuseThem) {
  const CommonAttentionMetadata md = metadata(ranged_batch());
  expect_invalid([&] { make_local_attention_virtual_batches(md, 2 * kBlockSize); },
                 "metadata mm_prefix_ranges");
  expect_invalid([&] { split_cascade(md, 1); }, "metadata mm_prefix_ranges");
  EXPECT_FALSE(cascade_pays(md, 1 << 20));
  AttentionImplParams params;
  params.use_mm_prefix = true;
  EXPECT_FALSE(cascade_applies(params));
}

}  // namespace
}  // namespace pagedattn
