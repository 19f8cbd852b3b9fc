#include <pagedattn/backend/backend.h>
#include <pagedattn/kv_cache.h>

#include "core/strings.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace pagedattn {
namespace {

// Logical KV cache dimensions: (kv, block, slot, head, dim).
constexpr int kKvCacheRank = 5;
constexpr int kNumKvHalves = 2;

}  // namespace

std::string_view attention_type_name(AttentionType t) {
  switch (t) {
    case AttentionType::Decoder:
      return "decoder";
    case AttentionType::Encoder:
      return "encoder";
    case AttentionType::EncoderOnly:
      return "encoder_only";
    case AttentionType::EncoderDecoder:
      return "encoder_decoder";
  }
  return "unknown";
}

std::optional<AttentionType> parse_attention_type(std::string_view name) {
  for (AttentionType t : {AttentionType::Decoder, AttentionType::Encoder, AttentionType::EncoderOnly,
                          AttentionType::EncoderDecoder}) {
    if (detail::iequals(name, attention_type_name(t))) return t;
  }
  return std::nullopt;
}

bool reads_paged_cache(AttentionType t) {
  return t == AttentionType::Decoder || t == AttentionType::EncoderDecoder;
}

std::string_view cache_dtype_name(CacheDType t) {
  switch (t) {
    case CacheDType::Auto:
      return "auto";
    case CacheDType::Float16:
      return "float16";
    case CacheDType::BFloat16:
      return "bfloat16";
    case CacheDType::Fp8:
      return "fp8";
    case CacheDType::Fp8E4M3:
      return "fp8_e4m3";
    case CacheDType::Fp8E5M2:
      return "fp8_e5m2";
    case CacheDType::Int8PerTokenHead:
      return "int8_per_token_head";
    case CacheDType::Fp8PerTokenHead:
      return "fp8_per_token_head";
  }
  return "unknown";
}

std::vector<CacheDType> all_cache_dtypes() {
  return {
      CacheDType::Auto,    CacheDType::Float16, CacheDType::BFloat16,         CacheDType::Fp8,
      CacheDType::Fp8E4M3, CacheDType::Fp8E5M2, CacheDType::Int8PerTokenHead, CacheDType::Fp8PerTokenHead};
}

std::optional<CacheDType> parse_cache_dtype(std::string_view name) {
  for (CacheDType t : all_cache_dtypes()) {
    if (detail::iequals(name, cache_dtype_name(t))) return t;
  }
  return std::nullopt;
}

bool is_quantized_kv_cache(CacheDType t) { return kv_quant_mode(t) != KVQuantMode::None; }

bool quantizes_query_for(CacheDType cache, AttentionType attn_type) {
  return (cache == CacheDType::Fp8 || cache == CacheDType::Fp8E4M3) && reads_paged_cache(attn_type);
}

KVQuantMode kv_quant_mode(CacheDType t) {
  switch (t) {
    case CacheDType::Auto:
    case CacheDType::Float16:
    case CacheDType::BFloat16:
      return KVQuantMode::None;
    case CacheDType::Fp8:
    case CacheDType::Fp8E4M3:
    case CacheDType::Fp8E5M2:
      return KVQuantMode::Fp8PerTensor;
    case CacheDType::Int8PerTokenHead:
      return KVQuantMode::Int8PerTokenHead;
    case CacheDType::Fp8PerTokenHead:
      return KVQuantMode::Fp8PerTokenHead;
  }
  return KVQuantMode::None;
}

std::string_view kv_quant_mode_name(KVQuantMode m) {
  switch (m) {
    case KVQuantMode::None:
      return "NONE";
    case KVQuantMode::Fp8PerTensor:
      return "FP8_PER_TENSOR";
    case KVQuantMode::Int8PerTokenHead:
      return "INT8_PER_TOKEN_HEAD";
    case KVQuantMode::Fp8PerTokenHead:
      return "FP8_PER_TOKEN_HEAD";
  }
  return "unknown";
}

bool kv_cache_uses_per_token_head_scales(KVQuantMode m) {
  return m == KVQuantMode::Int8PerTokenHead || m == KVQuantMode::Fp8PerTokenHead;
}

bool kv_cache_uses_per_token_head_scales(CacheDType t) { return kv_cache_uses_per_token_head_scales(kv_quant_mode(t)); }

