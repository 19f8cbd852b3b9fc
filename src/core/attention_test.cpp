// The Attention layer: constructor semantics and errors, forward through the
// forward context, KV sharing, virtual engines, scales, and end-to-end runs on
// the REFERENCE backend.
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/ops.h>
#include <pagedattn/backend/registry.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_error;
using test::expect_invalid;

constexpr int kHeads = 4;
constexpr int kKVHeads = 2;
constexpr int kHeadSize = 8;
constexpr int kBlock = 4;
constexpr std::int64_t kNumBlocks = 8;
constexpr float kScale = 0.25f;

// ------------------------------------------------------------ fake backend

// Copies the query to the output and stores K/V with reshape_and_cache, and
// records what the layer handed it.
class FakeImpl final : public AttentionImpl {
 public:
  using AttentionImpl::AttentionImpl;

  // Rejects what a real impl rejects about the metadata: ids past the cache.
  void check_forward(const LayerQuantState&, const TensorView&, const TensorView&, const TensorView&,
                     const KVCacheView& kv_cache, const BackendMetadata& metadata, const TensorView&,
                     const TensorView&) const override {
    metadata.common.validate("FakeAttentionImpl", kv_cache.defined() ? kv_cache.num_blocks() : 0);
  }

  void forward(const LayerQuantState&, const TensorView& query, const TensorView&, const TensorView&,
               const KVCacheView& kv_cache, const BackendMetadata& metadata, const TensorView& output,
               const TensorView& lse) override {
    ++forward_calls;
    last_kv_key = kv_cache.key.data();
    last_metadata = &metadata;
    copy_tensor(output, query);
    if (lse.defined()) fill_tensor(lse, 0.0f);
  }

  void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                          const KVCacheView& kv_cache, const TensorView& slot_mapping) override {
    ++update_calls;
    reshape_and_cache(key, value, kv_cache.key, kv_cache.value, slot_mapping, params_.kv_cache_dtype,
                      layer.k_scale, layer.v_scale);
  }

  void process_weights_after_loading(DType act_dtype) override { processed_dtype = act_dtype; }
  std::string_view class_name() const override { return "FakeAttentionImpl"; }

  int forward_calls = 0;
  int update_calls = 0;
  const void* last_kv_key = nullptr;
  const BackendMetadata* last_metadata = nullptr;
  std::optional<DType> processed_dtype;
};

class FakeBuilder final : public AttentionMetadataBuilder {
 public:
  explicit FakeBuilder(int* builds) : builds_(builds) {}
  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override {
    ++*builds_;
    auto metadata = std::make_shared<BackendMetadata>();
    metadata->common = common;
    return metadata;
  }

 private:
  int* builds_;
};

struct FakeFeatures {
  std::vector<int> head_sizes{};  // empty = any
  bool writes_in_forward = false;
  bool returns_lse = true;
  bool supported = true;
};

class FakeBackend final : public AttentionBackend {
 public:
  explicit FakeBackend(FakeFeatures features = {}) : features_(std::move(features)) {}
  std::string_view name() const override { return "FAKE"; }
  DeviceType device_type() const override { return DeviceType::CPU; }
  std::string_view description() const override { return "test backend"; }
  std::vector<DType> supported_dtypes() const override { return {DType::F32, DType::F16, DType::BF16}; }
  std::vector<CacheDType> supported_kv_cache_dtypes() const override { return {}; }
  std::vector<int> supported_head_sizes() const override { return features_.head_sizes; }
  bool supports_sink() const override { return true; }
  bool supports_per_head_quant_scales() const override { return true; }
  bool supports_attn_type(AttentionType) const override { return true; }
  bool can_return_lse() const override { return features_.returns_lse; }
  bool forward_includes_kv_cache_update() const override { return features_.writes_in_forward; }
  KernelPlan plan_kernel(const AttentionProblem&) const override {
    KernelPlan plan;
    plan.kernel = "copy";
    if (!features_.supported) plan.reasons.emplace_back("fake kernel disabled");
    return plan;
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<FakeImpl>(params);
  }
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams&) const override {
    ++builders_made;
    return std::make_unique<FakeBuilder>(&builds);
  }

  mutable int builders_made = 0;
  mutable int builds = 0;

 private:
  FakeFeatures features_;
};

FakeImpl& fake_impl(Attention& layer) { return dynamic_cast<FakeImpl&>(layer.impl()); }

ModelOptions f32_model(int pipeline_parallel_size = 1) {
  ModelOptions m;
  m.dtype = DType::F32;
  m.pipeline_parallel_size = pipeline_parallel_size;
  return m;
}

AttentionOptions options_for(const std::string& prefix, const AttentionBackend& backend) {
  AttentionOptions o;
  o.num_kv_heads = kKVHeads;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = kBlock;
  o.cache_config->kv_cache_layout = KVCacheLayout::NHD;
  o.prefix = prefix;
  o.attn_backend = &backend;
  return o;
}

// Deterministic values in [-1, 1).
std::vector<float> pattern(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  std::uint32_t state = 2654435761u * (seed + 1u);
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

Tensor make_tensor(Dims shape, unsigned seed, DType dtype = DType::F32) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return Tensor::from_floats(pattern(static_cast<std::size_t>(n), seed), shape, dtype);
}

std::shared_ptr<const BackendMetadata> as_backend_metadata(CommonAttentionMetadata common) {
  auto md = std::make_shared<BackendMetadata>();
  md->common = std::move(common);
  return md;
}

// Two requests on a 4-slot block size: a decode at position 5 (blocks 2, 6)
// and a 3-token prefill (block 4): 4 tokens.
CommonAttentionMetadata small_batch() {
  MetadataOptions options;
  options.block_size = kBlock;
  const std::vector<RequestSpec> requests{RequestSpec{1, 6, {2, 6}}, RequestSpec{3, 3, {4}}};
  return make_common_metadata(requests, options);
}
constexpr std::int64_t kBatchTokens = 4;

