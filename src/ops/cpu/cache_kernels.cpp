#include "ops/cpu/cache_kernels.h"

#include <pagedattn/backend/token_head_quant.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

namespace pagedattn::cpu_kernels {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Byte pointer `elements` elements of `element_size` bytes past `base`.
template <typename T>
T* at(T* base, std::int64_t elements, std::size_t element_size) {
  using Byte = std::conditional_t<std::is_const_v<T>, const std::uint8_t, std::uint8_t>;
  return static_cast<Byte*>(base) + elements * static_cast<std::int64_t>(element_size);
}

std::int64_t numel(const StridedLayout& l) {
  std::int64_t n = 1;
  for (int d = 0; d < l.rank; ++d) n *= l.shape[d];
  return n;
}

// Calls fn(offset) for every element of the layout in row-major order (once,
// at offset 0, for rank 0).
template <typename Fn>
void for_each_offset(const StridedLayout& l, Fn&& fn) {
  if (numel(l) == 0) return;
  if (l.rank == 0) {
    fn(std::int64_t{0});
    return;
  }
  std::array<std::int64_t, kMaxLayoutDims> index{};
  const int last = l.rank - 1;
  while (true) {
    std::int64_t base = 0;
    for (int d = 0; d < last; ++d) base += index[static_cast<std::size_t>(d)] * l.strides[d];
    for (std::int64_t i = 0; i < l.shape[last]; ++i) fn(base + i * l.strides[last]);
    int d = last - 1;
    for (; d >= 0; --d) {
      auto& id = index[static_cast<std::size_t>(d)];
      if (++id < l.shape[d]) break;
      id = 0;
    }
    if (d < 0) return;
  }
}

// True when the elements fill [0, numel) exactly in some dimension order, so
// the whole block can be moved as one span (NHD and HND blocks both are).
bool is_dense(const StridedLayout& l) {
  std::array<std::pair<std::int64_t, std::int64_t>, kMaxLayoutDims> dims{};  // (stride, size)
  std::size_t n = 0;
  for (int d = 0; d < l.rank; ++d) {
    if (l.shape[d] != 1) dims[n++] = {l.strides[d], l.shape[d]};
  }
  // Insertion sort by stride: at most kMaxLayoutDims entries.
  for (std::size_t i = 1; i < n; ++i) {
    for (std::size_t j = i; j > 0 && dims[j].first < dims[j - 1].first; --j) std::swap(dims[j], dims[j - 1]);
  }
  std::int64_t expected = 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (dims[i].first != expected) return false;
    expected *= dims[i].second;
  }
  return true;
}

// Stores one [D] row into the cache: quantized for fp8, else an exact bit copy.
// `slot` is the row's slot in its block: with a packed K, dst points at the
// slot's row-major position and element i goes to key_offset_in_block.
void store_row(void* dst, const void* src, std::int64_t head_size, DType src_dtype, DType cache_dtype,
               float scale, KeyPacking packing, std::int64_t slot) {
  const std::size_t src_es = dtype_size(src_dtype);
  if (packing == KeyPacking::None && !is_fp8(cache_dtype)) {
    std::memcpy(dst, src, static_cast<std::size_t>(head_size) * src_es);
    return;
  }
  const std::size_t cache_es = dtype_size(cache_dtype);
  const auto d_size = static_cast<int>(head_size);
  const auto s = static_cast<int>(slot);
  const std::int64_t row_major_start = key_offset_in_block(KeyPacking::None, s, 0, d_size);
  for (int i = 0; i < d_size; ++i) {
    void* out = at(dst, key_offset_in_block(packing, s, i, d_size) - row_major_start, cache_es);
    if (is_fp8(cache_dtype)) {
      store_from_float(out, cache_dtype, load_as_float(at(src, i, src_es), src_dtype) / scale);
    } else {
      std::memcpy(out, at(src, i, src_es), src_es);
    }
  }
}

