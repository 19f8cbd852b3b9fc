// The attention types a user of the library names: attention type, KV-cache
// dtype and layout, the selector's question, a layer's quantization state, a
// layer's KV-cache halves and the impl's constructor arguments. The backend
// interface (backend/backend.h) builds on them.
#pragma once

#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn {

enum class AttentionType {
  Decoder,         // causal self-attention over the paged KV cache
  Encoder,         // bidirectional encoder self-attention of an enc-dec model, no cache
  EncoderOnly,     // BERT-style bidirectional self-attention, no cache
  EncoderDecoder,  // decoder queries x encoder K/V cached once (cross-attention)
};
// vLLM's spellings: "decoder", "encoder", "encoder_only", "encoder_decoder".
std::string_view attention_type_name(AttentionType t);
std::optional<AttentionType> parse_attention_type(std::string_view name);
// Whether attention of type `t` reads its keys and values from the paged KV
// cache (decoder, cross-attention) rather than from the step's own rows.
bool reads_paged_cache(AttentionType t);

// vLLM's CacheDType strings; "fp8" means e4m3. The per-token-head dtypes
// keep one f32 scale per (slot, KV head) for K and one for V beside the
// cache (docs/kv_layouts.md, "Per-token-head scales").
enum class CacheDType { Auto, Float16, BFloat16, Fp8, Fp8E4M3, Fp8E5M2, Int8PerTokenHead, Fp8PerTokenHead };
std::string_view cache_dtype_name(CacheDType t);
std::optional<CacheDType> parse_cache_dtype(std::string_view name);
// Every CacheDType, in declaration order.
std::vector<CacheDType> all_cache_dtypes();
bool is_quantized_kv_cache(CacheDType t);
// Whether a layer hands an impl that supports_quant_query_input() queries to
// quantize: with an fp8 or fp8_e4m3 (per tensor) cache, when the attention
// reads the cache. vLLM's layer quantizes only for these dtypes (it asserts
// e4m3 and skips per-token-head caches); encoder attention, which reads its
// 16-bit key/value rows instead, keeps its queries (vLLM rejects quantized
// caches there). The impl stores q8 = sat_e4m3(q / q_scale), the cache's
// rounding, and scales the scores by q_scale as it does by k_scale.
bool quantizes_query_for(CacheDType cache, AttentionType attn_type);
// Element type stored in the cache: auto -> the model dtype, fp8 -> FP8_E4M3,
// int8_per_token_head -> I8, fp8_per_token_head -> FP8_E4M3, ...
DType kv_cache_storage_dtype(CacheDType t, DType model_dtype);

// How a quantized cache is scaled (vLLM's KVQuantMode, same values).
enum class KVQuantMode : std::uint8_t {
  None = 0,
  Fp8PerTensor = 1,      // the layer's k_scale / v_scale, [1] or [Hkv]
  Int8PerTokenHead = 2,  // a scale per (slot, KV head), written with the row
  Fp8PerTokenHead = 3,
};
KVQuantMode kv_quant_mode(CacheDType t);
// vLLM's member names: "NONE", "FP8_PER_TENSOR", "INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD".
std::string_view kv_quant_mode_name(KVQuantMode m);
bool kv_cache_uses_per_token_head_scales(KVQuantMode m);
bool kv_cache_uses_per_token_head_scales(CacheDType t);

enum class KVCacheLayout { NHD, HND };
std::string_view kv_cache_layout_name(KVCacheLayout l);
std::optional<KVCacheLayout> parse_kv_cache_layout(std::string_view name);

// What the selector is asked about (vLLM's AttentionSelectorConfig).
struct SelectorConfig {
  int head_size = 0;
  DType dtype = DType::BF16;
  CacheDType kv_cache_dtype = CacheDType::Auto;
  std::optional<int> block_size;  // only filtered on when the user set it
  bool use_mla = false;
  bool has_sink = false;
  bool use_sparse = false;
  bool use_mm_prefix = false;
  bool use_per_head_quant_scales = false;
  AttentionType attn_type = AttentionType::Decoder;
  bool use_non_causal = false;
  bool use_batch_invariant = false;
  Device device = Device::cpu();
  DeviceCapability capability{};

