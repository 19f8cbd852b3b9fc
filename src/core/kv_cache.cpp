// KV-cache spec sizes and the allocation/binding of every layer's cache.
#include <pagedattn/attention.h>
#include <pagedattn/kv_cache.h>

#include <algorithm>
#include <array>
#include <limits>

namespace pagedattn {
namespace {

constexpr int kNumKvHalves = 2;
constexpr std::size_t kScaleBytes = sizeof(float);

std::size_t ceil_div(std::size_t a, std::size_t b) { return (a + b - 1) / b; }

// a * b, or InvalidArgument naming `what` when it overflows size_t.
std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view where, std::string_view what) {
  check_arg(b == 0 || a <= std::numeric_limits<std::size_t>::max() / b, where, what,
            "a size that fits in size_t", fmt::format("{} * {}", a, b));
  return a * b;
}

std::size_t checked_add(std::size_t a, std::size_t b, std::string_view where, std::string_view what) {
  check_arg(a <= std::numeric_limits<std::size_t>::max() - b, where, what, "a size that fits in size_t",
            fmt::format("{} + {}", a, b));
  return a + b;
}

std::size_t page_bytes(int block_size, int num_kv_heads, int head_size, int head_size_v, DType dtype,
                       KVQuantMode mode) {
  constexpr std::string_view where = "page_size_bytes";
  check_arg(block_size > 0 && num_kv_heads > 0 && head_size > 0 && head_size_v > 0, where,
            "block_size, num_kv_heads, head_size, head_size_v", "> 0",
            fmt::format("{}, {}, {}, {}", block_size, num_kv_heads, head_size, head_size_v));
  const std::size_t slots = checked_mul(static_cast<std::size_t>(block_size),
                                        static_cast<std::size_t>(num_kv_heads), where, "page size");
  const std::size_t dims = static_cast<std::size_t>(head_size) + static_cast<std::size_t>(head_size_v);
  const std::size_t data =
      checked_mul(checked_mul(slots, dims, where, "page size"), dtype_size(dtype), where, "page size");
  if (!kv_cache_uses_per_token_head_scales(mode)) return data;
  // One f32 scale per (slot, KV head) for K and one for V.
  const std::size_t scales = checked_mul(slots, kNumKvHalves * kScaleBytes, where, "page size");
  return checked_add(data, scales, where, "page size");
}

std::size_t checked_numel(const Dims& shape, std::size_t element_size, std::string_view where,
                          std::string_view what) {
  std::size_t n = element_size;
  for (std::int64_t s : shape) n = checked_mul(n, static_cast<std::size_t>(s), where, what);
  return n;
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
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype, kv_quant_mode);
}

std::size_t FullAttentionSpec::max_memory_usage_bytes(const KVCacheLimits& limits) const {
  const std::size_t tokens = checked_limit(limits.max_model_len, "max_model_len");
  return ceil_div(tokens, static_cast<std::size_t>(block_size)) * page_size_bytes();
}

std::size_t SlidingWindowSpec::page_size_bytes() const {
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype, kv_quant_mode);
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
  return page_bytes(block_size, num_kv_heads, head_size, head_size_v, dtype, kv_quant_mode);
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

Dims kv_cache_scale_shape(std::int64_t num_blocks, int block_size, int num_kv_heads) {
  constexpr std::string_view where = "kv_cache_scale_shape";
  check_arg(num_blocks > 0, where, "num_blocks", "> 0", num_blocks);
  check_arg(block_size > 0, where, "block_size", "> 0", block_size);
  check_arg(num_kv_heads > 0, where, "num_kv_heads", "> 0", num_kv_heads);
  return Dims{num_blocks, kNumKvHalves, num_kv_heads, block_size};
}

LayerKVCache allocate_layer_kv_cache(const AttentionBackend& backend, std::int64_t num_blocks, int block_size,
                                     int num_kv_heads, int head_size, CacheDType cache_dtype,
                                     DType model_dtype, KVCacheLayout layout, Device device) {
  constexpr std::string_view where = "allocate_layer_kv_cache";
  const Dims shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype);
  const std::vector<int> order = backend.kv_cache_stride_order(layout);
  const DType storage = kv_cache_storage_dtype(cache_dtype, model_dtype);
  DeviceAllocator& allocator = device_allocator(device.type);
  LayerKVCache result;
  if (!kv_cache_uses_per_token_head_scales(cache_dtype)) {
    result.cache = Tensor::empty_strided_order(shape, order, storage, device);
    result.bytes = result.cache.span_bytes();
    allocator.memset(result.cache.data(), device, 0, result.bytes);
    return result;
  }
  // One allocation: the K/V elements in their physical order, then the scales.
  const Dims scale_shape = kv_cache_scale_shape(num_blocks, block_size, num_kv_heads);
  const std::size_t data_bytes = checked_numel(shape, dtype_size(storage), where, "kv cache bytes");
  const std::size_t scale_offset =
      checked_mul(ceil_div(data_bytes, kScaleRegionAlign), kScaleRegionAlign, where, "kv cache bytes");
  const std::size_t total =
      checked_add(scale_offset, checked_numel(scale_shape, kScaleBytes, where, "kv cache bytes"), where,
                  "kv cache bytes");
  check_arg(total <= static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()), where,
            "kv cache bytes", "at most INT64_MAX", total);
  const Tensor raw = Tensor::empty({static_cast<std::int64_t>(total)}, DType::U8, device);
  allocator.memset(raw.data(), device, 0, total);
  result.cache = carve_strided_order(raw, 0, shape, order, storage);
  constexpr int kScaleRank = 4;
  constexpr std::array<int, kScaleRank> kRowMajor{0, 1, 2, 3};
  result.scales = carve_strided_order(raw, scale_offset, scale_shape, kRowMajor, DType::F32);
  result.bytes = total;
  return result;
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
    for (int engine = 0; engine < engines; ++engine) {
      const LayerKVCache cache =
          allocate_layer_kv_cache(layer->backend(), options.num_blocks, layer->block_size(),
                                  layer->num_kv_heads(), layer->head_size(), layer->kv_cache_dtype(),
                                  layer->dtype(), layer->kv_cache_layout(), model.device());
      layer->bind_kv_cache(engine, cache.cache, cache.scales);
      result.bytes += cache.bytes;
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
      layer->bind_kv_cache(engine, cache, owner.kv_cache_scales(engine));
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
