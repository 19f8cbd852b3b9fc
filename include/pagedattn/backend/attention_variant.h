// The attention every backend's kernels compute, as plain data (the kernel
// ABI): mask, window, soft cap, ALiBi, sinks and scale, and the operand
// descriptors kernels read. make_attention_variant (backend.h) is the one
// host function that derives a variant from a layer's impl params, so each
// rule of docs/semantics.md (e.g. "cross-attention has no window") is decided
// there and nowhere else. Kernels include this header, scalar.h and
// kv_packing.h only (no fmt, no core types).
#pragma once

#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn {

// Where the keys and values of a request come from.
enum class KeySource : std::int32_t {
  PagedCache = 0,  // decoder and cross-attention: key j lives in the paged cache
  DenseRows = 1,   // encoder / encoder-only: keys are the request's own rows of key/value
};

enum class MaskKind : std::int32_t {
  None = 0,    // every key of the request
  Causal = 1,  // j <= p
};

enum class WindowKind : std::int32_t {
  None = 0,
  Left = 1,           // decoder: p - W < j <= p
  Bidirectional = 2,  // encoder / encoder-only: |p - j| <= W - 1
};

// What attention computes for query position p over keys j of its request
// (docs/semantics.md): s = scale * q.k, then soft cap, then ALiBi, then the
// mask and window, then softmax with the sink logit in the denominator.
struct AttentionVariant {
  float scale = 1.0f;
  float soft_cap = 0.0f;  // <= 0 = off: s -> soft_cap * tanh(s / soft_cap)
  MaskKind mask = MaskKind::None;
  WindowKind window = WindowKind::None;
  int window_size = 0;                  // W; 0 when window is None
  const float* alibi_slopes = nullptr;  // [num_heads] or null: s += slope * (j - p)
  const float* sinks = nullptr;         // [num_heads] or null: unscaled logits in the denominator only
  KeySource key_source = KeySource::PagedCache;
};

// A strided [rows, heads, head_size] operand; the last dimension is contiguous.
struct RowsOperand {
  const void* data = nullptr;
  DType dtype = DType::F32;
  std::int64_t row_stride = 0;   // elements between consecutive rows
  std::int64_t head_stride = 0;  // elements between consecutive heads
};

// One half (K or V) of the paged cache, logically [num_blocks, block_size,
// Hkv, D], last dimension contiguous (NHD or HND strides).
struct CacheOperand {
  const void* data = nullptr;
  std::int64_t block_stride = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;
  // K only: its order within a block (kv_packing.h); packed rows are
  // slot_stride == head_size apart and the block size a multiple of kPackedKeyGroup.
  KeyPacking packing = KeyPacking::None;
};

// The per-token-head scales of one cache half (token_head_quant.h),
// logically [num_blocks, block_size, Hkv] f32: the scale of (block, slot,
// head) is data[block * block_stride + slot * slot_stride + head * head_stride].
// data is null for caches without them.
struct ScaleOperand {
  const float* data = nullptr;
  std::int64_t block_stride = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;
};

}  // namespace pagedattn
