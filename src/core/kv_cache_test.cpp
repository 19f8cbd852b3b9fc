// KV-cache specs, and allocation/binding of the layers' caches.
#include <gtest/gtest.h>
#include <pagedattn/attention.h>
#include <pagedattn/kv_cache.h>

#include <cstddef>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "testing/expect_error.h"

namespace pagedattn {
namespace {

using test::expect_invalid;

// ------------------------------------------------------------------- specs

TEST(KVCacheSpec, Llama3PageSize) {
  // Llama-3-8B, bf16, BS 16, Hkv 8, D 128: 2 * 16 * 8 * 128 * 2 bytes.
  const FullAttentionSpec full{.block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16};
  EXPECT_EQ(full.head_size_v, 128);
  EXPECT_EQ(full.page_size_bytes(), 65536u);
  const SlidingWindowSpec window{
      .block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16, .sliding_window = 4096};
  EXPECT_EQ(window.page_size_bytes(), 65536u);
  const CrossAttentionSpec cross{
      .block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::FP8_E4M3};
  EXPECT_EQ(cross.page_size_bytes(), 32768u);
  EXPECT_EQ(page_size_bytes(KVCacheSpec{full}), 65536u);
  EXPECT_EQ(spec_block_size(KVCacheSpec{cross}), 16);
  EXPECT_EQ(spec_kind_name(KVCacheSpec{full}), "full_attention");
  EXPECT_EQ(spec_kind_name(KVCacheSpec{window}), "sliding_window");
  EXPECT_EQ(spec_kind_name(KVCacheSpec{cross}), "cross_attention");
}

TEST(KVCacheSpec, MaxMemoryUsage) {
  const KVCacheLimits limits{
      .max_model_len = 8192, .max_num_batched_tokens = 2048, .max_num_encoder_input_tokens = 1500};
  const FullAttentionSpec full{.block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16};
  EXPECT_EQ(full.max_memory_usage_bytes(limits), 512u * 65536u);
  // ceil(min(4095 + 2048, 8192) / 16) + 1 = 385 blocks.
  const SlidingWindowSpec window{
      .block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16, .sliding_window = 4096};
  EXPECT_EQ(window.max_memory_usage_bytes(limits), 385u * 65536u);
  // A window wider than the model length is capped by it.
  const SlidingWindowSpec wide{
      .block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16, .sliding_window = 100000};
  EXPECT_EQ(max_memory_usage_bytes(KVCacheSpec{wide}, limits), 513u * 65536u);
  const CrossAttentionSpec cross{.block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16};
  EXPECT_EQ(cross.max_memory_usage_bytes(limits), 94u * 65536u);
  expect_invalid([&] { full.max_memory_usage_bytes(KVCacheLimits{.max_model_len = -1}); }, "max_model_len");
}

TEST(KVCacheSpec, PerTokenHeadPagesHoldTheirScales) {
  // BS 16, Hkv 8, D 128: 2 * 16 * 8 * 128 one-byte elements, plus one f32
  // scale per (slot, KV head) for K and for V: 2 * 16 * 8 * 4 bytes.
  for (const auto& [dtype, mode] : {std::pair{DType::I8, KVQuantMode::Int8PerTokenHead},
                                    std::pair{DType::FP8_E4M3, KVQuantMode::Fp8PerTokenHead}}) {
    const FullAttentionSpec full{
        .block_size = 16, .num_kv_heads = 8, .head_size = 128, .dtype = dtype, .kv_quant_mode = mode};
    EXPECT_EQ(full.page_size_bytes(), 32768u + 1024u);
    const SlidingWindowSpec window{.block_size = 16,
                                   .num_kv_heads = 8,
                                   .head_size = 128,
                                   .dtype = dtype,
                                   .kv_quant_mode = mode,
                                   .sliding_window = 64};
    EXPECT_EQ(window.page_size_bytes(), 32768u + 1024u);
  }
  // Per-tensor fp8 keeps its scales in the layer, not the page.
  const CrossAttentionSpec per_tensor{.block_size = 16,
                                      .num_kv_heads = 8,
                                      .head_size = 128,
                                      .dtype = DType::FP8_E4M3,
                                      .kv_quant_mode = KVQuantMode::Fp8PerTensor};
  EXPECT_EQ(per_tensor.page_size_bytes(), 32768u);
}

TEST(KVCacheSpec, PageSizeOverflowIsAnError) {
  constexpr int kHuge = std::numeric_limits<int>::max();
  const FullAttentionSpec huge{.block_size = kHuge,
                               .num_kv_heads = kHuge,
                               .head_size = kHuge,
                               .dtype = DType::I8,
                               .kv_quant_mode = KVQuantMode::Int8PerTokenHead};
  expect_invalid([&] { static_cast<void>(huge.page_size_bytes()); },
                 "page_size_bytes: page size must be a size that fits in size_t");
  const FullAttentionSpec empty{.block_size = 0, .num_kv_heads = 8, .head_size = 128, .dtype = DType::BF16};
  expect_invalid([&] { static_cast<void>(empty.page_size_bytes()); }, "must be > 0, got 0, 8, 128, 128");
}

// -------------------------------------------------------------- allocation

// Declares the default KV-cache shape and stride orders; never runs attention.
class ShapeOnlyImpl final : public AttentionImpl {
 public:
  using AttentionImpl::AttentionImpl;
  void check_forward(const LayerQuantState&, const TensorView&, const TensorView&, const TensorView&,
                     const KVCacheView&, const BackendMetadata&, const TensorView&, const TensorView&) const override {}
  void forward(const LayerQuantState&, const TensorView&, const TensorView&, const TensorView&,
               const KVCacheView&, const BackendMetadata&, const TensorView&, const TensorView&) override {}
  void do_kv_cache_update(const LayerQuantState&, const TensorView&, const TensorView&, const KVCacheView&,
                          const TensorView&) override {}
  std::string_view class_name() const override { return "ShapeOnlyImpl"; }
};

class ShapeOnlyBackend final : public AttentionBackend {
 public:
  explicit ShapeOnlyBackend(std::optional<KVCacheLayout> required = std::nullopt) : required_(required) {}
  std::string_view name() const override { return "SHAPE_ONLY"; }
  DeviceType device_type() const override { return DeviceType::CPU; }
  std::string_view description() const override { return "test backend"; }
  std::vector<DType> supported_dtypes() const override { return {DType::F32, DType::F16, DType::BF16}; }
  std::vector<CacheDType> supported_kv_cache_dtypes() const override { return {}; }
  bool supports_attn_type(AttentionType) const override { return true; }
  std::optional<KVCacheLayout> required_kv_cache_layout() const override { return required_; }
  ProblemSupport problem_support(const AttentionProblem&) const override { return {}; }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<ShapeOnlyImpl>(params);
  }
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams&) const override {
    return nullptr;
  }

