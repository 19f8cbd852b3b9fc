// The Attention layer's use_mm_prefix (PrefixLM): the options it refuses,
// the metadata a layer without it refuses, and a step through
// ModelMetadataBuilder whose ranges widen exactly the rows inside them.
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/backend/registry.h>

#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

constexpr int kHeads = 4;
constexpr int kHeadSize = 16;
constexpr int kBlock = 4;
constexpr float kScale = 0.25f;
constexpr int kTokens = 8;
constexpr MmPrefixRange kRange{2, 6};

AttentionOptions mm_options(std::string prefix) {
  AttentionOptions o;
  o.cache_config = CacheConfig{.block_size = kBlock};
  o.attn_backend = BackendRegistry::instance().find("CPU_ATTN");
  o.prefix = std::move(prefix);
  o.use_mm_prefix = true;
  return o;
}

// One fresh 8-token prefill, with or without the range.
CommonAttentionMetadata step(bool ranged) {
  RequestSpec request{kTokens, kTokens, {0, 1}};
  if (ranged) request.mm_prefix_ranges = {kRange};
  return make_common_metadata(std::vector<RequestSpec>{request}, {.block_size = kBlock});
}

Tensor rows(float first, float step_size, int heads) {
  std::vector<float> v(static_cast<std::size_t>(kTokens * heads * kHeadSize));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = first + step_size * static_cast<float>(i % 29);
  return Tensor::from_floats(v, {kTokens, heads, kHeadSize}, DType::F32);
}

TEST(AttentionMmPrefix, RefusesLayersPrefixLmCannotApplyTo) {
  ModelContext model({.dtype = DType::F32});
  AttentionOptions encoder = mm_options("encoder");
  encoder.attn_type = AttentionType::EncoderOnly;
  test::expect_invalid([&] { Attention(model, kHeads, kHeadSize, kScale, encoder); }, "use_mm_prefix");
  AttentionOptions bidirectional = mm_options("bidirectional");
  bidirectional.use_non_causal = true;
  test::expect_invalid([&] { Attention(model, kHeads, kHeadSize, kScale, bidirectional); }, "use_mm_prefix");
  AttentionOptions chunked = mm_options("chunked");
  chunked.attention_chunk_size = 2 * kBlock;
  test::expect_invalid([&] { Attention(model, kHeads, kHeadSize, kScale, chunked); }, "attention_chunk_size");
}

TEST(AttentionMmPrefix, ALayerWithoutItRefusesAStepWithRanges) {
  ModelContext model({.dtype = DType::F32});
  AttentionOptions o = mm_options("plain");
  o.use_mm_prefix = false;
  Attention layer(model, kHeads, kHeadSize, kScale, o);
  EXPECT_FALSE(layer.use_mm_prefix());
  allocate_kv_caches(model, {.num_blocks = 4});
  ModelMetadataBuilder builder(model);
  const Tensor q = rows(0.1f, 0.01f, kHeads);
  ForwardContext context;
  context.layer_metadata = builder.build(step(true));
  ForwardContextScope scope(std::move(context));
  test::expect_invalid([&] { layer.forward(q, q, q); }, "mm_prefix_ranges");
}

TEST(AttentionMmPrefix, RangesWidenExactlyTheRowsInsideThem) {
  ModelContext model({.dtype = DType::F32});
  Attention layer(model, kHeads, kHeadSize, kScale, mm_options("mm"));
  EXPECT_TRUE(layer.use_mm_prefix());
  allocate_kv_caches(model, {.num_blocks = 4});
  ModelMetadataBuilder builder(model);
  const Tensor q = rows(0.3f, 0.05f, kHeads);
  const Tensor k = rows(-0.2f, 0.07f, kHeads);
  const Tensor v = rows(1.0f, -0.11f, kHeads);
  const auto run = [&](bool ranged) {
    ForwardContext context;
    context.layer_metadata = builder.build(step(ranged));
    ForwardContextScope scope(std::move(context));
    return to_float_vector(layer.forward(q, k, v));
  };
  const std::vector<float> causal = run(false);
  const std::vector<float> prefix_lm = run(true);
  const auto row = [](const std::vector<float>& out, int t) {
    const auto n = static_cast<std::ptrdiff_t>(kHeads * kHeadSize);
    return std::vector<float>(out.begin() + t * n, out.begin() + (t + 1) * n);
  };
  for (int t = 0; t < kTokens; ++t) {
    // Rows before the range's last one see keys past their diagonal.
    const bool widened = t >= kRange.start && t < kRange.end - 1;
    EXPECT_EQ(row(causal, t) != row(prefix_lm, t), widened) << "token " << t;
  }
}

}  // namespace
}  // namespace pagedattn
