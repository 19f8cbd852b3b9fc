// Kernel ABI of CUDA_FLASH: POD params, the per-step work list the metadata
// builder uploads, and the host-callable launchers. Raw pointers only; no core
// headers (the dependency rule of docs/architecture.md). The backend validates every argument before
// filling these structs.
#pragma once

#include <pagedattn/backend/attention_variant.h>
#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn::cuda_flash {

// ---- tiling (shared by the planner and the kernels) -------------------------
inline constexpr int kThreads = 128;        // 4 warps per CTA
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kBlockN = 64;          // keys per shared-memory tile
inline constexpr int kPrefillRows = 128;    // packed (token, head) rows per prefill item (1-2 passes)
inline constexpr int kDecodeRows = 16;      // one 16-row MMA tile; the 4 warps split the keys
// Steps with decode items only run the decode-only kernels (head classes up to
// kDecodeOnlyMaxClass): the decode path's registers and a 16-row query region
// leave room for more K/V buffers, or more CTAs a multiprocessor, than the
// mixed kernels' two of each. Each class's kernel holds kDecodeOnlyStages
// 64-key K/V tile buffers (16-bit K/V; fp8 keeps its own ring), which its
// warps ring through, and decode_only_ctas_per_sm CTAs a multiprocessor; the
// planner aims its splits at that many. Head size 128 runs faster with three
// buffers at two CTAs than with two at three (3.6 % on 64q1s4k, 8 % with fp8
// K/V, H100); head size 64 runs 5 % slower at two CTAs, and three buffers of
// its half-size tiles fit three.
inline constexpr int kDecodeOnlyMaxClass = 128;
constexpr int decode_only_ctas_per_sm(int head_class) { return head_class <= 64 ? 3 : 2; }
inline constexpr int kDecodeOnlyStages = 3;
constexpr bool has_decode_only_kernel(int head_class) { return head_class > 0 && head_class <= kDecodeOnlyMaxClass; }
// The fp8 decode-only kernels of classes from kWideFp8MinClass copy K/V rows
// 16 values (16 bytes) at a time, through L1 as the 8-byte copies: half the
// copies, 0.5-0.9 % faster on an H100 (through L2 only, 5-8 % slower). Below
// it a thread's run of keys would be shorter than a 16-byte chunk of
// per-token-head scales.
inline constexpr int kWideFp8MinClass = 128;
constexpr bool has_wide_fp8_rows(int head_class) { return head_class >= kWideFp8MinClass; }
// Prefill-only steps with 16-bit or per-tensor fp8 K/V run, on sm_90 (Hopper, the sm_90a
// build), the warp-specialized warpgroup-MMA kernel of their head class: two
// consumer warpgroups per 128-row pass and a producer, kWgmmaCtasPerSm CTAs
// per multiprocessor.
constexpr bool has_wgmma_kernel(int head_class) { return head_class == 64 || head_class == 128 || head_class == 256; }
inline constexpr int kWgmmaCtasPerSm = 1;
inline constexpr int kWgmmaSmVersion = 90;  // major * 10 + minor: sm_90a code runs on sm_90 only

// The attention kernels of a head-size class; choose_kernel picks one per step.
enum class KernelKind : std::int32_t {
  Mixed = 0,         // mma.sync, prefill and decode items in one launch
  DecodeOnly = 1,    // mma.sync, the decode path only, more CTAs per multiprocessor
  WgmmaPrefill = 2,  // wgmma (sm_90a), 128-row passes
};

