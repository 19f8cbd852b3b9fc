// Helpers shared by the Attention layer tests (attention_*test.cpp): the
// layer's shape constants, a fake backend that copies q to the output and
// records what the layer handed it, a small mixed batch, and one-layer models.
#pragma once

#include <pagedattn/attention.h>
#include <pagedattn/ops.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagedattn::test {

inline constexpr int kHeads = 4;
inline constexpr int kKVHeads = 2;
inline constexpr int kHeadSize = 8;
inline constexpr int kBlock = 4;
inline constexpr std::int64_t kNumBlocks = 8;
inline constexpr float kScale = 0.25f;

// ------------------------------------------------------------ fake backend

// Copies the query to the output and stores K/V with reshape_and_cache, and
// records what the layer handed it.
class FakeImpl final : public AttentionImpl {
 public:
  FakeImpl(const AttentionImplParams& params, bool quant_query_input)
      : AttentionImpl(params), quant_query_input_(quant_query_input) {}

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
  bool supports_quant_query_input() const override { return quant_query_input_; }
  std::string_view class_name() const override { return "FakeAttentionImpl"; }

  int forward_calls = 0;
  int update_calls = 0;
  const void* last_kv_key = nullptr;
  const BackendMetadata* last_metadata = nullptr;
  std::optional<DType> processed_dtype;

 private:
  bool quant_query_input_;
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
  bool quant_query_input = false;  // the impl's supports_quant_query_input()
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
  ProblemSupport problem_support(const AttentionProblem&) const override {
    ProblemSupport plan;
    if (!features_.supported) plan.reasons.emplace_back("fake kernel disabled");
    return plan;
  }
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override {
    return std::make_unique<FakeImpl>(params, features_.quant_query_input);
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

inline FakeImpl& fake_impl(Attention& layer) { return dynamic_cast<FakeImpl&>(layer.impl()); }

inline ModelOptions f32_model(int pipeline_parallel_size = 1) {
  ModelOptions m;
  m.dtype = DType::F32;
  m.pipeline_parallel_size = pipeline_parallel_size;
  return m;
}

inline AttentionOptions options_for(const std::string& prefix, const AttentionBackend& backend) {
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
inline std::vector<float> pattern(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  std::uint32_t state = 2654435761u * (seed + 1u);
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    x = static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
  }
  return v;
}

inline Tensor make_tensor(Dims shape, unsigned seed, DType dtype = DType::F32) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return Tensor::from_floats(pattern(static_cast<std::size_t>(n), seed), shape, dtype);
}

// What a builder of a backend without metadata of its own makes of `common`.
inline std::shared_ptr<const BackendMetadata> as_backend_metadata(const CommonAttentionMetadata& common) {
  auto md = std::make_shared<BackendMetadata>();
  adopt_step("test", common, *md);
  return md;
}

// Two requests on a 4-slot block size: a decode at position 5 (blocks 2, 6)
// and a 3-token prefill (block 4): 4 tokens.
inline CommonAttentionMetadata small_batch() {
  MetadataOptions options;
  options.block_size = kBlock;
  const std::vector<RequestSpec> requests{RequestSpec{1, 6, {2, 6}}, RequestSpec{3, 3, {4}}};
  return make_common_metadata(requests, options);
}
inline constexpr std::int64_t kBatchTokens = 4;

inline ForwardContext context_with(CommonAttentionMetadata common, int virtual_engine = 0) {
  ForwardContext context;
  context.metadata = as_backend_metadata(std::move(common));
  context.virtual_engine = virtual_engine;
  return context;
}

// The cache row of one slot, [Hkv, D] as floats.
inline std::vector<float> cache_row(const TensorView& cache_half, std::int64_t slot) {
  return to_float_vector(cache_half.select(0, slot / kBlock).select(0, slot % kBlock));
}

inline std::vector<float> token_row(const TensorView& t3, std::int64_t token) {
  return to_float_vector(t3.select(0, token));
}

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

}  // namespace pagedattn::test