  // A printable key; equal configs give equal keys (the selection cache key).
  std::string str() const;
};

// Quantization state a layer exposes to its impl (vLLM's AttentionLayer protocol).
struct LayerQuantState {
  // Set by a layer whose quantizes_query() holds: the impl rounds the query
  // to e4m3 with q_scale (quantizes_query_for). An impl that does not
  // supports_quant_query_input() refuses it.
  bool quantize_query = false;
  Tensor q_scale;  // [1] f32
  Tensor k_scale;  // [1] or [num_kv_heads] f32 (per-tensor or per-KV-head)
  Tensor v_scale;  // same shape as k_scale
  Tensor prob_scale;  // [1] f32
  float q_scale_float = 1.0f;
  float k_scale_float = 1.0f;
  float v_scale_float = 1.0f;
  float prob_scale_float = 1.0f;
};

// A per-token-head cache's scales (kv_cache_scale_shape) are [num_blocks,
// 2 (K, V), num_kv_heads, block_size] f32, so one KV head's scales of a
// block's consecutive slots are contiguous; each half (KVCacheView's
// key_scale and value_scale, reshape_and_cache's k_scale and v_scale) is
// [num_blocks, num_kv_heads, block_size] with any strides
// (docs/kv_layouts.md, "Per-token-head scales"). The names below are for
// messages and the dimensions of a half.
inline constexpr std::string_view kScaleDims = "[num_blocks, 2, num_kv_heads, block_size]";
inline constexpr std::string_view kScaleHalfDims = "[num_blocks, num_kv_heads, block_size]";
inline constexpr int kScaleHalfBlockDim = 0;
inline constexpr int kScaleHalfHeadDim = 1;
inline constexpr int kScaleHalfSlotDim = 2;

// Throws InvalidArgument naming `name` unless `scale` is one half of the
// scales of a per-token-head (kv_cache_dtype) cache whose K or V half is
// `cache` [NB, BS, Hkv, D]: [NB, Hkv, BS] f32 on `device`, any strides. The
// message gives the expected and the given shape.
void check_token_scale_half(std::string_view where, std::string_view name, const TensorView& scale,
                            const TensorView& cache, CacheDType kv_cache_dtype, Device device);

// The two halves of a layer's KV cache, each logically [num_blocks, block_size,
// num_kv_heads, head_size] with whatever strides the layout gives (NHD or HND).
// K may be packed (kv_packing.h): its rows are then located by the strides
// but hold their elements in the packed order. Per-token-head caches also
// carry their scales; other caches leave them undefined.
struct KVCacheView {
  TensorView key;    // [NB, BS, Hkv, D]
  TensorView value;  // [NB, BS, Hkv, D]
  KeyPacking key_packing = KeyPacking::None;
  TensorView key_scale{};    // [NB, Hkv, BS] f32, per-token-head caches only
  TensorView value_scale{};  // [NB, Hkv, BS] f32, the same strides as key_scale
  bool defined() const { return key.defined(); }
  std::int64_t num_blocks() const { return key.size(0); }
  int block_size() const { return static_cast<int>(key.size(1)); }
};

// The impl constructor arguments, in vLLM's positional order, plus the extras.
struct AttentionImplParams {
  int num_heads = 0;
  int head_size = 0;
  float scale = 1.0f;
  int num_kv_heads = 0;
  std::vector<float> alibi_slopes;  // [num_heads] or empty
  std::optional<int> sliding_window;
  CacheDType kv_cache_dtype = CacheDType::Auto;
  std::optional<float> logits_soft_cap;
  AttentionType attn_type = AttentionType::Decoder;
  std::optional<std::string> kv_sharing_target_layer_name;
  std::vector<float> sinks;  // [num_heads] f32 sink logits, or empty
  // Chunked local attention: the step's metadata must have been split by
  // this chunk size (make_local_attention_virtual_batches).
  std::optional<int> attention_chunk_size;
  // PrefixLM (vLLM's use_mm_prefix): the step's mm_prefix_ranges widen the
  // causal mask; a layer without it refuses metadata that has ranges.
  bool use_mm_prefix = false;
  DType dtype = DType::BF16;  // model (activation) dtype
  Device device = Device::cpu();
};

}  // namespace pagedattn