// The one predicate for "which kernel runs this step": the plan's item modes
// (all decode / all prefill), the head-size class, whether the cache keeps a
// scale per token and KV head (int8, or fp8 with token scales: the wgmma
// kernel takes 16-bit and per-tensor fp8 K/V only) and the device's compute
// capability (major * 10 + minor). A batch-invariant plan always runs the
// mixed kernel: the others tile differently, so a request's bits would depend
// on what else its step holds.
// kv_rows_16b: every K/V row of the step starts on a 16-byte boundary and
// its head is whole 16-byte chunks (always so for 16-bit K/V, which the
// forward checks; fp8 needs head size % 16 == 0 and 16-byte aligned base and
// strides), which the kernels copying 16-byte fp8 rows need (the wgmma
// prefill and the decode-only kernels of the wide-fp8 classes); without it
// such a step runs the mixed kernel (the planner, which sees no tensors,
// still sizes its splits for the decode-only kernel's occupancy).
constexpr KernelKind choose_kernel(int head_class, bool kv_token_scaled, bool decode_only, bool prefill_only,
                                   int sm_version, bool batch_invariant = false, bool kv_rows_16b = true) {
  if (batch_invariant) return KernelKind::Mixed;
  if (decode_only && has_decode_only_kernel(head_class) && (kv_rows_16b || !has_wide_fp8_rows(head_class))) {
    return KernelKind::DecodeOnly;
  }
  if (prefill_only && !kv_token_scaled && kv_rows_16b && has_wgmma_kernel(head_class) &&
      sm_version == kWgmmaSmVersion) {
    return KernelKind::WgmmaPrefill;
  }
  return KernelKind::Mixed;
}

inline constexpr int kMaxHeadSize = 256;
inline constexpr int kHeadSizeAlign = 8;    // 16-byte vector loads of 16-bit elements

// How a work item's warps divide a pass.
enum class TileMode : std::int32_t {
  Prefill = 0,  // warp w owns 16 or 32 consecutive rows and every key of a tile
  Decode = 1,   // every warp owns rows [0, 16) and keys [16w, 16w + 16) of a tile
};

// One CTA's work: query tokens [token_begin, token_begin + num_tokens) of one
// request (all query heads of the CTA's KV head, packed), over keys
// [kv_begin, kv_end) of that request. The CTA's KV head is blockIdx.x % num_kv_heads.
// Plan entries are whole 16-byte words, read with vector loads (load_plan_entry).
struct alignas(16) WorkItem {
  std::int32_t req = 0;
  std::int32_t token_begin = 0;     // row of the first query token in query/output
  std::int32_t num_tokens = 0;
  std::int32_t position_begin = 0;  // absolute position of the first query token
  std::int32_t kv_begin = 0;
  std::int32_t kv_end = 0;
  std::int32_t mode = 0;            // TileMode
  std::int32_t split = 0;           // index of this split among num_splits
  std::int32_t num_splits = 1;
  std::int32_t partial_index = 0;   // first partial token-row of the split group
  std::int32_t kv_row_begin = 0;    // dense K/V (encoder): row of key 0 of the request
  // 1: write a normalized partial (O, LSE) at partial token-row
  // partial_index + split * num_tokens + token for combine_kernel (every split
  // of a group, and every item of a cascade plan); 0: the output itself.
  std::int32_t writes_partial = 0;
};

// The partials one split group holds for a run of tokens: split s of token
// i is partial token-row first_row + s * split_stride + i.
struct PartialGroup {
  std::int32_t first_row = 0;
  std::int32_t num_splits = 0;    // 0: no group
  std::int32_t split_stride = 0;  // token-rows between splits (the group's items' num_tokens)
};

// A cascade's tokens merge two groups: the prefix pass's and the suffix pass's.
inline constexpr int kMaxCombineGroups = 2;

// Output tokens [token_begin, token_begin + num_tokens) to merge from the
// partials of their groups (one for a split item, two in a cascade plan).
struct alignas(16) CombineItem {
  std::int32_t token_begin = 0;
  std::int32_t num_tokens = 0;
  PartialGroup groups[kMaxCombineGroups] = {};
};

// Per-step scalars read on the device, so a captured graph replays with the
// values of the latest upload.
struct alignas(16) PlanHeader {
  std::int32_t num_items = 0;
  std::int32_t num_combine = 0;
  std::int32_t block_table_stride = 0;  // elements between block-table rows
};

