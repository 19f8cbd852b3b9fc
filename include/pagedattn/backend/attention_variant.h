// The attention every backend's kernels compute, as plain data (the kernel
// ABI): mask, window, PrefixLM ranges, soft cap, ALiBi, sinks and scale, and
// the operand descriptors kernels read. make_attention_variant (backend.h) is
// the one host function that derives a variant from a layer's impl params, so
// each rule of docs/semantics.md (e.g. "cross-attention has no window") is
// decided there and nowhere else; visible_keys below is the one statement of
// which keys a query sees, for host and device kernels alike. Kernels include
// this header, scalar.h and kv_packing.h only (no fmt, no core types).
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

// PrefixLM ranges of a step (vLLM's mm_prefix_range): request r's ranges
// are rows [start_loc[r], start_loc[r + 1]) of `ranges`, sorted and
// disjoint, each a [start, end) of positions whose queries see every key of
// the range (docs/semantics.md). Host or device pointers, as the kernel reads.
struct MmPrefixRanges {
  const std::int32_t* start_loc = nullptr;  // [num_reqs + 1], or null: no ranges
  const std::int32_t* ranges = nullptr;     // [R, 2] (start, end) pairs
};

// What attention computes for query position p over keys j of its request
// (docs/semantics.md): s = scale * q.k, then soft cap, then ALiBi, then the
// mask, window and PrefixLM ranges, then softmax with the sink logit in the
// denominator.
struct AttentionVariant {
  float scale = 1.0f;
  float soft_cap = 0.0f;  // <= 0 = off: s -> soft_cap * tanh(s / soft_cap)
  MaskKind mask = MaskKind::None;
  WindowKind window = WindowKind::None;
  int window_size = 0;                  // W; 0 when window is None
  MmPrefixRanges mm_prefix;             // causal decoder only; null = none
  const float* alibi_slopes = nullptr;  // [num_heads] or null: s += slope * (j - p)
  const float* sinks = nullptr;         // [num_heads] or null: unscaled logits in the denominator only
  KeySource key_source = KeySource::PagedCache;
};

// Keys [lo, hi) of a request; empty when lo >= hi.
struct KeyInterval {
  int lo = 0;
  int hi = 0;
};

namespace detail {
PAGEDATTN_HD constexpr int min_int(int a, int b) { return a < b ? a : b; }
PAGEDATTN_HD constexpr int max_int(int a, int b) { return a > b ? a : b; }
}  // namespace detail

// The PrefixLM range of request `req` that holds position `pos`, or an empty
// interval (a binary search: a request may hold many images).
PAGEDATTN_HD KeyInterval mm_prefix_range_at(const MmPrefixRanges& m, int req, int pos) {
  if (m.start_loc == nullptr) return {};
  const int first = m.start_loc[req];
  int lo = first;
  int hi = m.start_loc[req + 1];
  while (lo < hi) {  // the first range starting after pos
    const int mid = lo + (hi - lo) / 2;
    if (m.ranges[2 * mid] <= pos) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  if (lo == first) return {};
  const int start = m.ranges[2 * (lo - 1)];
  const int end = m.ranges[2 * (lo - 1) + 1];
  return pos < end ? KeyInterval{start, end} : KeyInterval{};
}

// The keys a query at position `pos` of request `req` sees among the
// request's `num_keys` (docs/semantics.md): always one interval. The causal
// mask and the window bound it; inside a PrefixLM range the query also sees
// the whole range, and as both hold pos their union is one interval.
PAGEDATTN_HD KeyInterval visible_keys(const AttentionVariant& v, int req, int pos, int num_keys) {
  int lo = 0;
  int hi = num_keys;
  if (v.mask == MaskKind::Causal) hi = detail::min_int(hi, pos + 1);
  if (v.window != WindowKind::None) {
    lo = detail::max_int(lo, pos - v.window_size + 1);
    hi = detail::min_int(hi, v.window == WindowKind::Left ? pos + 1 : pos + v.window_size);
  }
  const KeyInterval range = mm_prefix_range_at(v.mm_prefix, req, pos);
  if (range.lo < range.hi) {
    lo = detail::min_int(lo, range.lo);
    hi = detail::max_int(hi, detail::min_int(range.hi, num_keys));
  }
  return {lo, hi};
}

// The keys any query at positions [pos_lo, pos_hi] of request `req` sees:
// the union of their intervals, which is the span of pos_lo's and pos_hi's.
// Each interval holds its own position and its causal/window bounds move up
// with it; a range adds the same keys to every row it holds, and a range
// that holds neither pos_lo nor pos_hi lies between them.
PAGEDATTN_HD KeyInterval visible_keys_of_rows(const AttentionVariant& v, int req, int pos_lo, int pos_hi,
                                              int num_keys) {
  const KeyInterval first = visible_keys(v, req, pos_lo, num_keys);
  const KeyInterval last = visible_keys(v, req, pos_hi, num_keys);
  return {detail::min_int(first.lo, last.lo), detail::max_int(first.hi, last.hi)};
}

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
// [num_blocks, Hkv, block_size] f32: the scale of (block, slot, head) is
// data[block * block_stride + slot * slot_stride + head * head_stride].
// data is null for caches without them.
struct ScaleOperand {
  const float* data = nullptr;
  std::int64_t block_stride = 0;
  std::int64_t slot_stride = 0;
  std::int64_t head_stride = 0;
};

}  // namespace pagedattn