 private:
  std::optional<KVCacheLayout> required_;
};

constexpr int kHeads = 4;
constexpr int kKVHeads = 2;
constexpr int kHeadSize = 8;
constexpr int kBlock = 4;
constexpr std::int64_t kNumBlocks = 6;

AttentionOptions layer_options(const std::string& prefix, const AttentionBackend& backend,
                               std::optional<KVCacheLayout> layout = KVCacheLayout::NHD) {
  AttentionOptions o;
  o.num_kv_heads = kKVHeads;
  o.cache_config = CacheConfig{};
  o.cache_config->block_size = kBlock;
  o.cache_config->kv_cache_layout = layout;
  o.prefix = prefix;
  o.attn_backend = &backend;
  return o;
}

ModelOptions f32_model(int pipeline_parallel_size = 1) {
  ModelOptions m;
  m.dtype = DType::F32;
  m.pipeline_parallel_size = pipeline_parallel_size;
  return m;
}

bool all_zero(const TensorView& t) {
  for (std::uint8_t b : to_byte_vector(t)) {
    if (b != 0) return false;
  }
  return true;
}

TEST(KVCacheAllocation, NHDShapeAndStrides) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, 0.5f, layer_options("layers.0.attn", backend));
  const KVCacheAllocation alloc = allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  EXPECT_EQ(alloc.num_cache_layers, 1);
  EXPECT_EQ(alloc.bytes, static_cast<std::size_t>(2 * kNumBlocks * kBlock * kKVHeads * kHeadSize * 4));
  const Tensor& cache = layer.kv_cache(0);
  EXPECT_EQ(cache.shape(), (Dims{2, kNumBlocks, kBlock, kKVHeads, kHeadSize}));
  EXPECT_EQ(cache.dtype(), DType::F32);
  const KVCacheView& kv = layer.kv_cache_view(0);
  EXPECT_EQ(kv.key.shape(), (Dims{kNumBlocks, kBlock, kKVHeads, kHeadSize}));
  EXPECT_EQ(kv.key.strides(), (Dims{kBlock * kKVHeads * kHeadSize, kKVHeads * kHeadSize, kHeadSize, 1}));
  EXPECT_EQ(kv.num_blocks(), kNumBlocks);
  EXPECT_EQ(kv.block_size(), kBlock);
  EXPECT_TRUE(all_zero(cache));
  EXPECT_EQ(kv_cache_bytes_per_block(model), static_cast<std::size_t>(2 * kBlock * kKVHeads * kHeadSize * 4));
}

