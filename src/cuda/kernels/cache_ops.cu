#include <cuda_runtime.h>
#include <math_constants.h>
#include <pagedattn/backend/token_head_quant.h>

#include "cache_ops.h"

namespace pagedattn::cuda_kernels {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 65535u;

unsigned grid_for(std::int64_t work) {
  const std::int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxGrid ? kMaxGrid : blocks));
}

template <typename T>
__device__ __forceinline__ T* at(T* base, std::int64_t elements, std::size_t element_size) {
  using Byte = std::conditional_t<std::is_const_v<T>, const unsigned char, unsigned char>;
  return static_cast<Byte*>(base) + elements * static_cast<std::int64_t>(element_size);
}

__device__ __forceinline__ std::int64_t layout_offset(const StridedLayout& l, std::int64_t linear) {
  std::int64_t off = 0;
  for (int d = l.rank - 1; d >= 0; --d) {
    const std::int64_t i = linear % l.shape[d];
    linear /= l.shape[d];
    off += i * l.strides[d];
  }
  return off;
}

// Stores one element: an exact bit copy for 16/32-bit caches, sat(x / scale)
// for fp8 (IEEE division and the scalar.h rounding, as the CPU kernel).
__device__ __forceinline__ void store_element(void* dst, const void* src, DType src_dtype, DType cache_dtype,
                                              float scale) {
  if (is_fp8(cache_dtype)) {
    store_from_float(dst, cache_dtype, __fdiv_rn(load_as_float(src, src_dtype), scale));
  } else if (dtype_size(src_dtype) == 2) {
    *static_cast<unsigned short*>(dst) = *static_cast<const unsigned short*>(src);
  } else {
    *static_cast<unsigned int*>(dst) = *static_cast<const unsigned int*>(src);
  }
}

__global__ void reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  const std::int64_t per_token = p.num_kv_heads * p.head_size;
  const std::size_t src_es = dtype_size(p.src_dtype);
  const std::size_t cache_es = dtype_size(p.cache_dtype);
  const bool quantize = is_fp8(p.cache_dtype);
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const std::int64_t slot = p.slot_mapping[t * p.slot_stride];
    if (slot < 0 || slot >= p.num_slots) continue;  // padded token
    const std::int64_t block = slot / p.block_size;
    const std::int64_t offset = slot % p.block_size;
    for (std::int64_t e = threadIdx.x; e < per_token; e += blockDim.x) {
      const std::int64_t h = e / p.head_size;
      const std::int64_t d = e % p.head_size;
      const float ks = quantize ? p.k_scale[h * p.k_scale_stride] : 1.0f;
      const float vs = quantize ? p.v_scale[h * p.v_scale_stride] : 1.0f;
      store_element(at(p.key_cache, block * p.kc_block + offset * p.kc_slot + h * p.kc_head + d, cache_es),
                    at(p.key, t * p.key_token_stride + h * p.key_head_stride + d, src_es), p.src_dtype,
                    p.cache_dtype, ks);
      store_element(at(p.value_cache, block * p.vc_block + offset * p.vc_slot + h * p.vc_head + d, cache_es),
                    at(p.value, t * p.value_token_stride + h * p.value_head_stride + d, src_es), p.src_dtype,
                    p.cache_dtype, vs);
    }
  }
}

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;

// One (token, KV head) row of a per-token-head cache, by one warp: the
// row's amax (NaN-propagating), then every element quantized with the
// shared scale (token_head_quant.h, the CPU kernel's rule). Returns the scale.
__device__ float store_token_head_row(void* dst, const void* src, std::int64_t head_size, DType src_dtype,
                                      DType cache_dtype, int lane) {
  const std::size_t src_es = dtype_size(src_dtype);
  const std::size_t cache_es = dtype_size(cache_dtype);
  float amax = 0.0f;
  for (std::int64_t d = lane; d < head_size; d += kWarpSize) {
    amax = token_head_amax(amax, load_as_float(at(src, d, src_es), src_dtype));
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    amax = token_head_amax(amax, __shfl_xor_sync(kFullWarp, amax, offset));
  }
  const float scale = token_head_scale(amax, cache_dtype);
  const float inv_scale = token_head_inv_scale(scale);
  for (std::int64_t d = lane; d < head_size; d += kWarpSize) {
    store_token_head(at(dst, d, cache_es), cache_dtype, load_as_float(at(src, d, src_es), src_dtype),
                     inv_scale);
  }
  return scale;
}

