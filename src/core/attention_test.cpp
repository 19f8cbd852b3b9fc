// The Attention layer's constructor (semantics, errors, KV sharing, windows,
// quantization, backend choice) and the model's metadata builder. Forward
// and end-to-end runs have their own files (attention_*_test.cpp).
#include <gtest/gtest.h>
#include <fmt/format.h>
#include <pagedattn/attention.h>

#include <string>
#include <vector>

#include "core/attention_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

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

// vLLM's layer quantizes the query for fp8 / fp8_e4m3 caches when the impl
// takes fp8 queries; never for e5m2 or per-token-head caches, never for an
// impl without the support, and not for attention that does not read the
// cache.
TEST(AttentionCtor, QuantizesTheQueryForE4m3PerTensorCachesOfAnImplThatTakesThem) {
  const FakeBackend takes({.quant_query_input = true});
  const FakeBackend plain;
  ModelContext model(f32_model());
  int n = 0;
  for (const CacheDType dtype : all_cache_dtypes()) {
    if (dtype == CacheDType::Float16 || dtype == CacheDType::BFloat16) continue;  // not an f32 model's cache
    const bool e4m3_per_tensor = dtype == CacheDType::Fp8 || dtype == CacheDType::Fp8E4M3;
    EXPECT_EQ(quantizes_query_for(dtype, AttentionType::Decoder), e4m3_per_tensor) << cache_dtype_name(dtype);
    EXPECT_EQ(quantizes_query_for(dtype, AttentionType::EncoderDecoder), e4m3_per_tensor) << cache_dtype_name(dtype);
    EXPECT_FALSE(quantizes_query_for(dtype, AttentionType::Encoder)) << cache_dtype_name(dtype);
    EXPECT_FALSE(quantizes_query_for(dtype, AttentionType::EncoderOnly)) << cache_dtype_name(dtype);
    for (const FakeBackend* backend : {&takes, &plain}) {
      AttentionOptions o = options_for(fmt::format("layers.{}.attn", n++), *backend);
      o.cache_config->cache_dtype = dtype;
      const Attention layer(model, kHeads, kHeadSize, kScale, o);
      EXPECT_EQ(layer.quantizes_query(), e4m3_per_tensor && backend == &takes) << cache_dtype_name(dtype);
      EXPECT_EQ(layer.impl().quantizes_query(), e4m3_per_tensor && backend == &takes) << cache_dtype_name(dtype);
    }
  }
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

}  // namespace
}  // namespace pagedattn::test
