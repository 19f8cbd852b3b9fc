// The REFERENCE attention kernel: scalar, fp64 accumulation, no tiling, one
// (token, head) row at a time. It implements docs/semantics.md literally so
// that it can serve as the oracle every other backend is checked against.
//
// Raw pointers and a POD params struct only (no core headers): the backend
// validates every argument before filling the struct.
#pragma once

#include <pagedattn/backend/attention_variant.h>
#include <pagedattn/backend/scalar.h>

#include <cstddef>
#include <cstdint>

namespace pagedattn::reference {

struct ReferenceAttentionParams {
  // ---- problem ----
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  AttentionVariant variant;  // computed in double from its float fields

  // ---- batch (host memory) ----
  int num_reqs = 0;
  int num_actual_tokens = 0;
  const std::int32_t* query_start_loc = nullptr;  // [num_reqs + 1]
  const std::int32_t* seq_lens = nullptr;         // [num_reqs]; ignored for DenseRows
  const std::int32_t* block_table = nullptr;      // [num_reqs, block_table_row_stride]
  std::int64_t block_table_row_stride = 0;

  // ---- inputs ----
  RowsOperand query;         // [T, H, D]
  RowsOperand key;           // [T, Hkv, D], DenseRows only
  RowsOperand value;         // [T, Hkv, D], DenseRows only
  CacheOperand key_cache;    // PagedCache only
  CacheOperand value_cache;  // PagedCache only
  DType cache_dtype = DType::BF16;
  int block_size = 0;
  // Dequantization scales of an fp8 cache (null otherwise): [num_kv_scales]
  // with num_kv_scales 1 (per tensor) or num_kv_heads (per KV head).
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int num_kv_scales = 0;
  // Per-token-head scales of an int8 or fp8 per-token-head cache (data null
  // otherwise): key j of a request is read as stored * its slot's scale.
  ScaleOperand k_token_scale;
  ScaleOperand v_token_scale;

  // ---- outputs ----
  void* output = nullptr;  // [T, H, D], rows < num_actual_tokens written
  DType output_dtype = DType::F32;
  std::int64_t output_row_stride = 0;
  std::int64_t output_head_stride = 0;
  float* lse = nullptr;  // [H, T] or null
  std::int64_t lse_head_stride = 0;
  std::int64_t lse_token_stride = 0;

  // ---- scratch (host memory owned by the caller) ----
  double* scratch = nullptr;
  std::size_t scratch_len = 0;  // at least reference_attention_scratch_len(params)
};

enum class ReferenceStatus : std::uint8_t {
  Ok = 0,
  ScratchTooSmall,
};

const char* reference_status_name(ReferenceStatus status);

// Doubles of scratch the kernel needs for these params (reads the host batch arrays).
std::size_t reference_attention_scratch_len(const ReferenceAttentionParams& params);
// The same for head size `head_size` and requests of at most `max_keys` keys.
std::size_t reference_attention_scratch_len(int head_size, int max_keys);

// Computes attention for every row < num_actual_tokens of a batch the caller
// validated (the step plan: block ids within the cache, consistent offsets and
// lengths). Returns ScratchTooSmall, writing nothing, when the scratch is short.
ReferenceStatus reference_attention(const ReferenceAttentionParams& params);

}  // namespace pagedattn::reference