__global__ void reshape_and_cache_token_head_kernel(const ReshapeAndCacheParams p) {
  const std::size_t src_es = dtype_size(p.src_dtype);
  const std::size_t cache_es = dtype_size(p.cache_dtype);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int warps = static_cast<int>(blockDim.x) / kWarpSize;
  for (std::int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const std::int64_t slot = p.slot_mapping[t * p.slot_stride];
    if (slot < 0 || slot >= p.num_slots) continue;  // padded token
    const std::int64_t block = slot / p.block_size;
    const std::int64_t offset = slot % p.block_size;
    for (std::int64_t h = warp; h < p.num_kv_heads; h += warps) {
      const float ks = store_token_head_row(
          at(p.key_cache, block * p.kc_block + offset * p.kc_slot + h * p.kc_head, cache_es),
          at(p.key, t * p.key_token_stride + h * p.key_head_stride, src_es), p.head_size, p.src_dtype,
          p.cache_dtype, lane);
      const float vs = store_token_head_row(
          at(p.value_cache, block * p.vc_block + offset * p.vc_slot + h * p.vc_head, cache_es),
          at(p.value, t * p.value_token_stride + h * p.value_head_stride, src_es), p.head_size, p.src_dtype,
          p.cache_dtype, lane);
      if (lane == 0) {
        p.k_token_scale[block * p.ks_block + offset * p.ks_slot + h * p.ks_head] = ks;
        p.v_token_scale[block * p.vs_block + offset * p.vs_slot + h * p.vs_head] = vs;
      }
    }
  }
}

__global__ void merge_attn_states_kernel(const MergeAttnStatesParams p) {
  const std::size_t es = dtype_size(p.dtype);
  const std::int64_t total = p.num_tokens * p.num_heads * p.head_size;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e % p.head_size;
    const std::int64_t h = (e / p.head_size) % p.num_heads;
    const std::int64_t t = e / (p.head_size * p.num_heads);
    float p_lse = p.prefix_lse[h * p.pre_lse_head + t * p.pre_lse_token];
    float s_lse = p.suffix_lse[h * p.suf_lse_head + t * p.suf_lse_token];
    // vLLM's rule: an infinite LSE (either sign) contributes nothing.
    if (isinf(p_lse)) p_lse = -CUDART_INF_F;
    if (isinf(s_lse)) s_lse = -CUDART_INF_F;
    const float max_lse = fmaxf(p_lse, s_lse);
    void* out = at(p.output, t * p.out_token + h * p.out_head + i, es);
    const void* pre = at(p.prefix_output, t * p.pre_token + h * p.pre_head + i, es);
    const void* suf = at(p.suffix_output, t * p.suf_token + h * p.suf_head + i, es);
    float* out_lse = (p.output_lse != nullptr && i == 0) ? p.output_lse + h * p.out_lse_head + t * p.out_lse_token
                                                          : nullptr;
    if (max_lse == -CUDART_INF_F) {
      // Neither side saw a key: keep the prefix output's bits.
      store_element(out, pre, p.dtype, p.dtype, 1.0f);
      if (out_lse != nullptr) *out_lse = -CUDART_INF_F;
      continue;
    }
    const float p_se = expf(p_lse - max_lse);
    const float s_se = expf(s_lse - max_lse);
    const float out_se = p_se + s_se;
    const float v = load_as_float(pre, p.dtype) * (p_se / out_se) + load_as_float(suf, p.dtype) * (s_se / out_se);
    store_from_float(out, p.dtype, v);
    if (out_lse != nullptr) *out_lse = logf(out_se) + max_lse;
  }
}

