#include "backends/reference/reference_backend.h"

#include <gtest/gtest.h>
#include <pagedattn/backend/impl_checks.h>
#include <pagedattn/metadata.h>

#include <cmath>
#include <limits>

#include "testing/normal_tensors.h"

namespace pagedattn {
namespace {

const ReferenceBackend kBackend;

template <typename F>
void expect_error(F&& f, ErrorKind kind, std::string_view fragment) {
  try {
    f();
    ADD_FAILURE() << "expected an Error mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    EXPECT_NE(std::string_view(e.what()).find(fragment), std::string_view::npos) << e.what();
  }
}

TEST(ReferenceBackendTest, Capabilities) {
  EXPECT_EQ(kBackend.name(), "REFERENCE");
  EXPECT_EQ(kBackend.device_type(), DeviceType::CPU);
  EXPECT_EQ(kBackend.description(), "scalar fp64 oracle backend; selected only when asked");
  EXPECT_EQ(kBackend.supported_dtypes(), (std::vector<DType>{DType::F32, DType::F16, DType::BF16}));
  EXPECT_EQ(kBackend.supported_kv_cache_dtypes(), all_cache_dtypes());
  EXPECT_TRUE(kBackend.supported_head_sizes().empty());
  ASSERT_EQ(kBackend.supported_kernel_block_sizes().size(), 1u);
  EXPECT_EQ(std::get<MultipleOf>(kBackend.supported_kernel_block_sizes()[0]).base, 1);
  for (const AttentionType t : {AttentionType::Decoder, AttentionType::Encoder, AttentionType::EncoderOnly,
                                AttentionType::EncoderDecoder}) {
    EXPECT_TRUE(kBackend.supports_attn_type(t));
  }
  EXPECT_TRUE(kBackend.supports_sink());
  EXPECT_TRUE(kBackend.supports_mm_prefix());
  EXPECT_TRUE(kBackend.supports_non_causal());
  EXPECT_TRUE(kBackend.supports_per_head_quant_scales());
  EXPECT_TRUE(kBackend.supports_batch_invariance());
  EXPECT_TRUE(kBackend.supports_sliding_window());
  EXPECT_TRUE(kBackend.supports_soft_cap());
  EXPECT_TRUE(kBackend.supports_alibi());
  EXPECT_TRUE(kBackend.can_return_lse());
  EXPECT_TRUE(kBackend.is_deterministic());
  EXPECT_FALSE(kBackend.is_mla());
  EXPECT_FALSE(kBackend.is_sparse());
  EXPECT_FALSE(kBackend.required_kv_cache_layout().has_value());
}

TEST(ReferenceBackendTest, RegistersOnlyWhenAsked) {
  BackendRegistry registry;
  register_reference_backend(registry);
  EXPECT_NE(registry.find("reference"), nullptr);
  EXPECT_TRUE(registry.priority_list(DeviceType::CPU).empty());
}

TEST(ReferenceBackendTest, ValidConfigurationsHaveNoReasons) {
  SelectorConfig cfg;
  cfg.head_size = 77;  // any head size
  cfg.dtype = DType::BF16;
  EXPECT_TRUE(kBackend.validate_configuration(cfg).empty());
  cfg.dtype = DType::F32;
  cfg.kv_cache_dtype = CacheDType::Fp8E5M2;
  cfg.block_size = 7;
  cfg.has_sink = true;
  cfg.use_per_head_quant_scales = true;
  cfg.use_non_causal = true;
  cfg.use_batch_invariant = true;
  EXPECT_TRUE(kBackend.validate_configuration(cfg).empty());
  cfg.attn_type = AttentionType::EncoderDecoder;
  EXPECT_TRUE(kBackend.validate_configuration(cfg).empty());
}

TEST(ReferenceBackendTest, InvalidConfigurationsGiveReasons) {
  SelectorConfig cfg;
  cfg.head_size = 64;
  cfg.dtype = DType::I32;
  cfg.use_mla = true;
  const auto reasons = kBackend.validate_configuration(cfg);
  EXPECT_NE(std::find(reasons.begin(), reasons.end(), "dtype not supported"), reasons.end());
  EXPECT_NE(std::find(reasons.begin(), reasons.end(), "MLA not supported"), reasons.end());
}

TEST(ReferenceBackendTest, PlanKernelAnswersTheThreeQuestions) {
  AttentionProblem problem;
  problem.num_heads = 8;
  problem.num_kv_heads = 2;
  problem.head_size = 80;
  problem.dtype = DType::F16;
  problem.kv_storage_dtype = DType::FP8_E5M2;
  problem.has_sinks = true;
  problem.has_alibi = true;
  problem.wants_lse = true;
  const ProblemSupport plan = kBackend.problem_support(problem);
  EXPECT_TRUE(plan.supported());

  problem.dtype = DType::I64;
  problem.kv_storage_dtype = DType::U8;
  problem.num_kv_heads = 3;
  const ProblemSupport bad = kBackend.problem_support(problem);
  EXPECT_FALSE(bad.supported());
  EXPECT_EQ(bad.reasons.size(), 3u);
}

AttentionImplParams small_params() {
  AttentionImplParams p;
  p.num_heads = 2;
  p.num_kv_heads = 1;
  p.head_size = 4;
  p.scale = 0.5f;
  p.dtype = DType::F32;
  return p;
}

TEST(ReferenceBackendTest, ImplConstructorRejectsBadParams) {
  auto with = [](auto change) {
    AttentionImplParams p = small_params();
    change(p);
    return [p] { (void)kBackend.make_impl(p); };
  };
  expect_error(with([](AttentionImplParams& p) { p.num_kv_heads = 3; }), ErrorKind::InvalidArgument,
               "num_heads");
  expect_error(with([](AttentionImplParams& p) { p.head_size = 0; }), ErrorKind::InvalidArgument,
               "head_size");
  expect_error(with([](AttentionImplParams& p) { p.alibi_slopes = {1.0f}; }), ErrorKind::InvalidArgument,
               "alibi_slopes");
  expect_error(with([](AttentionImplParams& p) {
                 p.sinks = {1.0f, 2.0f, 3.0f};
               }),
               ErrorKind::InvalidArgument, "sinks");
  expect_error(with([](AttentionImplParams& p) { p.sliding_window = 0; }), ErrorKind::InvalidArgument,
               "sliding_window");
  expect_error(with([](AttentionImplParams& p) { p.logits_soft_cap = -1.0f; }), ErrorKind::InvalidArgument,
               "logits_soft_cap");
  expect_error(with([](AttentionImplParams& p) { p.device = Device::cuda(0); }), ErrorKind::InvalidArgument,
               "device");
  expect_error(with([](AttentionImplParams& p) { p.dtype = DType::I32; }), ErrorKind::Unsupported,
               "REFERENCE");
}

// One decode request (q_len 1, seq_len 3) over a 3-block f32 cache, heads 2/1, D 4.
class ReferenceForwardTest : public ::testing::Test {
 protected:
  static constexpr int kBlockSize = 2;
  static constexpr int kNumBlocks = 3;