ForwardContext context_with(CommonAttentionMetadata common, int virtual_engine = 0) {
  ForwardContext context;
  context.metadata = as_backend_metadata(std::move(common));
  context.virtual_engine = virtual_engine;
  return context;
}

// The cache row of one slot, [Hkv, D] as floats.
std::vector<float> cache_row(const TensorView& cache_half, std::int64_t slot) {
  return to_float_vector(cache_half.select(0, slot / kBlock).select(0, slot % kBlock));
}

std::vector<float> token_row(const TensorView& t3, std::int64_t token) {
  return to_float_vector(t3.select(0, token));
}

// ---------------------------------------------------------------- ctor

TEST(AttentionCtor, DefaultsAndRegistration) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  AttentionOptions o;
  o.prefix = "layers.0.attn";
  o.attn_backend = &backend;
  {
    Attention layer(model, kHeads, kHeadSize, kScale, o);
    EXPECT_EQ(layer.num_kv_heads(), kHeads);
    EXPECT_EQ(layer.block_size(), kDefaultBlockSize);
    EXPECT_EQ(layer.kv_cache_dtype(), CacheDType::Auto);
    EXPECT_EQ(layer.kv_cache_storage_dtype(), DType::F32);
    EXPECT_FALSE(layer.sliding_window().has_value());
    EXPECT_FALSE(layer.calculate_kv_scales());
    EXPECT_FALSE(layer.quantizes_query());
    EXPECT_FALSE(layer.has_sink());
    EXPECT_EQ(layer.attn_type(), AttentionType::Decoder);
    EXPECT_EQ(layer.dtype(), DType::F32);
    EXPECT_EQ(&layer.backend(), &backend);
    EXPECT_EQ(model.find_layer("layers.0.attn"), &layer);
    EXPECT_EQ(&model.layer("layers.0.attn"), &layer);
    EXPECT_EQ(model.layers().size(), 1u);
    EXPECT_EQ(layer.quant_state().k_scale.shape(), (Dims{1}));
    EXPECT_EQ(layer.quant_state().k_scale_float, 1.0f);
    EXPECT_FALSE(layer.kv_cache(0).defined());
    const AttentionImplParams& p = layer.impl().params();
    EXPECT_EQ(p.num_heads, kHeads);
    EXPECT_EQ(p.num_kv_heads, kHeads);
    EXPECT_EQ(p.scale, kScale);
    EXPECT_EQ(p.dtype, DType::F32);
  }
  EXPECT_EQ(model.find_layer("layers.0.attn"), nullptr);
  expect_invalid([&] { model.layer("layers.0.attn"); }, "no layer named 'layers.0.attn'");
}

TEST(AttentionCtor, ArgumentErrorsNameTheArgument) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  const auto build = [&](int heads, int head_size, float scale,
                         const std::function<void(AttentionOptions&)>& edit) {
    AttentionOptions o = options_for("layers.0.attn", backend);
    edit(o);
    Attention layer(model, heads, head_size, scale, o);
  };
  const auto keep = [](AttentionOptions&) {};
  expect_invalid([&] { build(0, kHeadSize, kScale, keep); },
                 "Attention(layers.0.attn): num_heads must be > 0, got 0");
  expect_invalid([&] { build(kHeads, -8, kScale, keep); }, "head_size must be > 0, got -8");
  expect_invalid([&] { build(kHeads, kHeadSize, 0.0f, keep); },
                 "scale must be a positive finite number, got 0");
  expect_invalid([&] { build(kHeads, kHeadSize, NAN, keep); }, "scale must be a positive finite number");
  expect_invalid([&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.num_kv_heads = 0; }); },
                 "num_kv_heads must be > 0, got 0");
  expect_invalid([&] { build(32, kHeadSize, kScale, [](auto& o) { o.num_kv_heads = 5; }); },
                 "Attention(layers.0.attn): num_heads (32) is not divisible by num_kv_heads (5)");
  expect_invalid(
      [&] { build(kHeads, kHeadSize, kScale, [](auto& o) {
              o.alibi_slopes = std::vector<float>{1, 2};
            }); },
      "alibi_slopes size must be num_heads (4), got 2");
  expect_invalid([&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.sinks = std::vector<float>{}; }); },
                 "sinks size must be num_heads (4), got 0");
  expect_invalid([&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.logits_soft_cap = -30.0f; }); },
                 "logits_soft_cap must be > 0 when set, got -30");
  expect_invalid([&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.per_layer_sliding_window = 0; }); },
                 "per_layer_sliding_window must be > 0 when set, got 0");
  expect_invalid(
      [&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.cache_config->sliding_window = -4; }); },
      "cache_config.sliding_window must be > 0 when set, got -4");
  expect_invalid([&] { build(kHeads, kHeadSize, kScale, [](auto& o) { o.cache_config->block_size = 0; }); },
                 "cache_config.block_size must be > 0 when set, got 0");
  EXPECT_TRUE(model.layers().empty());
}

TEST(AttentionCtor, DuplicateNameIsRejected) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention first(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  expect_invalid(
      [&] { Attention again(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend)); },
      "Duplicate layer name: layers.0.attn");
  EXPECT_EQ(model.layers().size(), 1u);
  EXPECT_EQ(model.find_layer("layers.0.attn"), &first);
}

