// The one implementation behind pagedattn.ops.unified_attention and
// pagedattn.ops.flash_attn_varlen_func (FlashAttention's varlen semantics:
// bottom-right aligned causal mask, window (left, right), soft cap, ALiBi,
// sinks), on a BatchAttention planned per call from the lengths read on the
// host. Each call reads cu_seqlens/seqused_k/block_table to the host (one
// device-to-host copy on CUDA), so these calls cannot be captured in a CUDA
// graph: BatchAttention's plan/run is the capturable path.
#pragma once

#include <pagedattn/attention_types.h>
#include <pagedattn/tensor.h>

#include <optional>
#include <string>
#include <string_view>

namespace pagedattn::python {

struct VarlenArgs {
  TensorView q;             // [Tq, H, D]
  TensorView k;             // paged: [NB, BS, Hkv, D]; dense: [Tk, Hkv, D]
  TensorView v;             // like k
  TensorView out;           // [Tq, H, D], q's dtype
  TensorView lse;           // [H, Tq] f32 or undefined
  TensorView cu_seqlens_q;  // [B+1] i32
  TensorView cu_seqlens_k;  // [B+1] i32 (dense) or undefined
  TensorView seqused_k;     // [B] i32 (paged) or undefined
  TensorView block_table;   // [B, max_blocks] i32 (paged) or undefined
  long max_seqlen_q = 0;
  long max_seqlen_k = 0;
  std::optional<float> softmax_scale;  // unset = 1 / sqrt(D)
  bool causal = true;
  long window_left = -1;   // -1 = unbounded
  long window_right = -1;  // -1 = unbounded
  float softcap = 0.0f;    // 0 = off
  TensorView alibi_slopes;  // [H] f32 or undefined
  TensorView sinks;         // [H] or undefined
  TensorView k_descale;     // fp8 caches: [1], [Hkv] or [B, Hkv] with equal rows; or undefined
  TensorView v_descale;
  CacheDType kv_cache_dtype = CacheDType::Auto;  // u8 caches are read as its fp8 type
  // Per-token-head caches (int8_per_token_head, fp8_per_token_head; paged
  // only): k_scale_cache / v_scale_cache, [NB, Hkv, BS] f32.
  TensorView k_scale_cache;
  TensorView v_scale_cache;
  // vLLM's mm_prefix_range (PrefixLM; causal only): [B, max_ranges, 2]
  // i32/i64 inclusive (first, last) pairs per request, padded with (0, 0);
  // or undefined. Read on the host and planned as half-open CSR ranges.
  TensorView mm_prefix_range;
  std::string backend;      // empty = the selector's choice
};

// Throws pagedattn::Error naming the argument for anything it cannot honour.
void varlen_attention(VarlenArgs args, std::string_view where);

// Backend name the last varlen_attention call ran on (for tests and logs).
const std::string& last_varlen_backend();

}  // namespace pagedattn::python