// Stores one [D] row of a per-token-head cache (token_head_quant.h; always
// row-major) and returns its scale.
float store_token_head_row(void* dst, const void* src, std::int64_t head_size, DType src_dtype,
                           DType cache_dtype) {
  const std::size_t src_es = dtype_size(src_dtype);
  const std::size_t cache_es = dtype_size(cache_dtype);
  const auto d_size = static_cast<int>(head_size);
  float amax = 0.0f;
  for (int i = 0; i < d_size; ++i) amax = token_head_amax(amax, load_as_float(at(src, i, src_es), src_dtype));
  const float scale = token_head_scale(amax, cache_dtype);
  const float inv_scale = token_head_inv_scale(scale);
  for (int i = 0; i < d_size; ++i) {
    store_token_head(at(dst, i, cache_es), cache_dtype, load_as_float(at(src, i, src_es), src_dtype),
                     inv_scale);
  }
  return scale;
}

}  // namespace

void reshape_and_cache(const ReshapeAndCacheParams& p) {
  const std::size_t src_es = dtype_size(p.src_dtype);
  const std::size_t cache_es = dtype_size(p.cache_dtype);
  const bool token_head = p.k_token_scale != nullptr;
  const bool quantize = is_fp8(p.cache_dtype) && !token_head;
  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    const std::int64_t slot = p.slot_mapping[t * p.slot_stride];
    if (slot < 0) continue;  // padded token
    const std::int64_t block = slot / p.block_size;
    const std::int64_t offset = slot % p.block_size;
    for (std::int64_t h = 0; h < p.num_kv_heads; ++h) {
      if (token_head) {
        const CacheStrides& kc = p.key_cache_strides;
        const CacheStrides& vc = p.value_cache_strides;
        const CacheStrides& ks = p.k_token_scale_strides;
        const CacheStrides& vs = p.v_token_scale_strides;
        p.k_token_scale[block * ks.block + offset * ks.slot + h * ks.head] =
            store_token_head_row(at(p.key_cache, block * kc.block + offset * kc.slot + h * kc.head, cache_es),
                                 at(p.key, t * p.key_strides.token + h * p.key_strides.head, src_es),
                                 p.head_size, p.src_dtype, p.cache_dtype);
        p.v_token_scale[block * vs.block + offset * vs.slot + h * vs.head] = store_token_head_row(
            at(p.value_cache, block * vc.block + offset * vc.slot + h * vc.head, cache_es),
            at(p.value, t * p.value_strides.token + h * p.value_strides.head, src_es), p.head_size,
            p.src_dtype, p.cache_dtype);
        continue;
      }
      const float k_scale = quantize ? p.k_scale[h * p.k_scale_stride] : 1.0f;
      const float v_scale = quantize ? p.v_scale[h * p.v_scale_stride] : 1.0f;
      const CacheStrides& kc = p.key_cache_strides;
      const CacheStrides& vc = p.value_cache_strides;
      store_row(at(p.key_cache, block * kc.block + offset * kc.slot + h * kc.head, cache_es),
                at(p.key, t * p.key_strides.token + h * p.key_strides.head, src_es), p.head_size, p.src_dtype,
                p.cache_dtype, k_scale, p.key_packing, offset);
      store_row(at(p.value_cache, block * vc.block + offset * vc.slot + h * vc.head, cache_es),
                at(p.value, t * p.value_strides.token + h * p.value_strides.head, src_es), p.head_size,
                p.src_dtype, p.cache_dtype, v_scale, KeyPacking::None, offset);
    }
  }
}