// Byte layout of the device workspace: header, items, combine items, block
// table (i32), each start aligned to kWorkspaceAlign.
inline constexpr std::int64_t kWorkspaceAlign = 256;

struct FlashParams {
  // ---- problem ----
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  AttentionVariant variant;  // alibi_slopes, sinks ([num_heads]) and mm_prefix: on the device, or null

  // ---- query / output ----
  const void* query = nullptr;  // [T, H, D]
  std::int64_t q_row_stride = 0;
  std::int64_t q_head_stride = 0;
  void* output = nullptr;  // [T, H, D], query dtype
  std::int64_t o_row_stride = 0;
  std::int64_t o_head_stride = 0;
  float* lse = nullptr;  // [H, T] or null
  std::int64_t lse_head_stride = 0;
  std::int64_t lse_token_stride = 0;

  // ---- keys / values ----
  bool dense_kv = false;  // encoder: keys are rows of key/value, not the cache
  const void* key = nullptr;  // paged: [NB, BS, Hkv, D]; dense: [T, Hkv, D]
  const void* value = nullptr;
  std::int64_t k_block_stride = 0;  // paged only
  std::int64_t k_slot_stride = 0;   // paged: slot stride; dense: row stride
  std::int64_t k_head_stride = 0;
  std::int64_t v_block_stride = 0;
  std::int64_t v_slot_stride = 0;
  std::int64_t v_head_stride = 0;
  int block_size = 1;
  std::int64_t num_blocks = 0;
  DType kv_dtype = DType::BF16;    // bf16/f16 (= query dtype), fp8, or int8 (per-token-head only)
  const float* k_scale = nullptr;  // fp8 per tensor only: [1] or [Hkv] device
  const float* v_scale = nullptr;
  int kv_scale_stride = 0;         // 0 = per tensor, 1 = per KV head
  // Per-token-head caches (int8, or e4m3 with these set): each key's K and V
  // scale, [NB, Hkv, BS] f32 on the device, both with the strides below;
  // null otherwise. Scores are multiplied by the key's K scale, and each
  // probability by its key's V scale (in f32) before P V.
  const float* k_token_scale = nullptr;
  const float* v_token_scale = nullptr;
  std::int64_t scale_block_stride = 0;
  std::int64_t scale_slot_stride = 0;
  std::int64_t scale_head_stride = 0;

  // ---- plan (device workspace) ----
  const PlanHeader* header = nullptr;
  const WorkItem* items = nullptr;
  const CombineItem* combine = nullptr;
  const std::int32_t* block_table = nullptr;
  float* partial_out = nullptr;  // [partial token-rows, H, D]
  float* partial_lse = nullptr;  // [partial token-rows, H]
  int grid_items = 0;            // item slots of the 1-D grid, num_kv_heads CTAs each (items strided over them)
  int num_sms = 0;               // multiprocessors: persistent kernels launch at most this many CTAs per resident slot
  KernelKind kernel = KernelKind::Mixed;  // choose_kernel's pick for the step
  int grid_combine = 0;
};

// Status codes of the launchers (cudaError_t values pass through as ints).
inline constexpr int kLaunchOk = 0;
inline constexpr int kLaunchUnsupportedHeadSize = -1;
inline constexpr int kLaunchUnsupportedDType = -2;

// Head-size class a head size runs in (the kernels pad up to it), 0 if none.
int head_size_class(int head_size);

// Launches the attention kernel (and, when `launch_combine`, the split-KV
// merge) on `stream` (a cudaStream_t). Returns kLaunchOk, a negative
// kLaunch* code, or a cudaError_t value.
int launch_flash_attention(const FlashParams& params, DType dtype, bool launch_combine, void* stream);

}  // namespace pagedattn::cuda_flash
