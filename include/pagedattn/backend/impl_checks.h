// Argument checks every AttentionImpl shares, so that all backends reject bad
// input with the same messages and none forgets a check. Each throws
// InvalidArgument naming the argument, the expected and the given value.
#pragma once

#include <pagedattn/backend/backend.h>

#include <span>
#include <string_view>

namespace pagedattn {

// The constructor arguments: positive sizes, num_heads % num_kv_heads, alibi and
// sinks sized [num_heads], a positive window, a non-negative soft cap,
// use_mm_prefix only on decoder layers without attention_chunk_size.
void check_impl_params(std::string_view where, const AttentionImplParams& params);

// One half of the paged cache: [NB, BS, Hkv, D] in `storage`, any strides,
// last dimension contiguous.
void check_cache_half(std::string_view where, const TensorView& t, std::string_view name, Device device,
                      DType storage, int num_kv_heads, int head_size);
// A per-tensor ([1]) or per-KV-head ([Hkv]) f32 fp8 dequantization scale.
void check_kv_scale(std::string_view where, const TensorView& scale, std::string_view name, Device device,
                    int num_kv_heads);
// A per-token-head cache's scales: key_scale and value_scale [NB, Hkv, BS]
// f32 on `device`, the cache's blocks, KV heads and slots, with equal strides.
void check_token_scales(std::string_view where, const KVCacheView& kv_cache, CacheDType kv_cache_dtype,
                        Device device);

// What check_forward_args learned about the call.
struct ForwardShape {
  bool paged = false;            // K/V come from the cache (decoder, cross) rather than key/value rows
  std::int64_t num_blocks = 0;   // of the cache; 0 when not paged
  int block_size = 0;            // of the cache, else the metadata's
  DType cache_storage = DType::BF16;
  bool fp8 = false;                 // fp8 with the layer's k/v scales (KVQuantMode::Fp8PerTensor)
  bool per_head_kv_scales = false;  // [Hkv] k/v scales
  bool token_head_scales = false;   // the cache's per-token-head scales (KVCacheView::key_scale)
};

// Checks forward's arguments (shapes in the AttentionImpl::forward comment)
// against the impl's params and `device`, in time independent of the batch:
// query/output [>= T, H, D], key/value [>= T, Hkv, D] for encoder types, the
// cache halves [NB, BS, Hkv, D] in the storage dtype for paged types, fp8
// scales [1] or [Hkv] or a per-token-head cache's scales, lse [H, >= T] f32;
// that a builder validated the metadata (adopt_step), split by the layer's
// chunk size, and without PrefixLM ranges unless the layer has use_mm_prefix;
// the step's block ids against this cache, and seq_len == q_len for encoder
// types, from the metadata's facts; a layer's quantize_query only for an impl
// that takes quantized queries (`quant_query_input`) and a cache that
// quantizes_query_for, with q_scale [1] f32 on `device`.
// `output_dtypes` lists the output dtypes the backend can write.
ForwardShape check_forward_args(std::string_view where, const AttentionImplParams& params, Device device,
                                const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                const TensorView& value, const KVCacheView& kv_cache,
                                const BackendMetadata& metadata, const TensorView& output,
                                const TensorView& lse, std::span<const DType> output_dtypes, bool quant_query_input);

}  // namespace pagedattn