TEST(KVCacheAllocation, HNDStrides) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, 0.5f,
                  layer_options("layers.0.attn", backend, KVCacheLayout::HND));
  EXPECT_EQ(layer.kv_cache_layout(), KVCacheLayout::HND);
  allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  // Physical [2, NB, Hkv, BS, D], viewed logically as [NB, BS, Hkv, D] per half.
  const KVCacheView& kv = layer.kv_cache_view(0);
  EXPECT_EQ(kv.key.shape(), (Dims{kNumBlocks, kBlock, kKVHeads, kHeadSize}));
  EXPECT_EQ(kv.key.strides(), (Dims{kKVHeads * kBlock * kHeadSize, kHeadSize, kBlock * kHeadSize, 1}));
  EXPECT_EQ(static_cast<std::uint8_t*>(kv.value.data()) - static_cast<std::uint8_t*>(kv.key.data()),
            kNumBlocks * kBlock * kKVHeads * kHeadSize * 4);
}

TEST(KVCacheAllocation, LayoutPrecedence) {
  const ShapeOnlyBackend free_backend;
  const ShapeOnlyBackend hnd_backend(KVCacheLayout::HND);
  ModelContext model(f32_model());
  ASSERT_EQ(setenv(kKVCacheLayoutEnv, "HND", 1), 0);
  Attention from_env(model, kHeads, kHeadSize, 0.5f, layer_options("env", free_backend, std::nullopt));
  Attention explicit_nhd(model, kHeads, kHeadSize, 0.5f, layer_options("explicit", free_backend));
  ASSERT_EQ(setenv(kKVCacheLayoutEnv, "diagonal", 1), 0);
  expect_invalid(
      [&] {
        Attention bad(model, kHeads, kHeadSize, 0.5f, layer_options("bad", free_backend, std::nullopt));
      },
      "PAGEDATTN_KV_CACHE_LAYOUT must be NHD or HND, got diagonal");
  ASSERT_EQ(unsetenv(kKVCacheLayoutEnv), 0);
  Attention required(model, kHeads, kHeadSize, 0.5f, layer_options("required", hnd_backend));
  Attention by_default(model, kHeads, kHeadSize, 0.5f, layer_options("default", free_backend, std::nullopt));
  EXPECT_EQ(from_env.kv_cache_layout(), KVCacheLayout::HND);
  EXPECT_EQ(explicit_nhd.kv_cache_layout(), KVCacheLayout::NHD);
  EXPECT_EQ(required.kv_cache_layout(), KVCacheLayout::HND);
  EXPECT_EQ(by_default.kv_cache_layout(), KVCacheLayout::NHD);
  EXPECT_EQ(model.find_layer("bad"), nullptr);
}

TEST(KVCacheAllocation, SharingLayersBindTheTargetsTensor) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention first(model, kHeads, kHeadSize, 0.5f, layer_options("layers.0.attn", backend));
  AttentionOptions sharing = layer_options("layers.1.attn", backend);
  sharing.kv_sharing_target_layer_name = "layers.0.attn";
  Attention second(model, kHeads, kHeadSize, 0.5f, sharing);
  AttentionOptions chained = layer_options("layers.2.attn", backend);
  chained.kv_sharing_target_layer_name = "layers.1.attn";
  Attention third(model, kHeads, kHeadSize, 0.5f, chained);
  AttentionOptions encoder = layer_options("layers.3.attn", backend);
  encoder.attn_type = AttentionType::EncoderOnly;
  Attention fourth(model, kHeads, kHeadSize, 0.5f, encoder);

  const KVCacheAllocation alloc = allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  EXPECT_EQ(alloc.num_cache_layers, 1);
  EXPECT_EQ(alloc.num_shared_layers, 2);
  EXPECT_EQ(second.kv_cache(0).data(), first.kv_cache(0).data());
  EXPECT_EQ(third.kv_cache(0).data(), first.kv_cache(0).data());
  EXPECT_FALSE(fourth.kv_cache(0).defined());
  EXPECT_EQ(kv_cache_bytes_per_block(model), static_cast<std::size_t>(2 * kBlock * kKVHeads * kHeadSize * 4));
}