  void SetUp() override {
    impl_ = kBackend.make_impl(params_);
    MetadataOptions options;
    options.block_size = kBlockSize;
    const std::vector<RequestSpec> requests{{1, 3, {2, 1}}};
    metadata_ = kBackend.make_builder({kBlockSize, 1, 4, Device::cpu(), {"l"}})
                    ->build(make_common_metadata(requests, options));
    cache_storage_ =
        Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Auto), DType::F32);
    cache_ = kBackend.unbind_kv_cache(cache_storage_);
    // Keys are zero (uniform scores); values of position j are j + 1 everywhere.
    const std::vector<int> block_of_pos{2, 2, 1};
    for (int pos = 0; pos < 3; ++pos) {
      fill_tensor(
          cache_.value.select(0, block_of_pos[static_cast<std::size_t>(pos)]).select(0, pos % kBlockSize),
          static_cast<float>(pos + 1));
    }
    const std::vector<float> ones{1.0f};
    layer_.k_scale = Tensor::from_floats(ones, {1}, DType::F32);
    layer_.v_scale = Tensor::from_floats(ones, {1}, DType::F32);
  }

  void forward(const TensorView& query, const TensorView& output, const TensorView& lse = {},
               const KVCacheView* cache = nullptr) {
    impl_->forward(layer_, query, {}, {}, cache == nullptr ? cache_ : *cache, *metadata_, output, lse);
  }

  AttentionImplParams params_ = small_params();
  std::unique_ptr<AttentionImpl> impl_;
  std::shared_ptr<const BackendMetadata> metadata_;
  Tensor cache_storage_;
  KVCacheView cache_;
  LayerQuantState layer_;
  Tensor query_ = Tensor::zeros({1, 2, 4}, DType::F32);
  Tensor output_ = Tensor::zeros({1, 2, 4}, DType::F32);
};