__global__ void copy_blocks_kernel(const CopyBlocksParams p) {
  std::int64_t per_block = 1;
  for (int d = 0; d < p.block.rank; ++d) per_block *= p.block.shape[d];
  for (std::int64_t r = blockIdx.y; r < p.num_pairs; r += gridDim.y) {
    const std::int64_t src = p.block_mapping[r * p.mapping_row_stride];
    const std::int64_t dst = p.block_mapping[r * p.mapping_row_stride + p.mapping_col_stride];
    if (src == dst) continue;
    for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < per_block;
         e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
      const std::int64_t off = layout_offset(p.block, e);
      const unsigned char* s = at(static_cast<const unsigned char*>(p.cache), src * p.block_stride + off, p.element_size);
      unsigned char* d = at(static_cast<unsigned char*>(p.cache), dst * p.block_stride + off, p.element_size);
      for (std::size_t b = 0; b < p.element_size; ++b) d[b] = s[b];
    }
  }
}

__global__ void index_select_kernel(const IndexSelectParams p) {
  const StridedLayout& slice = p.dst_slice;
  std::int64_t per_row = 1;
  for (int d = 0; d < slice.rank; ++d) per_row *= slice.shape[d];
  const std::int64_t total = p.num_rows * per_row;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = e / per_row;
    const std::int64_t row = p.index[i * p.index_stride];
    const bool fill = row < 0 || row >= p.src_rows;
    // Row-major position of e within its row, as offsets under both strides.
    std::int64_t rest = e % per_row;
    std::int64_t dst_off = i * p.dst_row_stride;
    std::int64_t src_off = row * p.src_row_stride;
    for (int d = slice.rank - 1; d >= 0; --d) {
      const std::int64_t idx = rest % slice.shape[d];
      rest /= slice.shape[d];
      dst_off += idx * slice.strides[d];
      src_off += idx * p.src_slice_strides[d];
    }
    unsigned char* d = at(static_cast<unsigned char*>(p.dst), dst_off, p.element_size);
    const unsigned char* s = fill ? reinterpret_cast<const unsigned char*>(&p.fill_bits)
                                  : at(static_cast<const unsigned char*>(p.src), src_off, p.element_size);
    for (std::size_t b = 0; b < p.element_size; ++b) d[b] = s[b];
  }
}

__global__ void abs_max_kernel(const AbsMaxParams p) {
  std::int64_t total = 1;
  for (int d = 0; d < p.layout.rank; ++d) total *= p.layout.shape[d];
  const std::size_t es = dtype_size(p.dtype);
  float local = 0.0f;
  bool nan = false;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float v = fabsf(load_as_float(at(p.data, layout_offset(p.layout, e), es), p.dtype));
    if (isnan(v)) nan = true;
    local = fmaxf(local, v);
  }
  // Non-negative floats order like their bit patterns.
  atomicMax(p.result, __float_as_uint(local));
  if (nan) atomicExch(p.saw_nan, 1u);
}

}  // namespace

int launch_reshape_and_cache(const ReshapeAndCacheParams& p, void* stream) {
  if (p.num_tokens == 0) return 0;
  if (p.k_token_scale != nullptr) {
    reshape_and_cache_token_head_kernel<<<grid_for(p.num_tokens * kThreads), kThreads, 0,
                                          static_cast<cudaStream_t>(stream)>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  reshape_and_cache_kernel<<<grid_for(p.num_tokens * kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_merge_attn_states(const MergeAttnStatesParams& p, void* stream) {
  const std::int64_t total = p.num_tokens * p.num_heads * p.head_size;
  if (total == 0) return 0;
  merge_attn_states_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_copy_blocks(const CopyBlocksParams& p, void* stream) {
  std::int64_t per_block = 1;
  for (int d = 0; d < p.block.rank; ++d) per_block *= p.block.shape[d];
  if (p.num_pairs == 0 || per_block == 0) return 0;
  const dim3 grid(grid_for(per_block), static_cast<unsigned>(p.num_pairs < kMaxGrid ? p.num_pairs : kMaxGrid));
  copy_blocks_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_index_select(const IndexSelectParams& p, void* stream) {
  std::int64_t per_row = 1;
  for (int d = 0; d < p.dst_slice.rank; ++d) per_row *= p.dst_slice.shape[d];
  const std::int64_t total = p.num_rows * per_row;
  if (total == 0) return 0;
  index_select_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

int launch_abs_max(const AbsMaxParams& p, void* stream) {
  std::int64_t total = 1;
  for (int d = 0; d < p.layout.rank; ++d) total *= p.layout.shape[d];
  if (total == 0) return 0;
  abs_max_kernel<<<grid_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pagedattn::cuda_kernels
