// KV-cache specs (vLLM's kv_cache_interface: what one layer needs per block)
// and the allocation of every layer's cache with its backend's shape and
// stride order, bound per virtual engine.
#pragma once

#include <pagedattn/attention_types.h>
#include <pagedattn/tensor.h>

#include <cstddef>
#include <cstdint>
#include <variant>

namespace pagedattn {

class AttentionBackend;
class ModelContext;

// Scheduler limits the specs' worst-case memory estimates depend on.
struct KVCacheLimits {
  int max_model_len = 0;
  int max_num_batched_tokens = 0;
  int max_num_encoder_input_tokens = 0;
};

// Causal self-attention keeping every token of the sequence.
struct FullAttentionSpec {
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;
  DType dtype = DType::BF16;  // storage dtype of the cache elements
  int head_size_v = head_size;
  KVQuantMode kv_quant_mode = KVQuantMode::None;

  // Bytes of one block of K and V: BS * Hkv * (D + Dv) * sizeof(dtype), plus
  // 2 * BS * Hkv * 4 for per-token-head scales. Throws InvalidArgument when
  // it overflows size_t.
  std::size_t page_size_bytes() const;
  // Blocks for one request of max_model_len tokens.
  std::size_t max_memory_usage_bytes(const KVCacheLimits& limits) const;
};

// Self-attention that only reads the last `sliding_window` tokens.
struct SlidingWindowSpec {
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;
  DType dtype = DType::BF16;
  int head_size_v = head_size;
  KVQuantMode kv_quant_mode = KVQuantMode::None;
  int sliding_window = 0;

  std::size_t page_size_bytes() const;
  // The window plus one step's tokens (capped at max_model_len), plus one block
  // because the window may straddle a block boundary.
  std::size_t max_memory_usage_bytes(const KVCacheLimits& limits) const;
};

// Decoder-to-encoder attention: the encoder K/V, written once per request.
struct CrossAttentionSpec {
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;
  DType dtype = DType::BF16;
  int head_size_v = head_size;
  KVQuantMode kv_quant_mode = KVQuantMode::None;

  std::size_t page_size_bytes() const;
  // Blocks for max_num_encoder_input_tokens.
  std::size_t max_memory_usage_bytes(const KVCacheLimits& limits) const;
};

using KVCacheSpec = std::variant<FullAttentionSpec, SlidingWindowSpec, CrossAttentionSpec>;

std::size_t page_size_bytes(const KVCacheSpec& spec);
std::size_t max_memory_usage_bytes(const KVCacheSpec& spec, const KVCacheLimits& limits);
int spec_block_size(const KVCacheSpec& spec);
// vLLM's KVCacheSpecKind spelling: "full_attention", "sliding_window", "cross_attention".
std::string_view spec_kind_name(const KVCacheSpec& spec);

struct KVCacheAllocationOptions {
  std::int64_t num_blocks = 0;
  // Block 0 is reserved as the null block (vLLM's NULL_BLOCK_ID): it is never
  // handed out, so padded block-table entries may point at it. Only recorded
  // in the result (first_usable_block = 1); every cache is zero-filled anyway.
  bool reserve_null_block = false;
};

struct KVCacheAllocation {
  std::int64_t num_blocks = 0;
  std::int32_t first_usable_block = 0;  // 1 when block 0 is the reserved null block
  std::size_t bytes = 0;                // over every layer and virtual engine
  int num_cache_layers = 0;             // layers that own a cache
  int num_shared_layers = 0;            // KV-sharing layers bound to a target's cache
};

// The scale region of a per-token-head cache: [num_blocks, 2 (K, V),
// num_kv_heads, block_size] f32, so one KV head's scales of a block's
// consecutive slots are contiguous (kScaleDims; docs/kv_layouts.md,
// "Per-token-head scales").
Dims kv_cache_scale_shape(std::int64_t num_blocks, int block_size, int num_kv_heads);
// Where the scale region starts in a layer's allocation: the K/V bytes
// rounded up to this, so the region is 16-byte aligned for CUDA_FLASH's
// 16-byte scale copies.
inline constexpr std::size_t kScaleRegionAlign = 256;

// One layer's cache tensors: K/V of the backend's kv_cache_shape in its
// stride order for `layout`, and for per-token-head dtypes the scales
// (kv_cache_scale_shape), both carved from one allocation; zero-filled.
struct LayerKVCache {
  Tensor cache;
  Tensor scales;          // undefined unless kv_cache_uses_per_token_head_scales(cache_dtype)
  std::size_t bytes = 0;  // of the allocation
};
LayerKVCache allocate_layer_kv_cache(const AttentionBackend& backend, std::int64_t num_blocks, int block_size,
                                     int num_kv_heads, int head_size, CacheDType cache_dtype,
                                     DType model_dtype, KVCacheLayout layout, Device device);

// Allocates, for every layer of `model` that owns a cache (its
// get_kv_cache_spec() is set), one zero-filled tensor per virtual engine
// (pipeline_parallel_size of them) of its backend's
// kv_cache_shape(num_blocks, ...) in the physical order kv_cache_stride_order(
// layer layout), with its per-token-head scales where the dtype has them
// (allocate_layer_kv_cache), and binds it to the layer; then binds every KV-sharing layer
// to its target's tensors. Zero-filling keeps never-written slots finite, so a
// kernel that reads a whole block and masks afterwards cannot pick up NaNs.
// Throws InvalidArgument on num_blocks < 1 (< 2 with a reserved null block).
KVCacheAllocation allocate_kv_caches(ModelContext& model, const KVCacheAllocationOptions& options);

// Bytes one block id costs across the model: the sum of the cache-owning
// layers' page sizes, for one virtual engine.
std::size_t kv_cache_bytes_per_block(const ModelContext& model);

}  // namespace pagedattn
