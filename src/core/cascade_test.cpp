// Cascade attention: the shared prefix found in the block tables, the step's
// two parts, a backend's own cascade plans, and cascade results against the
// plain plan's on the CPU backends (the same values up to the partial
// outputs' rounding).
#include <pagedattn/backend/registry.h>
#include <pagedattn/batch_attention.h>
#include <pagedattn/cascade.h>

#include <gtest/gtest.h>

#include <memory>
#include <utility>
#include <vector>

#include "testing/expect_error.h"
#include "testing/normal_tensors.h"

namespace pagedattn {
namespace {

std::vector<std::int32_t> ints(const Tensor& t) {
  const std::vector<float> f = to_float_vector(t);
  return {f.begin(), f.end()};
}

TEST(CascadeTest, TheSharedPrefixIsTheCommonLeadingBlocksBeforeEveryFirstQuery) {
  // Block size 4: request 1's context (9 tokens) holds 2 whole blocks, so only 2 count.
  const std::vector<RequestSpec> requests{{1, 20, {7, 8, 9, 1, 2}}, {2, 11, {7, 8, 9}}, {1, 17, {7, 8, 9, 4, 5}}};
  const CommonAttentionMetadata common = make_common_metadata(requests, {.block_size = 4});
  EXPECT_EQ(common_prefix_blocks(common), 2);
  const std::vector<RequestSpec> apart{{1, 20, {7, 8, 9, 1, 2}}, {1, 20, {6, 8, 9, 3, 4}}};
  EXPECT_EQ(common_prefix_blocks(make_common_metadata(apart, {.block_size = 4})), 0);
}

TEST(CascadeTest, TheStepSplitsIntoANonCausalPrefixPassAndACausalSuffixPass) {
  const std::vector<RequestSpec> requests{{3, 14, {7, 8, 9, 1}}, {5, 13, {7, 8, 9, 4}}};
  const CommonAttentionMetadata common = make_common_metadata(requests, {.block_size = 4});
  const CascadeSplit split = split_cascade(common, 2);  // an 8-token prefix
  // The 8 queries over the prefix as one request of 8 (at most prefix_len).
  EXPECT_EQ(ints(split.prefix.query_start_loc_cpu), (std::vector<std::int32_t>{0, 8}));
  EXPECT_EQ(ints(split.prefix.seq_lens_cpu), (std::vector<std::int32_t>{8}));
  EXPECT_EQ(ints(split.prefix.block_table_cpu), (std::vector<std::int32_t>{7, 8}));
  EXPECT_FALSE(split.prefix.causal);
  // Each request over its keys past the prefix.
  EXPECT_EQ(ints(split.suffix.query_start_loc_cpu), (std::vector<std::int32_t>{0, 3, 8}));
  EXPECT_EQ(ints(split.suffix.seq_lens_cpu), (std::vector<std::int32_t>{6, 5}));
  EXPECT_EQ(ints(split.suffix.block_table_cpu), (std::vector<std::int32_t>{9, 1, 9, 4}));
  EXPECT_TRUE(split.suffix.causal);
  split.prefix.validate("test");
  split.suffix.validate("test");
  test::expect_invalid([&] { split_cascade(common, 3); }, "prefix_blocks");
  // At most 3 queries per prefix request: 3 + 3 + 2.
  EXPECT_EQ(ints(split_cascade(common, 2, 3).prefix.query_start_loc_cpu), (std::vector<std::int32_t>{0, 3, 6, 8}));
}

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlock = 16;
constexpr int kPrefixBlocks = 20;  // 320 shared tokens
constexpr int kPrivateBlocks = 6;
constexpr int kRequests = 12;

struct Result {
  std::vector<float> out;
  std::vector<float> lse;
  bool cascade = false;
};

Result run(const std::string& backend, bool cascade, DType dtype) {
  test::NormalTensors normal(21);
  const auto random = [&](Dims shape) { return normal(shape, dtype); };
  const std::int64_t num_blocks = kPrefixBlocks + kRequests * kPrivateBlocks;
  const Tensor kc = random({num_blocks, kBlock, kKvHeads, kHeadSize});
  const Tensor vc = random({num_blocks, kBlock, kKvHeads, kHeadSize});
  std::vector<std::int32_t> qsl{0}, seq, table;
  for (int r = 0; r < kRequests; ++r) {
    const int q = r % 3 == 0 ? 9 : 1;  // decodes and short prefills
    qsl.push_back(qsl.back() + q);
    seq.push_back(kPrefixBlocks * kBlock + 17 * r % (kPrivateBlocks * kBlock - 8) + q);
    for (int b = 0; b < kPrefixBlocks; ++b) table.push_back(b);
    for (int b = 0; b < kPrivateBlocks; ++b) table.push_back(kPrefixBlocks + r * kPrivateBlocks + b);
  }
  const Tensor q = random({qsl.back(), kHeads, kHeadSize});
  Tensor out = Tensor::zeros({qsl.back(), kHeads, kHeadSize}, dtype);
  Tensor lse = Tensor::zeros({kHeads, qsl.back()}, DType::F32);
  BatchAttentionOptions o;
  o.num_heads = kHeads;
  o.num_kv_heads = kKvHeads;
  o.head_size = kHeadSize;
  o.dtype = dtype;
  o.block_size = kBlock;
  o.backend = backend;
  o.cascade = cascade;
  BatchAttention attn(o);
  attn.plan(qsl, seq, table, kPrefixBlocks + kPrivateBlocks);
  attn.run(q, {}, {}, {kc, vc}, out, lse);
  return {to_float_vector(out), to_float_vector(lse), attn.used_cascade()};
}

class CascadeResultTest : public ::testing::TestWithParam<std::tuple<std::string, DType>> {};

TEST_P(CascadeResultTest, MatchesThePlainPlan) {
  const auto [backend, dtype] = GetParam();
  const Result plain = run(backend, false, dtype);
  const Result cascade = run(backend, true, dtype);
  EXPECT_FALSE(plain.cascade);
  ASSERT_TRUE(cascade.cascade);
  // f32: reassociation only; bf16: the partial outputs' rounding, one bf16 step.
  const float tol = dtype == DType::F32 ? 2e-5f : 1e-2f;
  ASSERT_EQ(cascade.out.size(), plain.out.size());
  for (std::size_t i = 0; i < plain.out.size(); ++i) EXPECT_NEAR(cascade.out[i], plain.out[i], tol) << i;
  for (std::size_t i = 0; i < plain.lse.size(); ++i) EXPECT_NEAR(cascade.lse[i], plain.lse[i], 2e-5f) << i;
}

INSTANTIATE_TEST_SUITE_P(Backends, CascadeResultTest,
                         ::testing::Combine(::testing::Values("REFERENCE", "CPU_ATTN"),
                                            ::testing::Values(DType::F32, DType::BF16)));

// A backend with cascade plans of its own: REFERENCE's impl and plans; its
// builder's build_cascade records the prefix it was asked for and gives the
// step's plain plan when `native`, else none.
class NativeCascadeBuilder final : public AttentionMetadataBuilder {
 public:
  NativeCascadeBuilder(std::unique_ptr<AttentionMetadataBuilder> inner, bool native, int* asked)
      : inner_(std::move(inner)), native_(native), asked_(asked) {}
  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override {
    return inner_->build(common);
  }
  std::shared_ptr<const BackendMetadata> build_cascade(const CommonAttentionMetadata& common,
                                                       int prefix_blocks) override {
    *asked_ = prefix_blocks;
    return native_ ? inner_->build(common) : nullptr;
  }