TEST(AttentionCtor, KVSharingTargetValidation) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention layer0(model, kHeads, kHeadSize, kScale, options_for("model.layers.0.attn", backend));
  AttentionOptions encoder = options_for("model.layers.1.attn", backend);
  encoder.attn_type = AttentionType::Encoder;
  Attention layer1(model, kHeads, kHeadSize, kScale, encoder);
  const auto share = [&](const std::string& self, const std::string& target) {
    AttentionOptions o = options_for(self, backend);
    o.kv_sharing_target_layer_name = target;
    Attention layer(model, kHeads, kHeadSize, kScale, o);
  };
  expect_invalid([&] { share("model.layers.2.attn", "model.layers.2.attn"); },
                 "target layer model.layers.2.attn cannot be the same as the current layer");
  expect_invalid([&] { share("model.layers.2.attn", "model.layers.5.attn"); },
                 "target layer model.layers.5.attn must come before the current layer");
  expect_invalid([&] { share("model.layers.2.attn", "model.layers.0.mlp"); },
                 "target layer model.layers.0.mlp is not a valid Attention layer in the model");
  expect_invalid([&] { share("model.layers.2.attn", "model.layers.1.attn"); },
                 "must be the same type as the current layer (decoder)");
  EXPECT_EQ(model.layers().size(), 2u);

  AttentionOptions ok = options_for("model.layers.2.attn", backend);
  ok.kv_sharing_target_layer_name = "model.layers.0.attn";
  Attention sharing(model, kHeads, kHeadSize, kScale, ok);
  EXPECT_EQ(sharing.kv_sharing_target_layer_name(), "model.layers.0.attn");
  EXPECT_EQ(sharing.impl().params().kv_sharing_target_layer_name, "model.layers.0.attn");
  EXPECT_FALSE(sharing.get_kv_cache_spec().has_value());
}

TEST(AttentionCtor, SlidingWindowPrecedence) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  AttentionOptions both = options_for("both", backend);
  both.per_layer_sliding_window = 8;
  both.cache_config->sliding_window = 16;
  AttentionOptions model_level = options_for("model_level", backend);
  model_level.cache_config->sliding_window = 16;
  AttentionOptions no_cache_config = options_for("none", backend);
  no_cache_config.cache_config.reset();
  Attention a(model, kHeads, kHeadSize, kScale, both);
  Attention b(model, kHeads, kHeadSize, kScale, model_level);
  Attention c(model, kHeads, kHeadSize, kScale, no_cache_config);
  EXPECT_EQ(a.sliding_window(), 8);
  EXPECT_EQ(a.impl().params().sliding_window, 8);
  EXPECT_EQ(b.sliding_window(), 16);
  EXPECT_FALSE(c.sliding_window().has_value());
  EXPECT_EQ(c.block_size(), kDefaultBlockSize);

  const auto spec_a = a.get_kv_cache_spec();
  ASSERT_TRUE(spec_a.has_value());
  ASSERT_TRUE(std::holds_alternative<SlidingWindowSpec>(*spec_a));
  EXPECT_EQ(std::get<SlidingWindowSpec>(*spec_a).sliding_window, 8);
  EXPECT_EQ(std::get<SlidingWindowSpec>(*spec_a).block_size, kBlock);
  ASSERT_TRUE(c.get_kv_cache_spec().has_value());
  EXPECT_TRUE(std::holds_alternative<FullAttentionSpec>(*c.get_kv_cache_spec()));
}

TEST(AttentionCtor, KVCacheSpecPerAttentionType) {
  const FakeBackend backend;
  ModelContext model(ModelOptions{});  // bf16
  const auto spec_of = [&](AttentionType type, const std::string& name) {
    AttentionOptions o = options_for(name, backend);
    o.attn_type = type;
    Attention layer(model, 32, 128, kScale, o);
    return layer.get_kv_cache_spec();
  };
  const auto decoder = spec_of(AttentionType::Decoder, "dec");
  ASSERT_TRUE(decoder.has_value());
  const auto& full = std::get<FullAttentionSpec>(*decoder);
  EXPECT_EQ(full.num_kv_heads, kKVHeads);
  EXPECT_EQ(full.head_size, 128);
  EXPECT_EQ(full.dtype, DType::BF16);
  EXPECT_EQ(page_size_bytes(*decoder), static_cast<std::size_t>(2 * kBlock * kKVHeads * 128 * 2));
  const auto cross = spec_of(AttentionType::EncoderDecoder, "cross");
  ASSERT_TRUE(cross.has_value());
  EXPECT_TRUE(std::holds_alternative<CrossAttentionSpec>(*cross));
  EXPECT_FALSE(spec_of(AttentionType::Encoder, "enc").has_value());
  EXPECT_FALSE(spec_of(AttentionType::EncoderOnly, "enc_only").has_value());
}

TEST(AttentionCtor, QuantConfig) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  AttentionOptions scheme = options_for("scheme", backend);
  scheme.cache_config->calculate_kv_scales = true;
  scheme.quant_config = QuantConfig{.has_kv_cache_scheme = true};
  Attention forced(model, kHeads, kHeadSize, kScale, scheme);
  EXPECT_EQ(forced.kv_cache_dtype(), CacheDType::Fp8);
  EXPECT_EQ(forced.kv_cache_storage_dtype(), DType::FP8_E4M3);
  EXPECT_FALSE(forced.calculate_kv_scales());
  EXPECT_EQ(forced.impl().params().kv_cache_dtype, CacheDType::Fp8);

  AttentionOptions per_head = options_for("per_head", backend);
  per_head.quant_config = QuantConfig{.has_kv_cache_scheme = true, .per_head_scales = true};
  Attention heads(model, kHeads, kHeadSize, kScale, per_head);
  EXPECT_EQ(heads.quant_state().k_scale.shape(), (Dims{kKVHeads}));
  EXPECT_EQ(heads.quant_state().v_scale.shape(), (Dims{kKVHeads}));
  EXPECT_EQ(heads.quant_state().q_scale.shape(), (Dims{1}));

  const auto build = [&](QuantConfig qc, CacheDType dtype) {
    AttentionOptions o = options_for("bad", backend);
    o.cache_config->cache_dtype = dtype;
    o.quant_config = std::move(qc);
    Attention layer(model, kHeads, kHeadSize, kScale, o);
  };
  expect_error(
      ErrorKind::Unsupported, [&] { build(QuantConfig{.has_kv_cache_scheme = true}, CacheDType::Fp8E5M2); },
      "fp8_e5m2 kv-cache is not supported with fp8 checkpoints");
  expect_invalid(
      [&] {
        build(QuantConfig{.k_scale = std::vector<float>{1}, .v_scale = std::vector<float>{1}},
              CacheDType::Fp8);
      },
      "quant_config must be a KV-cache scheme when checkpoint scales are given");
  expect_invalid(
      [&] {
        build(QuantConfig{.has_kv_cache_scheme = true,
                          .k_scale = std::vector<float>{1, 2},
                          .v_scale = std::vector<float>{1, 2}},
              CacheDType::Fp8);
      },
      "quant_config.k_scale size must be 1, got 2");
  expect_invalid(
      [&] {
        build(QuantConfig{.has_kv_cache_scheme = true, .k_scale = std::vector<float>{0.5f}}, CacheDType::Fp8);
      },
      "quant_config.v_scale must be given together with quant_config.k_scale");
  expect_invalid(
      [&] {
        build(QuantConfig{.has_kv_cache_scheme = true,
                          .per_head_scales = true,
                          .k_scale = std::vector<float>{1, 2},
                          .v_scale = std::vector<float>{1}},
              CacheDType::Fp8);
      },
      "quant_config.v_scale size must be quant_config.k_scale size (2), got 1");
  expect_invalid(
      [&] {
        build(QuantConfig{.has_kv_cache_scheme = true,
                          .k_scale = std::vector<float>{-1},
                          .v_scale = std::vector<float>{1}},
              CacheDType::Fp8);
      },
      "quant_config.k_scale[0] must be a positive finite number, got -1");
}

