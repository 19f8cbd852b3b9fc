// Cache and state ops with one front-end each; the implementation is chosen by
// the tensors' device (CPU here; CUDA registers its own). Every op validates all
// arguments before touching memory, so a rejected call changes nothing.
#pragma once

#include <pagedattn/attention_types.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <vector>

namespace pagedattn {

// Stores key/value rows into a paged cache (vLLM's reshape_and_cache_flash).
//   key, value    [T, Hkv, D]          rows may be strided, last dim contiguous
//   key_cache     [NB, BS, Hkv, D]     any strides (NHD or HND views)
//   value_cache   [NB, BS, Hkv, D]     same shape and dtype as key_cache
//   slot_mapping  [N] i64, N <= T      slot = block * BS + offset; < 0 skips the token
//   k_scale       [1] or [Hkv] f32     read when kv_cache_dtype is fp8 (per tensor); stored = sat(x / scale)
//                 [NB, Hkv, BS] f32    written when kv_cache_dtype is int8_per_token_head or
//                                      fp8_per_token_head: one scale per (slot, KV head), any
//                                      strides (KVCacheView::key_scale; token_head_quant.h)
//   v_scale       same shape as k_scale
//   key_packing   the order of K within key_cache (kv_packing.h; KVCacheView::key_packing)
// For CacheDType::Auto (and float16/bfloat16) the cache dtype must equal the key dtype.
void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                       const TensorView& value_cache, const TensorView& slot_mapping, CacheDType kv_cache_dtype,
                       const TensorView& k_scale, const TensorView& v_scale,
                       KeyPacking key_packing = KeyPacking::None);

// Merges two partial attention results by their log-sum-exp (vLLM's
// merge_attn_states): +inf LSE is treated as -inf; when both are -inf the
// prefix output is copied and the merged LSE is -inf.
//   output        [T, H, D]
//   prefix_output [T, H, D], prefix_lse [H, T] f32
//   suffix_output [T, H, D], suffix_lse [H, T] f32
//   output_lse    [H, T] f32 or undefined
void merge_attn_states(const TensorView& output, const TensorView& prefix_output, const TensorView& prefix_lse,
                       const TensorView& suffix_output, const TensorView& suffix_lse,
                       const TensorView& output_lse = {});

// Copies slices along dimension `dim` through an index (torch's index_select
// into `dst`, with a fill where the index selects nothing). The index is
// read only on the device, never on the host, so a device step can run this
// without a sync and a CUDA graph can capture it.
//   dst    [..., N, ...]  N = index.size(0) at dimension `dim`; any strides
//   src    [..., M, ...]  dst's shape except at `dim`, dst's dtype and device; any
//                         strides; must not overlap dst
//   index  [N] i32        dst.select(dim, i) = src.select(dim, index[i]); where index[i]
//                         is outside [0, M) every element of that slice is fill_value
void index_select(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                  float fill_value = 0.0f);

// Copies whole blocks within each cache (vLLM's copy_blocks).
//   caches         each [NB, ...] (block dimension first; K and V halves passed separately)
//   block_mapping  [N, 2] i64 pairs (src, dst)
void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping);

// Per-tensor scales for fp8 KV (vLLM's calc_kv_scales): max|x| / range. An
// all-zero or empty input gives 1.0 rather than vLLM's 0, which would make the
// next fp8 store divide by zero.
struct KVScales {
  float q_scale = 1.0f;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
};
inline constexpr float kQScaleRange = 200.0f;  // vLLM's Q_SCALE_CONSTANT
inline constexpr float kKScaleRange = 200.0f;  // vLLM's K_SCALE_CONSTANT
inline constexpr float kVScaleRange = 100.0f;  // vLLM's V_SCALE_CONSTANT
KVScales calc_kv_scales(const TensorView& query, const TensorView& key, const TensorView& value);

// Device implementations register here (the CPU set is built in).
struct OpsImpl {
  virtual ~OpsImpl() = default;
  // `mode` says what k_scale and v_scale are (the front-end's comment): None
  // (unused), Fp8PerTensor (read) or a per-token-head mode (written).
  virtual void reshape_and_cache(const TensorView& key, const TensorView& value, const TensorView& key_cache,
                                 const TensorView& value_cache, const TensorView& slot_mapping,
                                 const TensorView& k_scale, const TensorView& v_scale, KVQuantMode mode,
                                 KeyPacking key_packing) = 0;
  // Whether reshape_and_cache writes K in `packing` (the front-end rejects the rest).
  virtual bool writes_key_packing(KeyPacking packing) const { return packing == KeyPacking::None; }
  virtual void merge_attn_states(const TensorView& output, const TensorView& prefix_output,
                                 const TensorView& prefix_lse, const TensorView& suffix_output,
                                 const TensorView& suffix_lse, const TensorView& output_lse) = 0;
  virtual void copy_blocks(const std::vector<TensorView>& caches, const TensorView& block_mapping) = 0;
  // fill_bits: the fill value's bytes in dst's dtype (the low element-size bytes).
  virtual void index_select(const TensorView& dst, const TensorView& src, int dim, const TensorView& index,
                            std::uint64_t fill_bits) = 0;
  virtual float abs_max(const TensorView& x) = 0;
};
void register_ops_impl(DeviceType type, OpsImpl* impl);
OpsImpl& ops_impl(DeviceType type);

}  // namespace pagedattn