 private:
  std::unique_ptr<AttentionMetadataBuilder> inner_;
  bool native_;
  int* asked_;
};

class NativeCascadeBackend final : public AttentionBackend {
 public:
  explicit NativeCascadeBackend(bool native)
      : reference_(*BackendRegistry::instance().find("REFERENCE")), native_(native) {}
  std::string_view name() const override { return "NATIVE_CASCADE"; }
  DeviceType device_type() const override { return DeviceType::CPU; }
  std::string_view description() const override { return "test backend"; }
  bool supports_non_causal() const override { return true; }
  bool can_return_lse() const override { return true; }
  ProblemSupport problem_support(const AttentionProblem& problem) const override {
    return reference_.problem_support(problem);
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return reference_.make_impl(params);
  }
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams& params) const override {
    return std::make_unique<NativeCascadeBuilder>(reference_.make_builder(params), native_, &asked);
  }

  mutable int asked = 0;

 private:
  const AttentionBackend& reference_;
  bool native_;
};

// CascadeBuilder takes the backend's own cascade plan in Native mode where it
// gives one, and plans the generic passes otherwise.
TEST(CascadeTest, TheBackendsOwnCascadePlanIsTakenUnlessGeneric) {
  std::vector<RequestSpec> requests;
  for (int r = 0; r < kRequests; ++r) {
    RequestSpec spec{1, kPrefixBlocks * kBlock + 5, {}};
    for (int b = 0; b < kPrefixBlocks; ++b) spec.blocks.push_back(b);
    spec.blocks.push_back(kPrefixBlocks + r);
    requests.push_back(std::move(spec));
  }
  const CommonAttentionMetadata common = make_common_metadata(requests, {.block_size = kBlock});
  for (const CascadeMode mode : {CascadeMode::Native, CascadeMode::Generic}) {
    for (const bool native : {true, false}) {
      const NativeCascadeBackend backend(native);
      CascadeBuilder builder(backend, {kBlock, kKvHeads, kHeadSize, Device::cpu(), {}, kHeads}, DType::F32, true,
                             mode);
      const std::shared_ptr<const BackendMetadata> md = builder.build(common);
      EXPECT_TRUE(builder.last_used_cascade());
      const bool own = mode == CascadeMode::Native && native;
      EXPECT_EQ(dynamic_cast<const CascadeMetadata*>(md.get()) == nullptr, own);
      EXPECT_EQ(backend.asked, mode == CascadeMode::Native ? kPrefixBlocks : 0);
    }
  }
}

TEST(CascadeTest, LayersWithAWindowOrSinksNeverPlanACascade) {
  AttentionImplParams params;
  params.attn_type = AttentionType::Decoder;
  EXPECT_TRUE(cascade_applies(params));
  params.sliding_window = 64;
  EXPECT_FALSE(cascade_applies(params));
  params.sliding_window.reset();
  params.sinks = {1.0f};
  EXPECT_FALSE(cascade_applies(params));
}

}  // namespace
}  // namespace pagedattn