TEST(AttentionCtor, ExplicitBackendMustFit) {
  const FakeBackend only_64({.head_sizes = {64}});
  const FakeBackend disabled({.supported = false});
  ModelContext model(f32_model());
  expect_error(
      ErrorKind::Unsupported,
      [&] { Attention layer(model, kHeads, kHeadSize, kScale, options_for("a", only_64)); },
      "attn_backend FAKE does not support this layer: [head_size not supported]");
  expect_error(
      ErrorKind::Unsupported,
      [&] { Attention layer(model, kHeads, kHeadSize, kScale, options_for("b", disabled)); },
      "fake kernel disabled");
  EXPECT_TRUE(model.layers().empty());
}

TEST(AttentionCtor, ModelContextErrors) {
  expect_invalid([] { ModelContext m(ModelOptions{.pipeline_parallel_size = 0}); },
                 "ModelContext: pipeline_parallel_size must be >= 1, got 0");
  expect_invalid([] { ModelContext m(ModelOptions{.dtype = DType::I32}); },
                 "dtype must be f32, f16 or bf16, got i32");
}

TEST(AttentionCtor, LayersOutlivingTheModelAreDetached) {
  const FakeBackend backend;
  auto model = std::make_unique<ModelContext>(f32_model());
  Attention layer(*model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  model.reset();
  EXPECT_EQ(layer.layer_name(), "layers.0.attn");
}

TEST(AttentionCtor, ExtraRepr) {
  const FakeBackend backend;
  ModelContext model(ModelOptions{});
  AttentionOptions o = options_for("layers.0.attn", backend);
  o.num_kv_heads = 8;
  Attention layer(model, 32, 128, 1.0f / std::sqrt(128.0f), o);
  EXPECT_EQ(layer.extra_repr(),
            "head_size=128, num_heads=32, num_kv_heads=8, scale=0.0883883, backend=FakeAttentionImpl");
}

// ---------------------------------------------------------------- forward

struct OneLayer {
  explicit OneLayer(const FakeBackend& backend, int pipeline_parallel_size = 1,
                    const std::function<void(AttentionOptions&)>& edit = {})
      : model(f32_model(pipeline_parallel_size)) {
    AttentionOptions o = options_for("layers.0.attn", backend);
    if (edit) edit(o);
    layer = std::make_unique<Attention>(model, kHeads, kHeadSize, kScale, o);
    allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  }
  ModelContext model;
  std::unique_ptr<Attention> layer;
};

TEST(AttentionForward, FlatAndHeadedInputs) {
  const FakeBackend backend;
  OneLayer f(backend);
  const CommonAttentionMetadata batch = small_batch();
  ForwardContextScope scope(context_with(batch));
  const Tensor q = make_tensor({kBatchTokens, kHeads * kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads * kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads * kHeadSize}, 3);

  const Tensor out = f.layer->forward(q, k, v);
  EXPECT_EQ(out.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(out.dtype(), DType::F32);
  EXPECT_EQ(to_float_vector(out), to_float_vector(q));
  FakeImpl& impl = fake_impl(*f.layer);
  EXPECT_EQ(impl.update_calls, 1);
  EXPECT_EQ(impl.last_kv_key, f.layer->kv_cache_view(0).key.data());
  // The decode token (position 5) went to block 6, offset 1: slot 25.
  const TensorView k3 = k.view({kBatchTokens, kKVHeads, kHeadSize});
  const TensorView v3 = v.view({kBatchTokens, kKVHeads, kHeadSize});
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k3, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).value, 25), token_row(v3, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 18), token_row(k3, 3));

  const Tensor q3 = make_tensor({kBatchTokens, kHeads, kHeadSize}, 4);
  const Tensor k3b = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 5);
  const Tensor v3b = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 6);
  const Tensor out3 = f.layer->forward(q3, k3b, v3b);
  EXPECT_EQ(out3.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(to_float_vector(out3), to_float_vector(q3));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k3b, 0));
}