TEST_F(ReferenceForwardTest, UniformScoresAverageTheValues) {
  const Tensor lse = Tensor::zeros({2, 1}, DType::F32);
  forward(query_, output_, lse);
  for (const float x : to_float_vector(output_)) EXPECT_FLOAT_EQ(x, 2.0f);  // mean of 1, 2, 3
  for (const float x : to_float_vector(lse)) EXPECT_FLOAT_EQ(x, std::log(3.0f));
}

TEST_F(ReferenceForwardTest, RejectsBadArguments) {
  constexpr auto kInvalid = ErrorKind::InvalidArgument;
  expect_error([&] { forward(Tensor::zeros({1, 3, 4}, DType::F32), output_); }, kInvalid, "query");
  expect_error([&] { forward(Tensor::zeros({1, 2, 4}, DType::BF16), output_); }, kInvalid, "query");
  expect_error([&] { forward(query_, Tensor::zeros({0, 2, 4}, DType::F32)); }, kInvalid, "output");
  expect_error([&] { forward(query_, Tensor::zeros({1, 2, 4}, DType::I32)); }, kInvalid, "output");
  expect_error([&] { forward(query_, output_, Tensor::zeros({2, 1}, DType::F16)); }, kInvalid, "lse");
  expect_error([&] { forward(query_, output_, Tensor::zeros({3, 1}, DType::F32)); }, kInvalid, "lse");
  const KVCacheView none{};
  expect_error([&] { forward(query_, output_, {}, &none); }, kInvalid, "kv_cache");
  const Tensor bf16_cache =
      Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Auto), DType::BF16);
  const KVCacheView wrong_dtype = kBackend.unbind_kv_cache(bf16_cache);
  expect_error([&] { forward(query_, output_, {}, &wrong_dtype); }, kInvalid, "kv_cache.key");
  // A cache with fewer blocks than the block table addresses.
  const Tensor small =
      Tensor::zeros(kBackend.kv_cache_shape(2, kBlockSize, 1, 4, CacheDType::Auto), DType::F32);
  const KVCacheView too_small = kBackend.unbind_kv_cache(small);
  expect_error([&] { forward(query_, output_, {}, &too_small); }, kInvalid, "block_table");
}

TEST_F(ReferenceForwardTest, Fp8CacheNeedsScales) {
  params_.kv_cache_dtype = CacheDType::Fp8E4M3;
  impl_ = kBackend.make_impl(params_);
  const Tensor fp8 = Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Fp8E4M3),
                                   DType::FP8_E4M3);
  const KVCacheView cache = kBackend.unbind_kv_cache(fp8);
  layer_.k_scale = Tensor{};
  expect_error([&] { forward(query_, output_, {}, &cache); }, ErrorKind::InvalidArgument, "k_scale");
  layer_.k_scale = Tensor::zeros({3}, DType::F32);
  expect_error([&] { forward(query_, output_, {}, &cache); }, ErrorKind::InvalidArgument, "k_scale");
}

// REFERENCE does not take quantized queries: a layer asking for them is
// refused, even with an e4m3 cache it could quantize them for.
TEST_F(ReferenceForwardTest, RefusesAQuantizedQuery) {
  params_.kv_cache_dtype = CacheDType::Fp8E4M3;
  impl_ = kBackend.make_impl(params_);
  EXPECT_FALSE(impl_->supports_quant_query_input());
  const Tensor fp8 = Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Fp8E4M3),
                                   DType::FP8_E4M3);
  const KVCacheView cache = kBackend.unbind_kv_cache(fp8);
  layer_.quantize_query = true;
  layer_.q_scale = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
  fill_tensor(output_, 7.0f);
  expect_error([&] { forward(query_, output_, {}, &cache); }, ErrorKind::InvalidArgument, "quantize_query");
  for (const float x : to_float_vector(output_)) EXPECT_EQ(x, 7.0f);
  layer_.quantize_query = false;
  forward(query_, output_, {}, &cache);
}

