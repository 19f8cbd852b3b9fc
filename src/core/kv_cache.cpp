// KV-cache spec sizes and the allocation/binding of every layer's cache.
#include <pagedattn/attention.h>
#include <pagedattn/kv_cache.h>

#include <algorithm>

namespace pagedattn {
namespace {

std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

std::size_t page_bytes(int block_size, int num_kv_heads, int head_size, int head_size_v, DType dtype) {
  return static_cast<std::size_t>(block_size) * static_cast<std::size_t>(num_kv_heads) *
         static_cast<std::size_t>(head_size + head_size_v) * dtype_size(dtype);
}

std::size_t checked_limit(int value, std::string_view name) {
  check_arg(value >= 0, "max_memory_usage_bytes", name, ">= 0", value);
  return static_cast<std::size_t>(value);
}

// Follows KV-sharing targets to the layer that owns the cache.
const Attention& cache_owner(const ModelContext& model, const Attention& layer) {
  const Attention* current = &layer;
  // Targets are registered before their sharers, so a chain is at most as
  // long as the model; anything longer is a cycle left by re-registration.
  for (std::size_t hops = 0; hops <= model.layers().size(); ++hops) {
    const auto& target = current->kv_sharing_target_layer_name();
    if (!target) return *current;
    const Attention* next = model.find_layer(*target);
    if (next == nullptr) {
      throw_invalid("allocate_kv_caches", fmt::format("{} kv_sharing_target_layer_name", layer.layer_name()),
                    "a registered layer", *target);
    }
    current = next;
  }
  throw_invalid("allocate_kv_caches", fmt::format("{} kv_sharing_target_layer_name", layer.layer_name()),
                "a chain ending at a cache-owning layer", "a cycle");
}

}  // namespace

std::size_t FullAttentionSpec::page_size_bytes() const {
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype);
}

std::size_t FullAttentionSpec::max_memory_usage_bytes(const KVCacheLimits& limits) const {
  const std::size_t tokens = checked_limit(limits.max_model_len, "max_model_len");
  return ceil_div(tokens, static_cast<std::size_t>(block_size)) * page_size_bytes();
}

std::size_t SlidingWindowSpec::page_size_bytes() const {
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype);
}

std::size_t SlidingWindowSpec::max_memory_usage_bytes(const KVCacheLimits& limits) const {
  const std::size_t max_len = checked_limit(limits.max_model_len, "max_model_len");
  const std::size_t batched = checked_limit(limits.max_num_batched_tokens, "max_num_batched_tokens");
  const std::size_t window_tokens = static_cast<std::size_t>(std::max(sliding_window - 1, 0)) + batched;
  const std::size_t blocks =
      ceil_div(std::min(window_tokens, max_len), static_cast<std::size_t>(block_size)) + 1;
  return blocks * page_size_bytes();
}

std::size_t CrossAttentionSpec::page_size_bytes() const {
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype);
}

std::size_t CrossAttentionSpec::max_memory_usage_bytes(const KVCacheLimits& limits) const {
  const std::size_t tokens =
      checked_limit(limits.max_num_encoder_input_tokens, "max_num_encoder_input_tokens");
  return ceil_div(tokens, static_cast<std::size_t>(block_size)) * page_size_bytes();
}

std::size_t page_size_bytes(const KVCacheSpec& spec) {
  return std::visit([](const auto& s) { return s.page_size_bytes(); }, spec);
}

std::size_t max_memory_usage_bytes(const KVCacheSpec& spec, const KVCacheLimits& limits) {
  return std::visit([&](const auto& s) { return s.max_memory_usage_bytes(limits); }, spec);
}

int spec_block_size(const KVCacheSpec& spec) {
  return std::visit([](const auto& s) { return s.block_size; }, spec);
}

std::string_view spec_kind_name(const KVCacheSpec& spec) {
  struct Namer {
    std::string_view operator()(const FullAttentionSpec&) const { return "full_attention"; }
    std::string_view operator()(const SlidingWindowSpec&) const { return "sliding_window"; }
    std::string_view operator()(const CrossAttentionSpec&) const { return "cross_attention"; }
  };
  return std::visit(Namer{}, spec);
}

KVCacheAllocation allocate_kv_caches(ModelContext& model, const KVCacheAllocationOptions& options) {
  constexpr std::string_view where = "allocate_kv_caches";
  const std::int64_t min_blocks = options.reserve_null_block ? 2 : 1;
  check_arg(
      options.num_blocks >= min_blocks, where, "num_blocks",
      fmt::format(">= {}{}", min_blocks, options.reserve_null_block ? " (block 0 is the null block)" : ""),
      options.num_blocks);

  KVCacheAllocation result;
  result.num_blocks = options.num_blocks;
  result.first_usable_block = options.reserve_null_block ? kNullBlockId + 1 : 0;
  const int engines = model.pipeline_parallel_size();
  for (Attention* layer : model.layers()) {
    if (!layer->get_kv_cache_spec()) continue;
    const AttentionBackend& backend = layer->backend();
    const Dims shape = backend.kv_cache_shape(options.num_blocks, layer->block_size(), layer->num_kv_heads(),
                                              layer->head_size(), layer->kv_cache_dtype());
    const std::vector<int> order = backend.kv_cache_stride_order(layer->kv_cache_layout());
    for (int engine = 0; engine < engines; ++engine) {
      const Tensor cache =
          Tensor::empty_strided_order(shape, order, layer->kv_cache_storage_dtype(), model.device());
      device_allocator(model.device().type).memset(cache.data(), model.device(), 0, cache.span_bytes());
      layer->bind_kv_cache(engine, cache);
      result.bytes += cache.span_bytes();
    }
    ++result.num_cache_layers;
  }
  for (Attention* layer : model.layers()) {
    if (!layer->kv_sharing_target_layer_name()) continue;
    const Attention& owner = cache_owner(model, *layer);
    for (int engine = 0; engine < engines; ++engine) {
      const Tensor& cache = owner.kv_cache(engine);
      check_arg(cache.defined(), where, fmt::format("{} kv_sharing_target_layer_name", layer->layer_name()),
                "a layer that owns a KV cache", owner.layer_name());
      layer->bind_kv_cache(engine, cache);
    }
    ++result.num_shared_layers;
  }
  return result;
}

std::size_t kv_cache_bytes_per_block(const ModelContext& model) {
  std::size_t bytes = 0;
  for (const Attention* layer : model.layers()) {
    if (const auto spec = layer->get_kv_cache_spec()) bytes += page_size_bytes(*spec);
  }
  return bytes;
}

}  // namespace pagedattn