TEST(AttentionForward, CallerOutputBuffer) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 3);
  const Tensor flat_out = Tensor::zeros({kBatchTokens, kHeads * kHeadSize}, DType::F32);
  const Tensor result = f.layer->forward(q, k, v, flat_out);
  EXPECT_EQ(result.data(), flat_out.data());
  EXPECT_EQ(result.shape(), (Dims{kBatchTokens, kHeads * kHeadSize}));
  EXPECT_EQ(to_float_vector(flat_out), to_float_vector(q));

  const Tensor headed_out = Tensor::zeros({kBatchTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor lse = Tensor::empty({kHeads, kBatchTokens}, DType::F32);
  const Tensor result3 = f.layer->forward(q, k, v, headed_out, lse);
  EXPECT_EQ(result3.data(), headed_out.data());
  EXPECT_EQ(to_float_vector(headed_out), to_float_vector(q));
}

TEST(AttentionForward, StridedRowsOfAFusedQKV) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContextScope scope(context_with(small_batch()));
  constexpr std::int64_t kQWidth = kHeads * kHeadSize;
  constexpr std::int64_t kKVWidth = kKVHeads * kHeadSize;
  const Tensor qkv = make_tensor({kBatchTokens, kQWidth + 2 * kKVWidth}, 7);
  const Tensor q = qkv.slice(1, 0, kQWidth);
  const Tensor k = qkv.slice(1, kQWidth, kQWidth + kKVWidth);
  const Tensor v = qkv.slice(1, kQWidth + kKVWidth, kQWidth + 2 * kKVWidth);
  const Tensor out = f.layer->forward(q, k, v);
  EXPECT_EQ(to_float_vector(out), to_float_vector(q));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25),
            token_row(k.view({kBatchTokens, kKVHeads, kHeadSize}), 0));
}

TEST(AttentionForward, NeedsAForwardContextAndLayerMetadata) {
  const FakeBackend backend;
  OneLayer f(backend);
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  expect_invalid([&] { f.layer->forward(q, k, k); }, "no forward context is set");
  ForwardContext other;
  other.layer_metadata.emplace("layers.9.attn", as_backend_metadata(small_batch()));
  ForwardContextScope scope(std::move(other));
  expect_invalid([&] { f.layer->forward(q, k, k); }, "no attention metadata for layer 'layers.0.attn'");
}

TEST(AttentionForward, RejectedCallsLeaveTheCacheUntouched) {
  const FakeBackend backend({.returns_lse = false});
  OneLayer f(backend, 1, [](AttentionOptions& o) { o.cache_config->calculate_kv_scales = true; });
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  const Tensor v = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 3);
  const std::vector<std::uint8_t> before = to_byte_vector(f.layer->kv_cache(0));
  FakeImpl& impl = fake_impl(*f.layer);
  {
    ForwardContextScope scope(context_with(small_batch()));
    const Tensor q_bad_width = make_tensor({kBatchTokens, kHeads * kHeadSize + 1}, 1);
    expect_invalid([&] { f.layer->forward(q_bad_width, k, v); }, "query size(1) must be 32");
    const Tensor q_bad_heads = make_tensor({kBatchTokens, kHeads + 1, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_bad_heads, k, v); }, "query size(1) must be 4");
    const Tensor q_rank4 = make_tensor({1, kBatchTokens, kHeads, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_rank4, k, v); },
                   "query rank must be 2 ([T, 32]) or 3 ([T, 4, 8])");
    const Tensor q_bf16 = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1, DType::BF16);
    expect_invalid([&] { f.layer->forward(q_bf16, k, v); }, "query dtype must be f32, got bf16");
    const Tensor k_f16 = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2, DType::F16);
    expect_invalid([&] { f.layer->forward(q, k_f16, v); }, "key dtype must be f32, got f16");
    const Tensor k_short = make_tensor({kBatchTokens - 1, kKVHeads, kHeadSize}, 2);
    expect_invalid([&] { f.layer->forward(q, k_short, k_short); }, "key size(0) must be 4");
    expect_invalid([&] { f.layer->forward(q, k, TensorView{}); },
                   "key and value must be both given or both undefined");
    const Tensor out_short = Tensor::zeros({kBatchTokens - 1, kHeads * kHeadSize}, DType::F32);
    expect_invalid([&] { f.layer->forward(q, k, v, out_short); }, "output size(0) must be 4");
    const Tensor out_bf16 = Tensor::zeros({kBatchTokens, kHeads * kHeadSize}, DType::BF16);
    expect_invalid([&] { f.layer->forward(q, k, v, out_bf16); }, "output dtype must be f32, got bf16");
    const Tensor lse = Tensor::zeros({kHeads, kBatchTokens}, DType::F32);
    expect_invalid([&] { f.layer->forward(q, k, v, {}, lse); }, "backend FAKE cannot return it");
    const Tensor q_few = make_tensor({kBatchTokens - 1, kHeads, kHeadSize}, 1);
    expect_invalid([&] { f.layer->forward(q_few, k_short, k_short); },
                   "metadata num_actual_tokens must be <= query tokens (3), got 4");
  }
  {
    ForwardContextScope scope(context_with(small_batch(), 1));
    expect_invalid([&] { f.layer->forward(q, k, v); },
                   "forward context virtual_engine must be in [0, 1), got 1");
  }
  {
    ForwardContext bad_slots = context_with(small_batch());
    bad_slots.slot_mappings.emplace("layers.0.attn",
                                    Tensor::from_i32(std::vector<std::int32_t>{0, 1, 2, 3}, {4}));
    ForwardContextScope scope(std::move(bad_slots));
    expect_invalid([&] { f.layer->forward(q, k, v); }, "slot_mapping dtype must be i64, got i32");
  }
  {
    MetadataOptions other_block;
    other_block.block_size = 2 * kBlock;
    ForwardContextScope scope(
        context_with(make_common_metadata(std::vector<RequestSpec>{{4, 4, {1}}}, other_block)));
    expect_invalid([&] { f.layer->forward(q, k, v); },
                   "metadata block_size must be the layer's block size (4), got 8");
  }
  EXPECT_EQ(to_byte_vector(f.layer->kv_cache(0)), before);
  EXPECT_EQ(impl.update_calls, 0);
  EXPECT_EQ(impl.forward_calls, 0);
  EXPECT_TRUE(f.layer->calculate_kv_scales());
}

