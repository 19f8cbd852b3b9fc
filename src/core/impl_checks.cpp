#include <pagedattn/backend/impl_checks.h>

#include <algorithm>
#include <string>
#include <utility>

namespace pagedattn {
namespace {

constexpr int kRowsRank = 3;       // [T, heads, D]
constexpr int kCacheHalfRank = 4;  // [NB, BS, Hkv, D]
constexpr int kLseRank = 2;        // [H, T]

// [>= min_rows, heads, head_size], rows may be strided, last dim contiguous.
void check_rows(std::string_view where, const TensorView& t, std::string_view name, Device device,
                std::int64_t min_rows, std::int64_t heads, std::int64_t head_size) {
  check_rank(t, where, name, kRowsRank);
  check_device(t, where, name, device);
  check_size(t, 1, where, name, heads);
  check_size(t, 2, where, name, head_size);
  check_last_dim_contiguous(t, where, name);
  if (t.size(0) < min_rows) {
    throw_invalid(where, fmt::format("{}.size(0)", name), fmt::format(">= num_actual_tokens ({})", min_rows),
                  std::to_string(t.size(0)));
  }
}

// A dequantization scale: a defined rank-1 f32 tensor on `device`, contiguous
// (`expected` says which sizes the caller then allows).
void check_scale_vector(std::string_view where, const TensorView& scale, std::string_view name, Device device,
                        std::string_view expected) {
  check_arg(scale.defined(), where, name, expected, "undefined");
  check_rank(scale, where, name, 1);
  check_dtype(scale, where, name, DType::F32);
  check_device(scale, where, name, device);
  check_last_dim_contiguous(scale, where, name);
}

// A layer's quantize_query: an impl that takes quantized queries, a cache
// they are quantized for, and q_scale [1] f32 on the device.
void check_query_quantization(std::string_view where, const AttentionImplParams& p, Device device,
                              const LayerQuantState& layer, bool quant_query_input) {
  check_arg(quant_query_input, where, "layer quantize_query", "false for an impl without supports_quant_query_input()",
            "true");
  check_arg(quantizes_query_for(p.kv_cache_dtype, p.attn_type), where, "layer quantize_query",
            "false unless the attention reads an fp8 / fp8_e4m3 cache (quantizes_query_for)",
            fmt::format("true with kv_cache_dtype {} and attn_type {}", cache_dtype_name(p.kv_cache_dtype),
                        attention_type_name(p.attn_type)));
  check_scale_vector(where, layer.q_scale, "q_scale", device, "a [1] f32 tensor for a query quantized to fp8");
  check_arg(layer.q_scale.size(0) == 1, where, "q_scale.size(0)", 1, layer.q_scale.size(0));
}

}  // namespace

// One half of the paged cache: [NB, BS, Hkv, D], any strides, last dim contiguous.
void check_cache_half(std::string_view where, const TensorView& t, std::string_view name, Device device,
                      DType storage, int num_kv_heads, int head_size) {
  check_rank(t, where, name, kCacheHalfRank);
  check_dtype(t, where, name, storage);
  check_device(t, where, name, device);
  check_size(t, 2, where, name, num_kv_heads);
  check_size(t, 3, where, name, head_size);
  check_last_dim_contiguous(t, where, name);
}

// Per-tensor ([1]) or per-KV-head ([Hkv]) f32 dequantization scale.
void check_kv_scale(std::string_view where, const TensorView& scale, std::string_view name, Device device,
                    int num_kv_heads) {
  check_scale_vector(where, scale, name, device, "a [1] or [num_kv_heads] f32 tensor for an fp8 cache");
  if (scale.size(0) != 1 && scale.size(0) != num_kv_heads) {
    throw_invalid(where, fmt::format("{}.size(0)", name), fmt::format("1 or num_kv_heads ({})", num_kv_heads),
                  std::to_string(scale.size(0)));
  }
}

void check_token_scales(std::string_view where, const KVCacheView& kv, CacheDType kv_cache_dtype,
                        Device device) {
  check_token_scale_half(where, "kv_cache.key_scale", kv.key_scale, kv.key, kv_cache_dtype, device);
  check_token_scale_half(where, "kv_cache.value_scale", kv.value_scale, kv.key, kv_cache_dtype, device);
  if (kv.value_scale.strides() != kv.key_scale.strides()) {
    throw_invalid(where, "kv_cache.value_scale strides",
                  fmt::format("kv_cache.key_scale's ({})", kv.key_scale.strides().str()),
                  kv.value_scale.strides().str());
  }
}

void check_impl_params(std::string_view where, const AttentionImplParams& p) {
  check_arg(p.num_heads > 0, where, "num_heads", "> 0", p.num_heads);
  check_arg(p.num_kv_heads > 0, where, "num_kv_heads", "> 0", p.num_kv_heads);
  check_arg(p.num_heads % p.num_kv_heads == 0, where, "num_heads",
            fmt::format("a multiple of num_kv_heads ({})", p.num_kv_heads), p.num_heads);
  check_arg(p.head_size > 0, where, "head_size", "> 0", p.head_size);
  check_arg(p.alibi_slopes.empty() || std::ssize(p.alibi_slopes) == p.num_heads, where, "alibi_slopes.size()",
            fmt::format("0 or num_heads ({})", p.num_heads), p.alibi_slopes.size());
  check_arg(p.sinks.empty() || std::ssize(p.sinks) == p.num_heads, where, "sinks.size()",
            fmt::format("0 or num_heads ({})", p.num_heads), p.sinks.size());
  if (p.sliding_window) check_arg(*p.sliding_window > 0, where, "sliding_window", "> 0", *p.sliding_window);
  if (p.logits_soft_cap) {
    check_arg(*p.logits_soft_cap >= 0.0f, where, "logits_soft_cap", ">= 0", *p.logits_soft_cap);
  }
  if (p.use_mm_prefix) {
    check_arg(p.attn_type == AttentionType::Decoder, where, "use_mm_prefix", "only with decoder attention",
              attention_type_name(p.attn_type));
    check_arg(!p.attention_chunk_size, where, "use_mm_prefix",
              "not with attention_chunk_size (chunked local attention and PrefixLM do not compose)",
              fmt::format("with attention_chunk_size {}", p.attention_chunk_size.value_or(0)));
  }
}

// The checks format their messages only on failure: forward calls run them
// for every layer and allocate nothing when the arguments are right.
ForwardShape check_forward_args(std::string_view where, const AttentionImplParams& p, Device device,
                                const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                                const TensorView& value, const KVCacheView& kv_cache,
                                const BackendMetadata& metadata, const TensorView& output,
                                const TensorView& lse, std::span<const DType> output_dtypes, bool quant_query_input) {
  check_arg(metadata.facts.has_value(), where, "metadata", "a step plan from a metadata builder",
            "metadata no builder validated");
  if (layer.quantize_query) check_query_quantization(where, p, device, layer, quant_query_input);
  const CommonAttentionMetadata& common = metadata.common;
  const StepFacts& facts = *metadata.facts;
  const int tokens = common.num_actual_tokens;
  ForwardShape shape;
  shape.paged = reads_paged_cache(p.attn_type);
  shape.block_size = common.block_size;
  shape.cache_storage = kv_cache_storage_dtype(p.kv_cache_dtype, p.dtype);
  shape.fp8 = kv_quant_mode(p.kv_cache_dtype) == KVQuantMode::Fp8PerTensor;
  shape.token_head_scales = kv_cache_uses_per_token_head_scales(p.kv_cache_dtype);

  check_arg(common.device() == device, where, "metadata device", device, common.device());
  if (const int chunk = p.attention_chunk_size.value_or(0); common.local_chunk_size != chunk) {
    throw_invalid(where, "metadata local_chunk_size",
                  fmt::format("the layer's attention_chunk_size ({}; make_local_attention_virtual_batches)", chunk),
                  std::to_string(common.local_chunk_size));
  }
  if (common.has_mm_prefix_ranges() && !p.use_mm_prefix) {
    throw_invalid(where, "metadata mm_prefix_ranges", "none for a layer without use_mm_prefix",
                  fmt::format("{} ranges", common.mm_prefix_ranges_cpu.size(0)));
  }
  check_rows(where, query, "query", device, tokens, p.num_heads, p.head_size);
  check_dtype(query, where, "query", p.dtype);
  check_rows(where, output, "output", device, tokens, p.num_heads, p.head_size);
  const bool output_dtype_ok =
      std::find(output_dtypes.begin(), output_dtypes.end(), output.dtype()) != output_dtypes.end();
  if (!output_dtype_ok) {
    std::string names;
    for (DType t : output_dtypes) names += fmt::format("{}{}", names.empty() ? "" : ", ", t);
    throw_invalid(where, "output dtype", fmt::format("one of {}", names), dtype_name(output.dtype()));
  }
  if (lse.defined()) {
    check_rank(lse, where, "lse", kLseRank);
    check_dtype(lse, where, "lse", DType::F32);
    check_device(lse, where, "lse", device);
    check_size(lse, 0, where, "lse", p.num_heads);
    if (lse.size(1) < tokens) {
      throw_invalid(where, "lse.size(1)", fmt::format(">= num_actual_tokens ({})", tokens),
                    std::to_string(lse.size(1)));
    }
  }

  if (shape.paged) {
    check_arg(kv_cache.defined(), where, "kv_cache", "a bound KV cache", "undefined");
    check_cache_half(where, kv_cache.key, "kv_cache.key", device, shape.cache_storage, p.num_kv_heads,
                     p.head_size);
    check_cache_half(where, kv_cache.value, "kv_cache.value", device, shape.cache_storage, p.num_kv_heads,
                     p.head_size);
    if (kv_cache.value.shape() != kv_cache.key.shape()) {
      throw_invalid(where, "kv_cache.value shape", kv_cache.key.shape().str(), kv_cache.value.shape().str());
    }
    check_key_packing(where, kv_cache.key, kv_cache.key_packing);
    shape.num_blocks = kv_cache.num_blocks();
    if (common.block_size > 0 && kv_cache.block_size() != common.block_size) {
      throw_invalid(where, "kv_cache block size", fmt::format("metadata block_size ({})", common.block_size),
                    std::to_string(kv_cache.block_size()));
    }
    shape.block_size = kv_cache.block_size();
    if (shape.fp8) {
      check_kv_scale(where, layer.k_scale, "k_scale", device, p.num_kv_heads);
      check_kv_scale(where, layer.v_scale, "v_scale", device, p.num_kv_heads);
      if (layer.v_scale.size(0) != layer.k_scale.size(0)) {
        throw_invalid(where, "v_scale.size(0)", fmt::format("k_scale.size(0) ({})", layer.k_scale.size(0)),
                      std::to_string(layer.v_scale.size(0)));
      }
      shape.per_head_kv_scales = layer.k_scale.size(0) > 1;
    }
    if (shape.token_head_scales) {
      check_token_scales(where, kv_cache, p.kv_cache_dtype, device);
      check_arg(kv_cache.key_packing == KeyPacking::None, where, "kv_cache.key_packing",
                "none (per-token-head caches keep K row-major)", key_packing_name(kv_cache.key_packing));
    }
  } else {
    check_rows(where, key, "key", device, tokens, p.num_kv_heads, p.head_size);
    check_dtype(key, where, "key", p.dtype);
    check_rows(where, value, "value", device, tokens, p.num_kv_heads, p.head_size);
    check_dtype(value, where, "value", p.dtype);
  }
  if (shape.paged) {
    check_block_ids(where, facts, shape.num_blocks);
  } else if (const int r = facts.first_seq_len_not_query_len; r >= 0) {
    throw_invalid(where, fmt::format("seq_lens[{}]", r),
                  fmt::format("query_len ({}) for {} attention", common.query_len(r), attention_type_name(p.attn_type)),
                  std::to_string(common.seq_len(r)));
  }
  return shape;
}

}  // namespace pagedattn
