// CUDA kernels of the cache and state ops: raw pointers and POD params only
// (docs/architecture.md, the dependency rule). The op front-ends validated every argument; the
// launchers return a cudaError_t value (0 = success).
#pragma once

#include <pagedattn/backend/scalar.h>

#include <cstddef>
#include <cstdint>

namespace pagedattn::cuda_kernels {

inline constexpr int kMaxLayoutDims = 6;

struct StridedLayout {
  int rank = 0;
  std::int64_t shape[kMaxLayoutDims] = {};
  std::int64_t strides[kMaxLayoutDims] = {};
};

struct ReshapeAndCacheParams {
  const void* key = nullptr;    // [T, Hkv, D]
  const void* value = nullptr;  // [T, Hkv, D]
  void* key_cache = nullptr;    // [NB, BS, Hkv, D]
  void* value_cache = nullptr;
  const std::int64_t* slot_mapping = nullptr;  // [N]
  std::int64_t slot_stride = 1;
  const float* k_scale = nullptr;  // fp8 only: [1] or [Hkv]
  const float* v_scale = nullptr;
  std::int64_t k_scale_stride = 0;  // 0 = per tensor
  std::int64_t v_scale_stride = 0;
  std::int64_t num_tokens = 0;  // N: tokens written
  std::int64_t num_kv_heads = 0;
  std::int64_t head_size = 0;
  std::int64_t block_size = 0;
  std::int64_t num_slots = 0;  // NB * BS: larger slots are skipped, never written
  std::int64_t key_token_stride = 0, key_head_stride = 0;
  std::int64_t value_token_stride = 0, value_head_stride = 0;
  std::int64_t kc_block = 0, kc_slot = 0, kc_head = 0;
  std::int64_t vc_block = 0, vc_slot = 0, vc_head = 0;
  DType src_dtype = DType::BF16;
  DType cache_dtype = DType::BF16;
  // Per-token-head caches (token_head_quant.h): each row's scale is written
  // here ([NB, Hkv, BS] f32) and k_scale / v_scale are unused; null otherwise.
  float* k_token_scale = nullptr;
  float* v_token_scale = nullptr;
  std::int64_t ks_block = 0, ks_slot = 0, ks_head = 0;
  std::int64_t vs_block = 0, vs_slot = 0, vs_head = 0;
};

struct MergeAttnStatesParams {
  void* output = nullptr;  // [T, H, D]
  const void* prefix_output = nullptr;
  const void* suffix_output = nullptr;
  const float* prefix_lse = nullptr;  // [H, T]
  const float* suffix_lse = nullptr;
  float* output_lse = nullptr;  // [H, T] or null
  std::int64_t num_tokens = 0, num_heads = 0, head_size = 0;
  std::int64_t out_token = 0, out_head = 0;
  std::int64_t pre_token = 0, pre_head = 0;
  std::int64_t suf_token = 0, suf_head = 0;
  std::int64_t pre_lse_head = 0, pre_lse_token = 0;
  std::int64_t suf_lse_head = 0, suf_lse_token = 0;
  std::int64_t out_lse_head = 0, out_lse_token = 0;
  DType dtype = DType::BF16;
};

struct CopyBlocksParams {
  void* cache = nullptr;  // [NB, ...]
  std::size_t element_size = 0;
  std::int64_t block_stride = 0;
  StridedLayout block;  // one block's elements
  const std::int64_t* block_mapping = nullptr;  // [N, 2] (src, dst)
  std::int64_t mapping_row_stride = 0, mapping_col_stride = 0;
  std::int64_t num_pairs = 0;
};

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

struct AbsMaxParams {
  const void* data = nullptr;
  DType dtype = DType::F32;
  StridedLayout layout;
  unsigned int* result = nullptr;  // device: float bits of max|x| (0 on entry)
  unsigned int* saw_nan = nullptr;  // device: set to 1 on a NaN (0 on entry)
};

int launch_reshape_and_cache(const ReshapeAndCacheParams& p, void* stream);
int launch_merge_attn_states(const MergeAttnStatesParams& p, void* stream);
int launch_copy_blocks(const CopyBlocksParams& p, void* stream);
int launch_index_select(const IndexSelectParams& p, void* stream);
int launch_abs_max(const AbsMaxParams& p, void* stream);

}  // namespace pagedattn::cuda_kernels