// The shared check as an impl that takes quantized queries runs it: an e4m3
// per-tensor cache and q_scale [1] f32 on the impl's device.
TEST_F(ReferenceForwardTest, TheQuantizedQueryCheckOfAnImplThatTakesThem) {
  const DType out_dtypes[] = {DType::F32};
  const auto check = [&](const AttentionImplParams& params, const KVCacheView& cache) {
    check_forward_args("taker", params, Device::cpu(), layer_, query_, {}, {}, cache, *metadata_, output_, {},
                       out_dtypes, true);
  };
  AttentionImplParams e4m3 = params_;
  e4m3.kv_cache_dtype = CacheDType::Fp8E4M3;
  AttentionImplParams e5m2 = params_;
  e5m2.kv_cache_dtype = CacheDType::Fp8E5M2;
  const Tensor e4m3_cache = Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Fp8E4M3),
                                          DType::FP8_E4M3);
  const Tensor e5m2_cache = Tensor::zeros(kBackend.kv_cache_shape(kNumBlocks, kBlockSize, 1, 4, CacheDType::Fp8E5M2),
                                          DType::FP8_E5M2);
  layer_.quantize_query = true;
  layer_.q_scale = Tensor::from_floats(std::vector<float>{0.5f}, {1}, DType::F32);
  check(e4m3, kBackend.unbind_kv_cache(e4m3_cache));
  expect_error([&] { check(e5m2, kBackend.unbind_kv_cache(e5m2_cache)); }, ErrorKind::InvalidArgument,
               "quantize_query");
  layer_.q_scale = Tensor::from_floats(std::vector<float>{0.5f, 0.5f}, {2}, DType::F32);
  expect_error([&] { check(e4m3, kBackend.unbind_kv_cache(e4m3_cache)); }, ErrorKind::InvalidArgument,
               "q_scale.size(0)");
  layer_.q_scale = Tensor{};
  expect_error([&] { check(e4m3, kBackend.unbind_kv_cache(e4m3_cache)); }, ErrorKind::InvalidArgument, "q_scale");
}

TEST(ReferenceBackendTest, EncoderNeedsKeyAndValue) {
  AttentionImplParams p = small_params();
  p.attn_type = AttentionType::EncoderOnly;
  const auto impl = kBackend.make_impl(p);
  MetadataOptions options;
  options.causal = false;
  const std::vector<RequestSpec> requests{{2, 2, {1}}};
  const auto md =
      kBackend.make_builder({16, 1, 4, Device::cpu(), {"l"}})->build(make_common_metadata(requests, options));
  const Tensor q = Tensor::zeros({2, 2, 4}, DType::F32);
  const Tensor out = Tensor::zeros({2, 2, 4}, DType::F32);
  expect_error([&] { impl->forward({}, q, {}, {}, {}, *md, out, {}); }, ErrorKind::InvalidArgument, "key");
  const Tensor kv = Tensor::zeros({2, 1, 4}, DType::F32);
  const std::vector<float> v{1, 1, 1, 1, 3, 3, 3, 3};
  const Tensor value = Tensor::from_floats(v, {2, 1, 4}, DType::F32);
  impl->forward({}, q, kv, value, {}, *md, out, {});
  for (const float x : to_float_vector(out)) EXPECT_FLOAT_EQ(x, 2.0f);
}

// Cross-attention over an empty encoder: no visible key, zeros and LSE -inf
// (even with a sink).
TEST(ReferenceBackendTest, RowWithoutKeysIsZeroWithMinusInfLse) {
  AttentionImplParams p = small_params();
  p.attn_type = AttentionType::EncoderDecoder;
  p.sinks = {1.0f, 2.0f};
  const auto impl = kBackend.make_impl(p);
  MetadataOptions options;
  const std::vector<RequestSpec> requests{{1, 1, {}}};
  const std::vector<int> encoder_lens{0};
  const auto md = kBackend.make_builder({16, 1, 4, Device::cpu(), {"l"}})
                      ->build(make_cross_attention_metadata(requests, encoder_lens, false, options));
  const Tensor cache_storage =
      Tensor::zeros(kBackend.kv_cache_shape(1, 16, 1, 4, CacheDType::Auto), DType::F32);
  const Tensor q = Tensor::zeros({1, 2, 4}, DType::F32);
  Tensor out = Tensor::empty({1, 2, 4}, DType::F32);
  fill_tensor(out, 7.0f);
  const Tensor lse = Tensor::zeros({2, 1}, DType::F32);
  impl->forward({}, q, {}, {}, kBackend.unbind_kv_cache(cache_storage), *md, out, lse);
  for (const float x : to_float_vector(out)) EXPECT_EQ(x, 0.0f);
  for (const float x : to_float_vector(lse)) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
}

TEST(ReferenceBackendTest, BuilderValidatesMetadata) {
  const auto builder = kBackend.make_builder({16, 1, 4, Device::cpu(), {"l"}});
  MetadataOptions options;
  options.block_size = 8;
  const std::vector<RequestSpec> requests{{1, 3, {1}}};
  expect_error([&] { (void)builder->build(make_common_metadata(requests, options)); },
               ErrorKind::InvalidArgument, "block_size");
  CommonAttentionMetadata broken = make_common_metadata(requests, MetadataOptions{});
  broken.num_actual_tokens = 5;
  expect_error([&] { (void)builder->build(broken); }, ErrorKind::InvalidArgument, "num_actual_tokens");
  expect_error(
      [] {
        (void)kBackend.make_builder({0, 1, 4, Device::cpu(), {}});
      },
      ErrorKind::InvalidArgument, "block_size");
}