void check_token_scale_half(std::string_view where, std::string_view name, const TensorView& scale,
                            const TensorView& cache, CacheDType kv_cache_dtype, Device device) {
  const Dims expected{cache.size(0), cache.size(2), cache.size(1)};  // [NB, Hkv, BS] of [NB, BS, Hkv, D]
  check_arg(scale.defined(), where, name,
            fmt::format("a {} f32 tensor ({}) for kv_cache_dtype {}", expected.str(), kScaleHalfDims,
                        cache_dtype_name(kv_cache_dtype)),
            "undefined");
  check_shape(scale, where, name, expected, kScaleHalfDims);
  check_dtype(scale, where, name, DType::F32);
  check_device(scale, where, name, device);
}

DType kv_cache_storage_dtype(CacheDType t, DType model_dtype) {
  switch (t) {
    case CacheDType::Auto:
      return model_dtype;
    case CacheDType::Float16:
      return DType::F16;
    case CacheDType::BFloat16:
      return DType::BF16;
    case CacheDType::Fp8:
    case CacheDType::Fp8E4M3:
    case CacheDType::Fp8PerTokenHead:
      return DType::FP8_E4M3;
    case CacheDType::Fp8E5M2:
      return DType::FP8_E5M2;
    case CacheDType::Int8PerTokenHead:
      return DType::I8;
  }
  return model_dtype;
}

std::string_view kv_cache_layout_name(KVCacheLayout l) { return l == KVCacheLayout::NHD ? "NHD" : "HND"; }

std::optional<KVCacheLayout> parse_kv_cache_layout(std::string_view name) {
  const std::string n = detail::to_lower(name);
  if (n == "nhd") return KVCacheLayout::NHD;
  if (n == "hnd") return KVCacheLayout::HND;
  return std::nullopt;
}

std::string SelectorConfig::str() const {
  return fmt::format(
      "SelectorConfig(head_size={}, dtype={}, kv_cache_dtype={}, block_size={}, use_mla={}, has_sink={}, "
      "use_sparse={}, use_mm_prefix={}, use_per_head_quant_scales={}, attn_type={}, use_non_causal={}, "
      "use_batch_invariant={}, device={}, capability={}.{})",
      head_size, dtype, cache_dtype_name(kv_cache_dtype), block_size ? std::to_string(*block_size) : "None", use_mla,
      has_sink, use_sparse, use_mm_prefix, use_per_head_quant_scales, attention_type_name(attn_type),
      use_non_causal, use_batch_invariant, device, capability.major, capability.minor);
}

Dims AttentionBackend::kv_cache_shape(std::int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                                      CacheDType /*cache_dtype*/) const {
  check_arg(num_blocks > 0, "kv_cache_shape", "num_blocks", "> 0", num_blocks);
  check_arg(block_size > 0, "kv_cache_shape", "block_size", "> 0", block_size);
  check_arg(num_kv_heads > 0, "kv_cache_shape", "num_kv_heads", "> 0", num_kv_heads);
  check_arg(head_size > 0, "kv_cache_shape", "head_size", "> 0", head_size);
  return Dims{kNumKvHalves, num_blocks, block_size, num_kv_heads, head_size};
}

std::vector<int> AttentionBackend::kv_cache_stride_order(KVCacheLayout layout) const {
  if (layout == KVCacheLayout::HND) return {0, 1, 3, 2, 4};
  return {0, 1, 2, 3, 4};
}

KVCacheView AttentionBackend::unbind_kv_cache(const TensorView& kv_cache, const TensorView& kv_scales) const {
  constexpr std::string_view where = "unbind_kv_cache";
  check_rank(kv_cache, where, "kv_cache", kKvCacheRank);
  check_size(kv_cache, 0, where, "kv_cache", kNumKvHalves);
  KVCacheView view{kv_cache.select(0, 0), kv_cache.select(0, 1)};
  // A per-token-head cache keeps K row-major: its readers dequantize rows
  // with their scales, which no packed path does.
  view.key_packing = kv_scales.defined() ? KeyPacking::None : key_packing(view.key);
  if (kv_scales.defined()) {
    // The block count, slots and KV heads of the cache.
    check_shape(kv_scales, where, "kv_scales",
                kv_cache_scale_shape(view.key.size(0), static_cast<int>(view.key.size(1)),
                                     static_cast<int>(view.key.size(2))),
                kScaleDims);
    check_dtype(kv_scales, where, "kv_scales", DType::F32);
    check_device(kv_scales, where, "kv_scales", kv_cache.device());
    view.key_scale = kv_scales.select(1, 0);
    view.value_scale = kv_scales.select(1, 1);
  }
  return view;
}

ScaleOperand token_scale_operand(const TensorView& half) {
  return {static_cast<const float*>(half.data()), half.stride(kScaleHalfBlockDim),
          half.stride(kScaleHalfSlotDim), half.stride(kScaleHalfHeadDim)};
}

