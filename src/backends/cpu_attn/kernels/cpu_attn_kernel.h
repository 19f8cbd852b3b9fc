// The CPU_ATTN attention kernel: tiled online softmax over a paged (or dense)
// KV source, one work item = (request, KV head, query tile, KV range). Every
// query head of the KV head's GQA group is processed against each K/V tile, so
// a tile is loaded and dequantized once per group.
//
// Raw pointers and POD params only (no core headers): the backend validates
// every argument, builds the work list and chooses the kernel variant
// (cpu_attn_variant.h) before calling in. SIMD code is compiled once per
// Highway target (AVX-512, AVX2, portable scalar), one unit per algorithm
// (cpu_attn_decode.cpp, cpu_attn_prefill.cpp, cpu_attn_merge.cpp), and the
// target is chosen at run time (cpu_attn_isa.h).
#pragma once

#include <pagedattn/backend/attention_variant.h>
#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/backend/scalar.h>

#include "backends/cpu_attn/kernels/cpu_attn_variant.h"

#include <cstddef>
#include <cstdint>

namespace pagedattn::cpu_attn {

struct AttentionParams {
  // ---- problem ----
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;  // a multiple of 8
  AttentionVariant variant;  // alibi_slopes, sinks ([num_heads]) and mm_prefix: host arrays, or null

  // ---- batch (host memory) ----
  const std::int32_t* query_start_loc = nullptr;  // [num_reqs + 1]
  const std::int32_t* seq_lens = nullptr;         // [num_reqs] keys per request (PagedCache)
  const std::int32_t* block_table = nullptr;      // [num_reqs, block_table_row_stride]
  std::int64_t block_table_row_stride = 0;
  int block_size = 0;

  // ---- inputs ----
  RowsOperand query;  // [T, H, D]
  RowsOperand key;    // [T, Hkv, D], DenseRows only
  RowsOperand value;  // [T, Hkv, D], DenseRows only
  CacheOperand key_cache;    // PagedCache only
  CacheOperand value_cache;  // PagedCache only
  DType kv_dtype = DType::BF16;  // element type of the K/V source
  // fp8 dequantization scales ([1] per tensor or [Hkv] per head), null otherwise.
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  bool per_head_kv_scales = false;
  // Per-token-head caches (kv_dtype I8 or FP8_E4M3, K row-major): each key's
  // K and V scale. Items convert a tile's rows to f32 times their scales
  // (Scratch::ks, Scratch::vf) and run the f32 kernels (choose_kernel_variant).
  ScaleOperand k_token_scale;
  ScaleOperand v_token_scale;

  // ---- outputs ----
  void* output = nullptr;  // [T, H, D] in the query dtype
  std::int64_t output_row_stride = 0;
  std::int64_t output_head_stride = 0;
  float* lse = nullptr;  // [H, T] or null
  std::int64_t lse_head_stride = 0;
  std::int64_t lse_token_stride = 0;
};

// Whether the K/V rows carry per-token-head scales.
inline bool token_scaled(const AttentionParams& p) { return p.k_token_scale.data != nullptr; }

// One unit of parallel work. Keys outside each row's visible interval are
// masked inside the kernel, so [k_begin, k_end) only bounds what is read.
struct WorkItem {
  std::int32_t request = 0;
  std::int32_t kv_head = 0;   // the first of its KV heads
  std::int32_t kv_heads = 1;  // KV heads [kv_head, kv_head + kv_heads), each computed as on its own
  std::int32_t q_begin = 0;  // query tokens [q_begin, q_end) of the request
  std::int32_t q_end = 0;
  std::int32_t k_begin = 0;  // keys [k_begin, k_end) of the request
  std::int32_t k_end = 0;
  // < 0: the item covers every key and writes the output itself. Otherwise the
  // first of its (q_end - q_begin) partial-state token slots (see PartialState)
  // for its first KV head; head kv_head + h starts h * partial_head_stride later.
  std::int64_t partial_token = -1;
  std::int64_t partial_head_stride = 0;
};

// Combines the split partials of one (request, KV head, query tile), in split order.
struct MergeItem {
  std::int32_t request = 0;
  std::int32_t kv_head = 0;
  std::int32_t q_begin = 0;
  std::int32_t q_end = 0;
  std::int64_t first_partial_token = 0;  // split s uses first_partial_token + s * (q_end - q_begin)
  std::int32_t num_splits = 0;
};

// Unnormalized online-softmax state of split work items. One partial token
// slot holds `group` rows (the query heads of one KV head), each row
// `partial_row_floats(head_size)` floats: [acc (padded head size), max, sum].
struct PartialState {
  float* data = nullptr;
  int group = 0;
};

// Floats per partial row, and bytes of per-thread scratch for a work item of
// at most `max_rows` rows (= query tokens x GQA group) and `max_kv_heads` KV heads.
std::size_t partial_row_floats(int head_size);
std::size_t scratch_bytes(int head_size, int max_rows, int max_kv_heads);

// Alignment the scratch buffer must have.
inline constexpr std::size_t kScratchAlignment = 64;

// The K packing the selected ISA's decode reads fastest for a cache of
// `kv_dtype` and `head_size` (the caller checks that the cache can hold it):
// Keys16 for e4m3 K where the AVX512-BF16 decode takes whole kDecodeDotChunk
// chunks, whose score pass then reads 16 keys per vector (docs/kv_layouts.md).
inline constexpr int kDecodeDotChunk = 64;
KeyPacking preferred_key_packing(DType kv_dtype, int head_size);

// Runs one work item with the selected ISA and the kernel `variant` names for
// its rows (KernelVariant::for_rows; the host chose it with choose_kernel_variant
// for this ISA). `scratch` holds at least scratch_bytes(head_size, rows of the
// item, KV heads of the item) bytes, kScratchAlignment-aligned.
void run_work_item(const AttentionParams& params, const KernelVariant& variant, const WorkItem& item,
                   const PartialState& partials, void* scratch);

// Finalizes one query tile from its split partials (sinks, v_scale, LSE, output dtype).
void run_merge_item(const AttentionParams& params, const MergeItem& item, const PartialState& partials);

}  // namespace pagedattn::cpu_attn