TEST(KVCacheAllocation, OneCachePerVirtualEngine) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model(2));
  Attention layer(model, kHeads, kHeadSize, 0.5f, layer_options("layers.0.attn", backend));
  EXPECT_EQ(layer.num_virtual_engines(), 2);
  EXPECT_FALSE(layer.kv_cache(1).defined());
  const KVCacheAllocation alloc = allocate_kv_caches(model, {.num_blocks = kNumBlocks});
  EXPECT_EQ(alloc.bytes, static_cast<std::size_t>(2 * 2 * kNumBlocks * kBlock * kKVHeads * kHeadSize * 4));
  ASSERT_TRUE(layer.kv_cache(0).defined());
  ASSERT_TRUE(layer.kv_cache(1).defined());
  EXPECT_NE(layer.kv_cache(0).data(), layer.kv_cache(1).data());
  expect_invalid([&] { layer.kv_cache(2); }, "virtual_engine must be in [0, 2), got 2");
}

TEST(KVCacheAllocation, NullBlockAndBlockCount) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, 0.5f, layer_options("layers.0.attn", backend));
  const KVCacheAllocation alloc = allocate_kv_caches(model, {.num_blocks = 2, .reserve_null_block = true});
  EXPECT_EQ(alloc.first_usable_block, 1);
  EXPECT_EQ(allocate_kv_caches(model, {.num_blocks = 1}).first_usable_block, 0);
  expect_invalid([&] { allocate_kv_caches(model, {.num_blocks = 1, .reserve_null_block = true}); },
                 "allocate_kv_caches: num_blocks must be >= 2 (block 0 is the null block), got 1");
  expect_invalid([&] { allocate_kv_caches(model, {.num_blocks = 0}); }, "num_blocks must be >= 1, got 0");
}

TEST(KVCacheAllocation, BindRejectsForeignTensors) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, 0.5f, layer_options("layers.0.attn", backend));
  const Tensor bf16 = Tensor::zeros({2, kNumBlocks, kBlock, kKVHeads, kHeadSize}, DType::BF16);
  expect_invalid([&] { layer.bind_kv_cache(0, bf16); }, "kv_cache dtype must be f32, got bf16");
  const Tensor wrong_block = Tensor::zeros({2, kNumBlocks, kBlock * 2, kKVHeads, kHeadSize}, DType::F32);
  expect_invalid([&] { layer.bind_kv_cache(0, wrong_block); }, "kv_cache key half size(1) must be 4");
  const Tensor wrong_heads = Tensor::zeros({2, kNumBlocks, kBlock, kKVHeads + 1, kHeadSize}, DType::F32);
  expect_invalid([&] { layer.bind_kv_cache(0, wrong_heads); }, "kv_cache key half size(2) must be 2");
  expect_invalid([&] { layer.bind_kv_cache(1, wrong_heads); }, "virtual_engine must be in [0, 1), got 1");
  EXPECT_FALSE(layer.kv_cache(0).defined());
}

AttentionOptions int8_layer_options(const std::string& prefix, const AttentionBackend& backend) {
  AttentionOptions o = layer_options(prefix, backend);
  o.cache_config->cache_dtype = CacheDType::Int8PerTokenHead;
  return o;
}