KVWriteScales kv_write_scales(CacheDType kv_cache_dtype, const LayerQuantState& layer,
                              const KVCacheView& kv_cache) {
  if (kv_cache_uses_per_token_head_scales(kv_cache_dtype)) return {kv_cache.key_scale, kv_cache.value_scale};
  return {layer.k_scale, layer.v_scale};
}

std::string_view key_packing_name(KeyPacking packing) { return packing == KeyPacking::None ? "none" : "keys16"; }

bool can_hold_key_packing(const TensorView& key_cache, KeyPacking packing) {
  if (packing == KeyPacking::None) return true;
  if (key_cache.dim() != kKvCacheRank - 1) return false;
  const std::int64_t head_size = key_cache.size(3);
  return key_cache.stride(3) == 1 && key_cache.stride(1) == head_size && key_cache.size(1) % kPackedKeyGroup == 0 &&
         head_size % kPackedDimGroup == 0;
}

void check_key_packing(std::string_view where, const TensorView& key_cache, KeyPacking packing) {
  if (can_hold_key_packing(key_cache, packing)) return;
  check_rank(key_cache, where, "kv_cache.key", kKvCacheRank - 1);
  const std::int64_t head_size = key_cache.size(3);
  const std::string what = fmt::format("a {}-packed K", key_packing_name(packing));
  check_arg(key_cache.stride(3) == 1 && key_cache.stride(1) == head_size, where, "kv_cache.key slot stride",
            fmt::format("{} (rows {} elements apart for {})", head_size, head_size, what),
            fmt::format("{} (last-dim stride {})", key_cache.stride(1), key_cache.stride(3)));
  check_arg(key_cache.size(1) % kPackedKeyGroup == 0, where, "kv_cache block size",
            fmt::format("a multiple of {} for {}", kPackedKeyGroup, what), key_cache.size(1));
  check_arg(head_size % kPackedDimGroup == 0, where, "kv_cache head size",
            fmt::format("a multiple of {} for {}", kPackedDimGroup, what), head_size);
}

bool AttentionBackend::supports_head_size(int head_size) const {
  const auto sizes = supported_head_sizes();
  const bool listed = sizes.empty() || std::find(sizes.begin(), sizes.end(), head_size) != sizes.end();
  return head_size > 0 && listed && !head_size_rule(head_size).has_value();
}

bool AttentionBackend::supports_dtype(DType dtype) const {
  const auto dtypes = supported_dtypes();
  return std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end();
}

bool AttentionBackend::supports_kv_cache_dtype(CacheDType t) const {
  const auto dtypes = supported_kv_cache_dtypes();
  return dtypes.empty() || std::find(dtypes.begin(), dtypes.end(), t) != dtypes.end();
}

bool AttentionBackend::supports_block_size(std::optional<int> block_size) const {
  if (!block_size) return true;
  if (*block_size <= 0) return false;
  const auto sizes = supported_kernel_block_sizes();
  if (sizes.empty()) return true;
  // A cache block size only needs to be a multiple of a kernel block size
  // (vLLM splits each manager block into kernel blocks).
  return std::any_of(sizes.begin(), sizes.end(), [&](const KernelBlockSize& s) {
    if (const auto* m = std::get_if<MultipleOf>(&s)) return *block_size % m->base == 0;
    return *block_size % std::get<int>(s) == 0;
  });
}

int AttentionBackend::preferred_block_size(int default_size) const {
  if (supports_block_size(default_size)) return default_size;
  int best = 0;
  for (const KernelBlockSize& s : supported_kernel_block_sizes()) {
    const int size = std::holds_alternative<MultipleOf>(s) ? std::get<MultipleOf>(s).base : std::get<int>(s);
    if (best == 0 || size < best) best = size;
  }
  return best == 0 ? default_size : best;
}

