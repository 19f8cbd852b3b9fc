// CPU kernels of the cache and state ops: raw pointers and POD params only
// (docs/architecture.md, the dependency rule). Every argument has been validated by the op's
// front-end, so the kernels cannot fail and return nothing. Strides are in
// elements; the last dimension of every row is contiguous unless a layout
// below says otherwise.
#pragma once

#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn::cpu_kernels {

inline constexpr int kMaxLayoutDims = 6;

// Shape and strides of an arbitrary strided block of elements.
struct StridedLayout {
  int rank = 0;
  std::int64_t shape[kMaxLayoutDims] = {};
  std::int64_t strides[kMaxLayoutDims] = {};
};

// Strides of a [T, H, D] token-major tensor.
struct RowStrides {
  std::int64_t token = 0;
  std::int64_t head = 0;
};

// Strides of a [NB, BS, Hkv, D] cache (NHD and HND are both just strides).
struct CacheStrides {
  std::int64_t block = 0;
  std::int64_t slot = 0;
  std::int64_t head = 0;
};

// Strides of an [H, T] log-sum-exp tensor.
struct LseStrides {
  std::int64_t head = 0;
  std::int64_t token = 0;
};

struct ReshapeAndCacheParams {
  const void* key = nullptr;                   // [T, Hkv, D] src_dtype
  const void* value = nullptr;                 // [T, Hkv, D] src_dtype
  void* key_cache = nullptr;                   // [NB, BS, Hkv, D] cache_dtype
  void* value_cache = nullptr;                 // [NB, BS, Hkv, D] cache_dtype
  const std::int64_t* slot_mapping = nullptr;  // [num_tokens]; < 0 skips the token
  // fp8 caches only: the scale of head h is k_scale[h * k_scale_stride]
  // (stride 0 = one per-tensor scale).
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  std::int64_t k_scale_stride = 0;
  std::int64_t v_scale_stride = 0;
  std::int64_t slot_stride = 1;
  std::int64_t num_tokens = 0;  // slot_mapping length (<= T)
  std::int64_t num_kv_heads = 0;
  std::int64_t head_size = 0;
  std::int64_t block_size = 0;
  RowStrides key_strides;
  RowStrides value_strides;
  CacheStrides key_cache_strides;
  CacheStrides value_cache_strides;
  DType src_dtype = DType::BF16;
  DType cache_dtype = DType::BF16;  // fp8: quantized stores; otherwise == src_dtype, bits copied
  KeyPacking key_packing = KeyPacking::None;  // K's order within a block (key_cache slot stride == head_size if packed)
  // Per-token-head caches (cache_dtype I8 or FP8_E4M3; token_head_quant.h;
  // K row-major): each row is quantized with its own scale, written here
  // ([NB, Hkv, BS] f32); k_scale and v_scale are then unused. Null otherwise.
  float* k_token_scale = nullptr;
  float* v_token_scale = nullptr;
  CacheStrides k_token_scale_strides;
  CacheStrides v_token_scale_strides;
};
void reshape_and_cache(const ReshapeAndCacheParams& p);

struct MergeAttnStatesParams {
  void* output = nullptr;               // [T, H, D] dtype
  const void* prefix_output = nullptr;  // [T, H, D] dtype
  const void* suffix_output = nullptr;  // [T, H, D] dtype
  const float* prefix_lse = nullptr;    // [H, T]
  const float* suffix_lse = nullptr;    // [H, T]
  float* output_lse = nullptr;          // [H, T] or null
  std::int64_t num_tokens = 0;
  std::int64_t num_heads = 0;
  std::int64_t head_size = 0;
  RowStrides output_strides;
  RowStrides prefix_strides;
  RowStrides suffix_strides;
  LseStrides prefix_lse_strides;
  LseStrides suffix_lse_strides;
  LseStrides output_lse_strides;
  DType dtype = DType::BF16;
};
void merge_attn_states(const MergeAttnStatesParams& p);

struct CopyBlocksParams {
  void* cache = nullptr;  // [NB, ...block]
  std::size_t element_size = 0;
  std::int64_t block_stride = 0;
  StridedLayout block;                          // one block: the cache without its first dimension
  const std::int64_t* block_mapping = nullptr;  // [num_pairs, 2] (src, dst), all in [0, NB)
  std::int64_t mapping_row_stride = 2;
  std::int64_t mapping_col_stride = 1;
  std::int64_t num_pairs = 0;
};
void copy_blocks(const CopyBlocksParams& p);

// Copies slices along one dimension through an index (the index_select op):
// dst row i = src row index[i], or fill_bits in every element where index[i]
// is outside [0, src_rows).
struct IndexSelectParams {
  void* dst = nullptr;                  // rows of dst_slice, dst_row_stride apart
  const void* src = nullptr;            // rows of dst_slice's shape, src_row_stride apart
  const std::int32_t* index = nullptr;  // [num_rows]
  std::int64_t index_stride = 1;
  std::int64_t num_rows = 0;  // dst's size along the indexed dimension
  std::int64_t src_rows = 0;  // src's size along it
  std::int64_t dst_row_stride = 0;
  std::int64_t src_row_stride = 0;
  StridedLayout dst_slice;                              // one dst row: shape and strides
  std::int64_t src_slice_strides[kMaxLayoutDims] = {};  // one src row's strides (same shape)
  std::size_t element_size = 0;
  std::uint64_t fill_bits = 0;  // the fill value's bytes (the low element_size bytes)
};
void index_select(const IndexSelectParams& p);

struct AbsMaxParams {
  const void* data = nullptr;
  DType dtype = DType::F32;
  StridedLayout layout;  // any strides
};
// max |x| over every element; NaN if any element is NaN; 0 for no elements.
float abs_max(const AbsMaxParams& p);

}  // namespace pagedattn::cpu_kernels