TEST(KVCacheAllocation, PerTokenHeadScalesShareTheLayersAllocation) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention layer(model, kHeads, kHeadSize, 0.5f, int8_layer_options("layers.0.attn", backend));
  AttentionOptions sharing = int8_layer_options("layers.1.attn", backend);
  sharing.kv_sharing_target_layer_name = "layers.0.attn";
  Attention second(model, kHeads, kHeadSize, 0.5f, sharing);
  const KVCacheAllocation alloc = allocate_kv_caches(model, {.num_blocks = kNumBlocks});

  const Tensor& cache = layer.kv_cache(0);
  const Tensor& scales = layer.kv_cache_scales(0);
  EXPECT_EQ(cache.dtype(), DType::I8);
  EXPECT_EQ(scales.shape(), (Dims{kNumBlocks, 2, kKVHeads, kBlock}));
  EXPECT_EQ(scales.dtype(), DType::F32);
  EXPECT_EQ(scales.storage(), cache.storage());
  // The scales start at the K/V bytes rounded up to kScaleRegionAlign.
  constexpr std::size_t kDataBytes = 2 * kNumBlocks * kBlock * kKVHeads * kHeadSize;
  constexpr std::size_t kScaleOffset =
      (kDataBytes + kScaleRegionAlign - 1) / kScaleRegionAlign * kScaleRegionAlign;
  EXPECT_EQ(static_cast<const std::uint8_t*>(scales.data()) - static_cast<const std::uint8_t*>(cache.data()),
            static_cast<std::ptrdiff_t>(kScaleOffset));
  EXPECT_EQ(alloc.bytes, kScaleOffset + kNumBlocks * 2 * kBlock * kKVHeads * sizeof(float));
  EXPECT_TRUE(all_zero(cache));
  EXPECT_TRUE(all_zero(scales));

  const KVCacheView& kv = layer.kv_cache_view(0);
  // [NB, Hkv, BS]: one KV head's scales of a block are contiguous.
  EXPECT_EQ(kv.key_scale.shape(), (Dims{kNumBlocks, kKVHeads, kBlock}));
  EXPECT_EQ(kv.key_scale.strides(), (Dims{2 * kKVHeads * kBlock, kBlock, 1}));
  EXPECT_EQ(kv.value_scale.strides(), kv.key_scale.strides());
  EXPECT_EQ(static_cast<const float*>(kv.value_scale.data()) - static_cast<const float*>(kv.key_scale.data()),
            kBlock * kKVHeads);
  EXPECT_EQ(second.kv_cache_scales(0).data(), scales.data());
  EXPECT_EQ(second.kv_cache_view(0).key_scale.data(), kv.key_scale.data());
  EXPECT_EQ(kv_cache_bytes_per_block(model),
            static_cast<std::size_t>(2 * kBlock * kKVHeads * kHeadSize + 2 * kBlock * kKVHeads * 4));
}

TEST(KVCacheAllocation, BindChecksPerTokenHeadScales) {
  const ShapeOnlyBackend backend;
  ModelContext model(f32_model());
  Attention int8(model, kHeads, kHeadSize, 0.5f, int8_layer_options("layers.0.attn", backend));
  Attention plain(model, kHeads, kHeadSize, 0.5f, layer_options("layers.1.attn", backend));
  const Tensor i8_cache = Tensor::zeros({2, kNumBlocks, kBlock, kKVHeads, kHeadSize}, DType::I8);
  const Tensor scales = Tensor::zeros({kNumBlocks, 2, kKVHeads, kBlock}, DType::F32);
  expect_invalid(
      [&] { int8.bind_kv_cache(0, i8_cache); },
      "kv_scales must be a [NB, 2, 2, 4] f32 tensor ([num_blocks, 2, num_kv_heads, block_size]) for "
      "kv_cache_dtype int8_per_token_head, got undefined");
  const Tensor short_scales = Tensor::zeros({kNumBlocks - 1, 2, kKVHeads, kBlock}, DType::F32);
  expect_invalid([&] { int8.bind_kv_cache(0, i8_cache, short_scales); },
                 "kv_scales shape must be [6, 2, 2, 4] ([num_blocks, 2, num_kv_heads, block_size]), got "
                 "[5, 2, 2, 4]");
  const Tensor slot_major = Tensor::zeros({kNumBlocks, 2, kBlock, kKVHeads}, DType::F32);  // [NB, 2, BS, Hkv]
  expect_invalid([&] { int8.bind_kv_cache(0, i8_cache, slot_major); },
                 "unbind_kv_cache: kv_scales shape must be [6, 2, 2, 4] ([num_blocks, 2, num_kv_heads, "
                 "block_size]), got [6, 2, 4, 2]");
  const Tensor i8_scales = Tensor::zeros({kNumBlocks, 2, kKVHeads, kBlock}, DType::I8);
  expect_invalid([&] { int8.bind_kv_cache(0, i8_cache, i8_scales); }, "kv_scales dtype must be f32, got i8");
  EXPECT_FALSE(int8.kv_cache(0).defined());
  const Tensor f32_cache = Tensor::zeros({2, kNumBlocks, kBlock, kKVHeads, kHeadSize}, DType::F32);
  expect_invalid([&] { plain.bind_kv_cache(0, f32_cache, scales); },
                 "kv_scales must be undefined for kv_cache_dtype auto");
  int8.bind_kv_cache(0, i8_cache, scales);
  EXPECT_EQ(int8.kv_cache_view(0).key_scale.data(), scales.data());
}

}  // namespace
}  // namespace pagedattn