// REFERENCE reads a packed K (kv_packing.h) as the same keys: the same tokens
// written through a row-major and a packed view give the same bits out.
TEST(ReferenceBackendTest, PackedKeyCacheReadsAsTheSameKeys) {
  constexpr int kBlockSize = 16, kNumBlocks = 5, kKvHeads = 2, kHeadSize = 8;
  AttentionImplParams params;
  params.num_heads = 4;
  params.num_kv_heads = kKvHeads;
  params.head_size = kHeadSize;
  params.scale = 0.35f;
  params.dtype = DType::BF16;
  params.kv_cache_dtype = CacheDType::Fp8E4M3;
  const auto impl = kBackend.make_impl(params);
  const std::vector<RequestSpec> requests{{2, 21, {3, 1}}, {1, 30, {0, 4}}};
  MetadataOptions options;
  options.block_size = kBlockSize;
  const auto md = kBackend.make_builder({kBlockSize, kKvHeads, kHeadSize, Device::cpu(), {"l"}})
                      ->build(make_common_metadata(requests, options));
  std::vector<std::int64_t> slots;
  for (const RequestSpec& r : requests) {
    const std::vector<std::int64_t> own = slots_for_positions(r.blocks, kBlockSize, 0, r.seq_len);
    slots.insert(slots.end(), own.begin(), own.end());
  }
  const auto positions = static_cast<std::int64_t>(slots.size());
  test::NormalTensors random(11);
  const Tensor key = random({positions, kKvHeads, kHeadSize});
  const Tensor value = random({positions, kKvHeads, kHeadSize});
  const Tensor query = random({3, params.num_heads, kHeadSize});
  LayerQuantState layer;
  layer.k_scale = Tensor::from_floats(std::vector<float>{0.25f}, {1}, DType::F32);
  layer.v_scale = Tensor::from_floats(std::vector<float>{0.5f}, {1}, DType::F32);

  const Dims shape = kBackend.kv_cache_shape(kNumBlocks, kBlockSize, kKvHeads, kHeadSize, params.kv_cache_dtype);
  const std::vector<int> hnd = kBackend.kv_cache_stride_order(KVCacheLayout::HND);
  std::vector<std::vector<std::uint8_t>> outputs;
  std::vector<std::vector<std::uint8_t>> keys;
  for (const KeyPacking packing : {KeyPacking::None, KeyPacking::Keys16}) {
    const Tensor storage = Tensor::empty_strided_order(shape, hnd, DType::FP8_E4M3, Device::cpu());
    fill_tensor_bits(storage, 0);
    KVCacheView view = kBackend.unbind_kv_cache(storage);
    EXPECT_EQ(view.key_packing, KeyPacking::None);
    view.key_packing = packing;
    impl->do_kv_cache_update(layer, key, value, view, Tensor::from_i64(slots, {positions}));
    const Tensor out = Tensor::zeros({3, params.num_heads, kHeadSize}, DType::BF16);
    const Tensor lse = Tensor::zeros({params.num_heads, 3}, DType::F32);
    impl->forward(layer, query, {}, {}, view, *md, out, lse);
    outputs.push_back(to_byte_vector(out));
    const std::vector<std::uint8_t> lse_bytes = to_byte_vector(lse);
    outputs.back().insert(outputs.back().end(), lse_bytes.begin(), lse_bytes.end());
    keys.push_back(to_byte_vector(view.key));
  }
  EXPECT_NE(keys[0], keys[1]);
  EXPECT_EQ(outputs[0], outputs[1]);

  // An NHD cache with two heads cannot hold the packing.
  const Tensor nhd = Tensor::zeros(shape, DType::FP8_E4M3);
  KVCacheView bad = kBackend.unbind_kv_cache(nhd);
  bad.key_packing = KeyPacking::Keys16;
  const Tensor out = Tensor::zeros({3, params.num_heads, kHeadSize}, DType::BF16);
  expect_error([&] { impl->forward(layer, query, {}, {}, bad, *md, out, {}); }, ErrorKind::InvalidArgument,
               "kv_cache.key slot stride must be 8");
}

}  // namespace
}  // namespace pagedattn