std::vector<std::string> AttentionBackend::validate_configuration(const SelectorConfig& cfg) const {
  std::vector<std::string> reasons;
  if (!supports_head_size(cfg.head_size)) reasons.emplace_back("head_size not supported");
  if (!supports_dtype(cfg.dtype)) reasons.emplace_back("dtype not supported");
  if (!supports_kv_cache_dtype(cfg.kv_cache_dtype)) reasons.emplace_back("kv_cache_dtype not supported");
  if (!supports_block_size(cfg.block_size)) reasons.emplace_back("block_size not supported");
  if (cfg.use_mm_prefix && !supports_mm_prefix()) {
    reasons.emplace_back("partial multimodal token full attention not supported");
  }
  if (cfg.use_mla != is_mla()) reasons.emplace_back(cfg.use_mla ? "MLA not supported" : "non-MLA not supported");
  if (cfg.has_sink && !supports_sink()) reasons.emplace_back("attention sinks not supported");
  if (cfg.use_sparse != is_sparse()) {
    reasons.emplace_back(cfg.use_sparse ? "sparse not supported" : "non-sparse not supported");
  }
  if (cfg.use_per_head_quant_scales && !supports_per_head_quant_scales()) {
    reasons.emplace_back("per-head quant scales not supported");
  }
  if (!supports_compute_capability(cfg.capability)) reasons.emplace_back("compute capability not supported");
  if (!supports_attn_type(cfg.attn_type)) {
    reasons.push_back(fmt::format("attention type {} not supported", attention_type_name(cfg.attn_type)));
  }
  if (cfg.use_non_causal && !supports_non_causal()) reasons.emplace_back("non-causal attention not supported");
  if (cfg.use_batch_invariant && !supports_batch_invariance()) {
    reasons.emplace_back("batch invariance not supported");
  }
  if (auto combination = supports_combination(cfg)) reasons.push_back(std::move(*combination));
  return reasons;
}

AttentionVariant make_attention_variant(const AttentionImplParams& params, bool step_causal,
                                        const float* alibi_slopes, const float* sinks, MmPrefixRanges mm_prefix) {
  AttentionVariant v;
  v.scale = params.scale;
  v.soft_cap = params.logits_soft_cap.value_or(0.0f);
  v.mask = params.attn_type == AttentionType::Decoder && step_causal ? MaskKind::Causal : MaskKind::None;
  // Cross-attention has no window, as in vLLM (docs/semantics.md).
  if (params.sliding_window && params.attn_type != AttentionType::EncoderDecoder) {
    v.window = params.attn_type == AttentionType::Decoder ? WindowKind::Left : WindowKind::Bidirectional;
    v.window_size = *params.sliding_window;
  }
  // PrefixLM ranges widen a causal mask only (vLLM's Triton kernel asserts causal).
  if (params.use_mm_prefix && v.mask == MaskKind::Causal) v.mm_prefix = mm_prefix;
  v.alibi_slopes = alibi_slopes;
  v.sinks = sinks;
  v.key_source = reads_paged_cache(params.attn_type) ? KeySource::PagedCache : KeySource::DenseRows;
  return v;
}

MmPrefixRanges host_mm_prefix_ranges(const CommonAttentionMetadata& common) {
  if (!common.has_mm_prefix_ranges()) return {};
  return {common.mm_prefix_range_start_loc_cpu.data_as<const std::int32_t>(),
          common.mm_prefix_ranges_cpu.data_as<const std::int32_t>()};
}

AttentionProblem make_attention_problem(const AttentionImplParams& params, int block_size,
                                        const CommonAttentionMetadata* common, bool wants_lse,
                                        bool per_head_kv_scales) {
  AttentionProblem p;
  p.num_heads = params.num_heads;
  p.num_kv_heads = params.num_kv_heads;
  p.head_size = params.head_size;
  p.dtype = params.dtype;
  p.kv_storage_dtype = kv_cache_storage_dtype(params.kv_cache_dtype, params.dtype);
  p.kv_cache_dtype = params.kv_cache_dtype;
  p.block_size = block_size;
  p.attn_type = params.attn_type;
  p.causal = params.attn_type == AttentionType::Decoder && (common == nullptr || common->causal);
  p.has_sliding_window = params.sliding_window.has_value();
  p.has_soft_cap = params.logits_soft_cap.has_value() && *params.logits_soft_cap > 0.0f;
  p.has_alibi = !params.alibi_slopes.empty();
  p.has_sinks = !params.sinks.empty();
  p.per_head_kv_scales = per_head_kv_scales;
  p.wants_lse = wants_lse;
  if (common != nullptr) {
    p.num_reqs = common->num_reqs;
    p.num_tokens = common->num_actual_tokens;
    p.max_query_len = common->max_query_len;
    p.max_seq_len = common->max_seq_len;
  }
  return p;
}

void adopt_step(std::string_view where, const CommonAttentionMetadata& common, BackendMetadata& metadata) {
  metadata.facts = common.validate(where);
  metadata.common = common.with_own_host_arrays();
}

void require_supported(const ProblemSupport& plan, std::string_view backend_name) {
  if (plan.supported()) return;
  std::string joined;
  for (const std::string& r : plan.reasons) joined += (joined.empty() ? "" : "; ") + r;
  throw_unsupported(backend_name, fmt::format("this call is not supported: {}", joined));
}

}  // namespace pagedattn