TEST(AttentionForward, UnboundCacheIsAnError) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  expect_invalid([&] { layer.forward(q, k, k); },
                 "kv_cache[0] must be bound (allocate_kv_caches), got unbound");
}

TEST(AttentionForward, KVSharingLayerNeverWritesTheCache) {
  const FakeBackend backend;
  ModelContext model(f32_model());
  Attention owner(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", backend));
  AttentionOptions sharing = options_for("layers.1.attn", backend);
  sharing.kv_sharing_target_layer_name = "layers.0.attn";
  Attention reader(model, kHeads, kHeadSize, kScale, sharing);
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  owner.forward(q, k, k);
  const std::vector<std::uint8_t> snapshot = to_byte_vector(owner.kv_cache(0));
  const Tensor other_k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 9);
  reader.forward(q, other_k, other_k);
  EXPECT_EQ(to_byte_vector(owner.kv_cache(0)), snapshot);
  EXPECT_EQ(fake_impl(reader).update_calls, 0);
  EXPECT_EQ(fake_impl(reader).forward_calls, 1);
  EXPECT_EQ(fake_impl(reader).last_kv_key, owner.kv_cache_view(0).key.data());
}

TEST(AttentionForward, EachVirtualEngineUsesItsOwnCache) {
  const FakeBackend backend;
  OneLayer f(backend, 2);
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  {
    ForwardContextScope scope(context_with(small_batch(), 1));
    f.layer->forward(q, k, k);
  }
  EXPECT_EQ(fake_impl(*f.layer).last_kv_key, f.layer->kv_cache_view(1).key.data());
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(1).key, 25), token_row(k, 0));
  const std::vector<std::uint8_t> engine0 = to_byte_vector(f.layer->kv_cache(0));
  EXPECT_TRUE(std::all_of(engine0.begin(), engine0.end(), [](std::uint8_t b) { return b == 0; }));
  {
    ForwardContextScope scope(context_with(small_batch(), 0));
    f.layer->forward(q, k, k);
  }
  EXPECT_EQ(fake_impl(*f.layer).last_kv_key, f.layer->kv_cache_view(0).key.data());
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), token_row(k, 0));
}

TEST(AttentionForward, PerLayerSlotMappingOverridesTheMetadata) {
  const FakeBackend backend;
  OneLayer f(backend);
  ForwardContext context = context_with(small_batch());
  context.slot_mappings.emplace("layers.0.attn",
                                Tensor::from_i64(std::vector<std::int64_t>{30, -1, -1, 7}, {4}));
  ForwardContextScope scope(std::move(context));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  f.layer->forward(q, k, k);
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 30), token_row(k, 0));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 7), token_row(k, 3));
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25), std::vector<float>(kKVHeads * kHeadSize, 0.0f));
}

TEST(AttentionForward, CacheUpdateIsSkippedWhenNotTheLayersJob) {
  const FakeBackend writes_in_forward({.writes_in_forward = true});
  OneLayer f(writes_in_forward);
  const FakeBackend backend;
  ModelContext model(f32_model());
  AttentionOptions encoder_only = options_for("encoder", backend);
  encoder_only.attn_type = AttentionType::EncoderOnly;
  Attention encoder(model, kHeads, kHeadSize, kScale, encoder_only);
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});

  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  f.layer->forward(q, k, k);
  EXPECT_EQ(fake_impl(*f.layer).update_calls, 0);
  EXPECT_EQ(fake_impl(*f.layer).forward_calls, 1);
  // Key and value absent: nothing to store, attention still runs.
  OneLayer g(backend);
  g.layer->forward(q, TensorView{}, TensorView{});
  EXPECT_EQ(fake_impl(*g.layer).update_calls, 0);
  EXPECT_EQ(fake_impl(*g.layer).forward_calls, 1);

  encoder.forward(q, k, k);
  EXPECT_EQ(fake_impl(encoder).update_calls, 0);
  EXPECT_EQ(fake_impl(encoder).last_kv_key, nullptr);
  expect_invalid([&] { encoder.forward(q, TensorView{}, TensorView{}); },
                 "key must be given for encoder attention");
}