void merge_attn_states(const MergeAttnStatesParams& p) {
  const std::size_t es = dtype_size(p.dtype);
  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    for (std::int64_t h = 0; h < p.num_heads; ++h) {
      float p_lse = p.prefix_lse[h * p.prefix_lse_strides.head + t * p.prefix_lse_strides.token];
      float s_lse = p.suffix_lse[h * p.suffix_lse_strides.head + t * p.suffix_lse_strides.token];
      // vLLM's rule: an infinite LSE (either sign) contributes nothing.
      if (std::isinf(p_lse)) p_lse = kNegInf;
      if (std::isinf(s_lse)) s_lse = kNegInf;
      const float max_lse = std::fmax(p_lse, s_lse);
      void* out = at(p.output, t * p.output_strides.token + h * p.output_strides.head, es);
      const void* pre = at(p.prefix_output, t * p.prefix_strides.token + h * p.prefix_strides.head, es);
      const void* suf = at(p.suffix_output, t * p.suffix_strides.token + h * p.suffix_strides.head, es);
      float* out_lse = p.output_lse
                           ? p.output_lse + h * p.output_lse_strides.head + t * p.output_lse_strides.token
                           : nullptr;
      if (max_lse == kNegInf) {
        // Neither side saw a key: keep the prefix output (bits unchanged).
        std::memmove(out, pre, static_cast<std::size_t>(p.head_size) * es);
        if (out_lse) *out_lse = kNegInf;
        continue;
      }
      const float p_se = std::exp(p_lse - max_lse);
      const float s_se = std::exp(s_lse - max_lse);
      const float out_se = p_se + s_se;
      const float p_scale = p_se / out_se;
      const float s_scale = s_se / out_se;
      for (std::int64_t i = 0; i < p.head_size; ++i) {
        const float v = load_as_float(at(pre, i, es), p.dtype) * p_scale +
                        load_as_float(at(suf, i, es), p.dtype) * s_scale;
        store_from_float(at(out, i, es), p.dtype, v);
      }
      if (out_lse) *out_lse = std::log(out_se) + max_lse;
    }
  }
}

void copy_blocks(const CopyBlocksParams& p) {
  const bool dense = is_dense(p.block);
  const std::size_t block_bytes = static_cast<std::size_t>(numel(p.block)) * p.element_size;
  for (std::int64_t r = 0; r < p.num_pairs; ++r) {
    const std::int64_t src = p.block_mapping[r * p.mapping_row_stride];
    const std::int64_t dst = p.block_mapping[r * p.mapping_row_stride + p.mapping_col_stride];
    if (src == dst) continue;
    const void* src_base = at(static_cast<const void*>(p.cache), src * p.block_stride, p.element_size);
    void* dst_base = at(p.cache, dst * p.block_stride, p.element_size);
    if (dense) {
      std::memmove(dst_base, src_base, block_bytes);
      continue;
    }
    for_each_offset(p.block, [&](std::int64_t off) {
      std::memmove(at(dst_base, off, p.element_size), at(src_base, off, p.element_size), p.element_size);
    });
  }
}

void index_select(const IndexSelectParams& p) {
  const StridedLayout& slice = p.dst_slice;
  const std::int64_t per_row = numel(slice);
  for (std::int64_t i = 0; i < p.num_rows; ++i) {
    const std::int64_t row = p.index[i * p.index_stride];
    const bool fill = row < 0 || row >= p.src_rows;
    void* dst_row = at(p.dst, i * p.dst_row_stride, p.element_size);
    const void* src_row = fill ? nullptr : at(p.src, row * p.src_row_stride, p.element_size);
    for (std::int64_t e = 0; e < per_row; ++e) {
      // Row-major position e of the slice, as offsets under both strides.
      std::int64_t rest = e;
      std::int64_t dst_off = 0;
      std::int64_t src_off = 0;
      for (int d = slice.rank - 1; d >= 0; --d) {
        const std::int64_t idx = rest % slice.shape[d];
        rest /= slice.shape[d];
        dst_off += idx * slice.strides[d];
        src_off += idx * p.src_slice_strides[d];
      }
      std::memcpy(at(dst_row, dst_off, p.element_size),
                  fill ? static_cast<const void*>(&p.fill_bits) : at(src_row, src_off, p.element_size),
                  p.element_size);
    }
  }
}

float abs_max(const AbsMaxParams& p) {
  const std::size_t es = dtype_size(p.dtype);
  float result = 0.0f;
  bool nan = false;
  for_each_offset(p.layout, [&](std::int64_t off) {
    const float v = std::fabs(load_as_float(at(p.data, off, es), p.dtype));
    if (std::isnan(v)) nan = true;
    result = std::max(result, v);
  });
  return nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

}  // namespace pagedattn::cpu_kernels