TEST(AttentionForward, CalcKVScalesRunsOnce) {
  const FakeBackend backend;
  OneLayer f(backend, 1, [](AttentionOptions& o) {
    o.cache_config->cache_dtype = CacheDType::Fp8;
    o.cache_config->calculate_kv_scales = true;
  });
  ASSERT_TRUE(f.layer->calculate_kv_scales());
  ForwardContextScope scope(context_with(small_batch()));
  std::vector<float> qv(kBatchTokens * kHeads * kHeadSize, 0.5f);
  std::vector<float> kv(kBatchTokens * kKVHeads * kHeadSize, 0.25f);
  std::vector<float> vv(kBatchTokens * kKVHeads * kHeadSize, -0.5f);
  qv[3] = -4.0f;
  kv[7] = 2.0f;
  vv[1] = -5.0f;
  const Tensor q = Tensor::from_floats(qv, {kBatchTokens, kHeads, kHeadSize}, DType::F32);
  const Tensor k = Tensor::from_floats(kv, {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  const Tensor v = Tensor::from_floats(vv, {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  f.layer->forward(q, k, v);
  const LayerQuantState& s = f.layer->quant_state();
  EXPECT_FLOAT_EQ(s.q_scale_float, 4.0f / kQScaleRange);
  EXPECT_FLOAT_EQ(s.k_scale_float, 2.0f / kKScaleRange);
  EXPECT_FLOAT_EQ(s.v_scale_float, 5.0f / kVScaleRange);
  EXPECT_FLOAT_EQ(to_float_vector(s.k_scale)[0], 2.0f / kKScaleRange);
  EXPECT_FALSE(f.layer->calculate_kv_scales());
  // The cache stores sat(x / k_scale) in e4m3; element 7 of token 0 is the 2.0.
  EXPECT_EQ(cache_row(f.layer->kv_cache_view(0).key, 25)[7],
            fp8_e4m3_to_float(float_to_fp8_e4m3(2.0f / s.k_scale_float)));

  const Tensor big = Tensor::from_floats(std::vector<float>(kBatchTokens * kKVHeads * kHeadSize, 40.0f),
                                         {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  f.layer->forward(q, big, big);
  EXPECT_FLOAT_EQ(f.layer->quant_state().k_scale_float, 2.0f / kKScaleRange);
}

TEST(AttentionForward, ProcessWeightsAfterLoading) {
  const FakeBackend backend;
  OneLayer calculated(backend, 1, [](AttentionOptions& o) {
    o.cache_config->cache_dtype = CacheDType::Fp8;
    o.cache_config->calculate_kv_scales = true;
  });
  const Tensor x = Tensor::from_floats(std::vector<float>(kBatchTokens * kKVHeads * kHeadSize, 3.0f),
                                       {kBatchTokens, kKVHeads, kHeadSize}, DType::F32);
  calculated.layer->calc_kv_scales(x, x, x);
  EXPECT_NE(calculated.layer->quant_state().k_scale_float, 1.0f);
  calculated.layer->process_weights_after_loading(DType::F32);
  EXPECT_EQ(calculated.layer->quant_state().k_scale_float, 1.0f);
  EXPECT_EQ(to_float_vector(calculated.layer->quant_state().v_scale), std::vector<float>{1.0f});
  EXPECT_EQ(fake_impl(*calculated.layer).processed_dtype, DType::F32);

  OneLayer checkpoint(backend, 1, [](AttentionOptions& o) {
    o.quant_config = QuantConfig{.has_kv_cache_scheme = true,
                                 .per_head_scales = true,
                                 .k_scale = std::vector<float>{0.5f, 0.25f},
                                 .v_scale = std::vector<float>{0.125f, 0.0625f},
                                 .q_scale = 2.0f};
  });
  checkpoint.layer->process_weights_after_loading(DType::F32);
  const LayerQuantState& s = checkpoint.layer->quant_state();
  EXPECT_EQ(to_float_vector(s.k_scale), (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(to_float_vector(s.v_scale), (std::vector<float>{0.125f, 0.0625f}));
  EXPECT_EQ(s.k_scale_float, 0.5f);
  EXPECT_EQ(s.v_scale_float, 0.125f);
  EXPECT_EQ(s.q_scale_float, 2.0f);
}

// ------------------------------------------------------- metadata builder

TEST(AttentionMetadataBuilderTest, OneBuildPerBackendShapeGroup) {
  const FakeBackend first;
  const FakeBackend second;
  ModelContext model(f32_model());
  Attention a(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", first));
  Attention b(model, kHeads, kHeadSize, kScale, options_for("layers.1.attn", first));
  Attention c(model, kHeads, kHeadSize, kScale, options_for("layers.2.attn", second));
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  ModelMetadataBuilder builder(model);
  EXPECT_EQ(first.builders_made, 1);
  EXPECT_EQ(second.builders_made, 1);
  const LayerMetadataMap map = builder.build(small_batch());
  EXPECT_EQ(first.builds, 1);
  EXPECT_EQ(second.builds, 1);
  ASSERT_EQ(map.size(), 3u);
  EXPECT_EQ(map.at("layers.0.attn"), map.at("layers.1.attn"));
  EXPECT_NE(map.at("layers.0.attn"), map.at("layers.2.attn"));
  EXPECT_EQ(map.at("layers.2.attn")->common.num_actual_tokens, kBatchTokens);

  ModelMetadataBuilder only_c(model, {"layers.2.attn"});
  EXPECT_EQ(only_c.build(small_batch()).size(), 1u);
  expect_invalid([&] { ModelMetadataBuilder missing(model, {"layers.7.attn"}); },
                 "no layer named 'layers.7.attn'");
}

TEST(AttentionMetadataBuilderTest, RejectsBlocksBeyondTheCache) {
  const FakeBackend backend;
  OneLayer f(backend);
  ModelMetadataBuilder builder(f.model);
  MetadataOptions options;
  options.block_size = kBlock;
  const CommonAttentionMetadata md =
      make_common_metadata(std::vector<RequestSpec>{RequestSpec{2, 2, {kNumBlocks}}}, options);
  expect_invalid([&] { builder.build(md); },
                 "ModelMetadataBuilder::build: block_table[0][0] must be in [0, 8), got 8");
  EXPECT_EQ(backend.builds, 0);
}

// -------------------------------------------------- end to end (REFERENCE)

// Dense causal attention of one query row over a request's K/V history.
std::vector<float> naive_row(const std::vector<float>& q_row /*[H, D]*/,
                             const std::vector<float>& keys /*[S, Hkv, D]*/, const std::vector<float>& values,
                             int visible) {
  constexpr int kGroup = kHeads / kKVHeads;
  std::vector<float> out(kHeads * kHeadSize, 0.0f);
  for (int h = 0; h < kHeads; ++h) {
    const int kvh = h / kGroup;
    std::vector<double> scores(static_cast<std::size_t>(visible));
    double max_score = -INFINITY;
    for (int j = 0; j < visible; ++j) {
      double dot = 0.0;
      for (int d = 0; d < kHeadSize; ++d) {
        dot += static_cast<double>(q_row[h * kHeadSize + d]) * keys[(j * kKVHeads + kvh) * kHeadSize + d];
      }
      scores[static_cast<std::size_t>(j)] = dot * kScale;
      max_score = std::max(max_score, dot * kScale);
    }
    double denom = 0.0;
    for (double& s : scores) {
      s = std::exp(s - max_score);
      denom += s;
    }
    for (int d = 0; d < kHeadSize; ++d) {
      double acc = 0.0;
      for (int j = 0; j < visible; ++j) {
        acc += scores[static_cast<std::size_t>(j)] * values[(j * kKVHeads + kvh) * kHeadSize + d];
      }
      out[h * kHeadSize + d] = static_cast<float>(acc / denom);
    }
  }
  return out;
}

const AttentionBackend& reference_backend() {
  const AttentionBackend* backend = BackendRegistry::instance().find("REFERENCE");
  if (backend == nullptr) throw Error(ErrorKind::Unsupported, "REFERENCE backend is not registered");
  return *backend;
}

// Two decoder layers on REFERENCE (chosen by name through the model), the
// second sharing the first's KV cache, over two steps of a mixed batch; every
// output is compared with dense attention over the tokens seen so far.
TEST(AttentionEndToEnd, TwoStepsMatchDenseAttention) {
  ModelOptions m = f32_model();
  m.backend = "REFERENCE";
  ModelContext model(m);
  AttentionOptions o0 = options_for("model.layers.0.attn", reference_backend());
  o0.attn_backend = nullptr;  // selected through ModelOptions::backend
  Attention layer0(model, kHeads, kHeadSize, kScale, o0);
  AttentionOptions o1 = o0;
  o1.prefix = "model.layers.1.attn";
  o1.kv_sharing_target_layer_name = "model.layers.0.attn";
  Attention layer1(model, kHeads, kHeadSize, kScale, o1);
  ASSERT_EQ(&layer0.backend(), &reference_backend());
  EXPECT_EQ(layer0.extra_repr(),
            "head_size=8, num_heads=4, num_kv_heads=2, scale=0.25, backend=ReferenceAttentionImpl");
  allocate_kv_caches(model, {.num_blocks = kNumBlocks, .reserve_null_block = true});
  ModelMetadataBuilder builder(model);

  const std::vector<std::vector<std::int32_t>> blocks{{3, 1, 6}, {7, 5}};
  const std::vector<std::vector<int>> query_lens{{5, 3}, {1, 2}};
  std::vector<std::vector<float>> key_history(2);
  std::vector<std::vector<float>> value_history(2);
  std::vector<int> seq_lens{0, 0};
  constexpr int kRowKV = kKVHeads * kHeadSize;
  constexpr int kRowQ = kHeads * kHeadSize;
  for (std::size_t step = 0; step < query_lens.size(); ++step) {
    std::vector<RequestSpec> requests;
    int tokens = 0;
    for (std::size_t r = 0; r < 2; ++r) {
      seq_lens[r] += query_lens[step][r];
      requests.push_back(RequestSpec{query_lens[step][r], seq_lens[r], blocks[r]});
      tokens += query_lens[step][r];
    }
    MetadataOptions options;
    options.block_size = kBlock;
    ForwardContext context;
    context.layer_metadata = builder.build(make_common_metadata(requests, options));
    ForwardContextScope scope(std::move(context));

    const Tensor q0 = make_tensor({tokens, kRowQ}, 10 + static_cast<unsigned>(step));
    const Tensor q1 = make_tensor({tokens, kHeads, kHeadSize}, 20 + static_cast<unsigned>(step));
    const Tensor k = make_tensor({tokens, kRowKV}, 30 + static_cast<unsigned>(step));
    const Tensor v = make_tensor({tokens, kRowKV}, 40 + static_cast<unsigned>(step));
    const Tensor out0 = layer0.forward(q0, k, v);
    const Tensor out1 = layer1.forward(q1, k, v);

    const std::vector<float> kf = to_float_vector(k);
    const std::vector<float> vf = to_float_vector(v);
    const std::vector<float> q0f = to_float_vector(q0);
    const std::vector<float> q1f = to_float_vector(q1);
    const std::vector<float> o0f = to_float_vector(out0);
    const std::vector<float> o1f = to_float_vector(out1);
    int token = 0;
    for (std::size_t r = 0; r < 2; ++r) {
      const int q_len = query_lens[step][r];
      key_history[r].insert(key_history[r].end(), kf.begin() + token * kRowKV,
                            kf.begin() + (token + q_len) * kRowKV);
      value_history[r].insert(value_history[r].end(), vf.begin() + token * kRowKV,
                              vf.begin() + (token + q_len) * kRowKV);
      for (int i = 0; i < q_len; ++i, ++token) {
        const int visible = seq_lens[r] - q_len + i + 1;
        for (const auto& [qf, of] : {std::pair{&q0f, &o0f}, std::pair{&q1f, &o1f}}) {
          const std::vector<float> q_row(qf->begin() + token * kRowQ, qf->begin() + (token + 1) * kRowQ);
          const std::vector<float> expected = naive_row(q_row, key_history[r], value_history[r], visible);
          for (int e = 0; e < kRowQ; ++e) {
            ASSERT_NEAR((*of)[static_cast<std::size_t>(token * kRowQ + e)],
                        expected[static_cast<std::size_t>(e)], 1e-5f)
                << "step " << step << " request " << r << " token " << i << " element " << e;
          }
        }
      }
    }
  }
}

TEST(AttentionEndToEnd, RejectedForwardLeavesTheReferenceCacheUntouched) {
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, kScale, options_for("layers.0.attn", reference_backend()));
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  ForwardContextScope scope(context_with(small_batch()));
  const Tensor q = make_tensor({kBatchTokens, kHeads, kHeadSize}, 1);
  const Tensor k = make_tensor({kBatchTokens, kKVHeads, kHeadSize}, 2);
  layer.forward(q, k, k);
  const std::vector<std::uint8_t> snapshot = to_byte_vector(layer.kv_cache(0));
  const Tensor wide_k = make_tensor({kBatchTokens, kKVHeads + 1, kHeadSize}, 3);
  expect_invalid([&] { layer.forward(q, wide_k, wide_k); }, "key size(1) must be 2");
  EXPECT_EQ(to_byte_vector(layer.kv_cache(0)), snapshot);
}

}  // namespace
}  // namespace pagedattn
