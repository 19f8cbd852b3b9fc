// The parts of a CUDA_FLASH pass that do not depend on how its MMAs run:
// the key range, the K/V copy walk over the paged cache, the online softmax
// of one warp's 16 rows, and the output epilogue; and the walk over a step's
// items with its launch. The mma.sync kernels (flash_attention.cuh) and the
// sm_90a wgmma kernel (flash_wgmma_prefill.cuh) share them, so both give the
// same results for the same scores.
#pragma once

#include <math_constants.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>

#include "flash_params.h"
#include "flash_primitives.cuh"

namespace pagedattn::cuda_flash::detail {

inline constexpr int kMmaRows = 16;
inline constexpr int kChunkElems = 8;        // 16-byte chunk of 16-bit elements
inline constexpr float kRescaleLog2 = 8.0f;  // lazy-rescale threshold, log2 units
inline constexpr int kScaleChunkBytes = 16;  // one cp.async of per-token-head scales
inline constexpr int kScaleChunkKeys = kScaleChunkBytes / static_cast<int>(sizeof(float));

struct PassRange {
  int kv_lo;
  int kv_hi;
};

// How the cache stores K/V. The 8-bit format is a template parameter: chosen
// at run time inside the key loop, the compiler ran both conversions and
// selected, which cost a quarter of the fp8 decode's instructions. I8 is
// always per-token-head; E4M3 is when FlashParams::k_token_scale is set (a
// uniform branch per tile, no instantiation of its own).
enum class KvStore { Bits16, E4M3, E5M2, I8 };

template <KvStore kKv>
inline constexpr bool kIsFp8 = kKv != KvStore::Bits16;

// The 16-bit type the tensor cores run on against K/V of type TIO (the
// queries' type) or fp8: fp8 always computes in f16, whatever the query
// dtype. fp8 -> f16 is one hardware conversion per two values and exact for
// e4m3 and e5m2 alike, where fp8 -> bf16 takes four or five instructions
// (fp8 -> f16 -> f32 -> bf16), and P, in [0, 2^kRescaleLog2], rounds to f16
// with three more mantissa bits than bf16. The mma.sync kernels run both MMAs
// in it; the wgmma prefill runs P V in it (V's tiles converted to it) and
// S = Q K^T in the queries' type.
template <typename TIO, bool kFp8>
using Compute = std::conditional_t<kFp8, half, TIO>;

// Four 8-bit K/V values (bytes 0..3 of w) -> two f16x2 words: bytes (0, 1)
// -> lo, bytes (2, 3) -> hi; exact.
template <KvStore kKv>
__device__ __forceinline__ void kv8x4_to_f16x2(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  if constexpr (kKv == KvStore::I8) {
    i8x4_to_f16x2(w, lo, hi);
  } else {
    fp8x4_to_f16x2<kKv == KvStore::E5M2 ? __NV_E5M2 : __NV_E4M3>(w, lo, hi);
  }
}

// The per-tensor (or per-KV-head) scale of `scales` for `kv_head` (FlashParams::k_scale or
// v_scale) of an 8-bit cache; 1 for 16-bit K/V. A per-token-head cache scales
// each key instead and does not call it.
template <KvStore kKv>
__device__ __forceinline__ float kv_tensor_scale(const FlashParams& p, const float* scales, int kv_head) {
  if constexpr (kIsFp8<kKv>) {
    return scales[kv_head * p.kv_scale_stride];
  } else {
    return 1.0f;
  }
}

// Keys any row of pass rows [row0, row0 + rows) of an item can see, within
// the item's keys: a pass inside a PrefixLM range reaches past its diagonal
// to the range's end (visible_keys_of_rows).
__device__ __forceinline__ PassRange pass_range(const FlashParams& p, const WorkItem& item, int group,
                                                int row0, int rows) {
  const int p_lo = item.position_begin + row0 / group;
  const int p_hi = item.position_begin + (row0 + rows - 1) / group;
  const KeyInterval keys = visible_keys_of_rows(p.variant, item.req, p_lo, p_hi, item.kv_end);
  return {max(item.kv_begin, keys.lo), keys.hi};
}

// The query chunk (8 elements) `ch` of pass row r: its address, and whether
// it exists (row inside the pass, chunk inside the head).
template <typename TIO>
__device__ __forceinline__ const TIO* query_chunk_src(const FlashParams& p, const WorkItem& item, int kv_head,
                                                      int group, int row0, int rows, int r, int ch,
                                                      bool& valid) {
  valid = r < rows && ch * kChunkElems < p.head_size;
  const int row = row0 + r;
  const std::int64_t token = item.token_begin + row / group;
  const int head = kv_head * group + row % group;
  return static_cast<const TIO*>(p.query) + token * p.q_row_stride + head * p.q_head_stride +
         ch * kChunkElems;
}

// Reduces a thread's scores of row half `i` (elements 2i, 2i + 1 of every
// n-tile) as a tree: depth log2(2 kNT) instead of a 2 kNT-long dependent chain.
// Each level is its own instantiation, so every index is a constant (a loop
// over the levels left 16-tile rows in local memory).
template <int kWidth, int kNT, typename Op>
__device__ __forceinline__ void reduce_levels(float (&v)[kNT], Op op) {
  if constexpr (kWidth >= 1) {
#pragma unroll
    for (int nt = 0; nt < kWidth; ++nt) v[nt] = op(v[nt], v[nt + kWidth]);
    reduce_levels<kWidth / 2>(v, op);
  }
}

template <int kNT, typename Op>
__device__ __forceinline__ float row_reduce(const float (&s)[kNT][4], int i, Op op) {
  static_assert((kNT & (kNT - 1)) == 0, "a power of two of n-tiles");
  float v[kNT];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) v[nt] = op(s[nt][2 * i], s[nt][2 * i + 1]);
  reduce_levels<kNT / 2>(v, op);
  return v[0];
}

// Where a thread's run of consecutive keys in a tile starts: the physical
// block (-1 = read nothing) and the slot of the run's first key.
struct RunStart {
  std::int32_t block;
  std::int32_t slot;
};

// A thread's share of the K/V copies of a pass: one 8-element column (my_ch)
// of a run of kKeysPerRun consecutive keys (run my_run) of every key tile of
// kTileKeys keys.
// When a run cannot straddle a block it costs one block-table load and one
// address; its keys then follow at the slot stride (dense K/V is one endless
// block). Other block sizes look up every key. Slots outside the key range
// and block ids out of range are never read.
template <int kKeysPerRun, int kTileKeys = kBlockN>
struct KvRunWalker {
  const FlashParams& p;
  PassRange range;
  int tile_lo;
  int my_run;
  bool my_col;
  bool runs_in_block;
  int kv_row_begin;
  const char* k_col;
  const char* v_col;
  std::int64_t k_block_bytes;
  std::int64_t v_block_bytes;
  std::int64_t k_slot_bytes;
  std::int64_t v_slot_bytes;
  const std::int32_t* bt_row;

  // kv_elem: bytes per cached element (2, or 1 for fp8).
  __device__ __forceinline__ KvRunWalker(const FlashParams& params, const WorkItem& item, int kv_head,
                                         int bt_stride, PassRange pass, int first_tile_key, int my_ch,
                                         int run, std::int64_t kv_elem)
      : p(params),
        range(pass),
        tile_lo(first_tile_key),
        my_run(run),
        my_col(my_ch * kChunkElems < params.head_size),
        runs_in_block(params.dense_kv || params.block_size % kKeysPerRun == 0),
        kv_row_begin(item.kv_row_begin),
        k_col(static_cast<const char*>(params.key) +
              (kv_head * params.k_head_stride + my_ch * kChunkElems) * kv_elem),
        v_col(static_cast<const char*>(params.value) +
              (kv_head * params.v_head_stride + my_ch * kChunkElems) * kv_elem),
        k_block_bytes(params.k_block_stride * kv_elem),
        v_block_bytes(params.v_block_stride * kv_elem),
        k_slot_bytes(params.k_slot_stride * kv_elem),
        v_slot_bytes(params.v_slot_stride * kv_elem),
        bt_row(params.dense_kv ? nullptr
                               : params.block_table + static_cast<std::int64_t>(item.req) * bt_stride) {}

  __device__ __forceinline__ int first_key(int t) const {
    return tile_lo + t * kTileKeys + my_run * kKeysPerRun;
  }

  __device__ __forceinline__ RunStart locate(int t) const {
    const int j = first_key(t);
    RunStart r{-1, 0};
    if (runs_in_block && my_col && j < range.kv_hi && j + kKeysPerRun > range.kv_lo) {
      if (p.dense_kv) {
        r = {0, kv_row_begin + j};
      } else {
        // The id is range-checked where it is used, a tile later, so this
        // load's latency hides behind the current tile.
        const int b = j / p.block_size;
        r = {bt_row[b], j - b * p.block_size};
      }
    }
    return r;
  }

  // Calls f(i, valid, k_src, v_src) for key i of this thread's run in tile t.
  template <typename F>
  __device__ __forceinline__ void walk(int t, RunStart run, F&& f) const {
    const int j0 = first_key(t);
    if (runs_in_block) {
      const bool run_ok = run.block >= 0 && (p.dense_kv || run.block < p.num_blocks);
      const char* k_src = k_col + run.block * k_block_bytes + run.slot * k_slot_bytes;
      const char* v_src = v_col + run.block * v_block_bytes + run.slot * v_slot_bytes;
      if (run_ok && j0 >= range.kv_lo && j0 + kKeysPerRun <= range.kv_hi) {
        // The common case, a run wholly inside the range: no per-key tests.
#pragma unroll
        for (int i = 0; i < kKeysPerRun; ++i) {
          f(i, true, k_src, v_src);
          k_src += k_slot_bytes;
          v_src += v_slot_bytes;
        }
        return;
      }
#pragma unroll
      for (int i = 0; i < kKeysPerRun; ++i) {
        const int j = j0 + i;
        const bool valid = run_ok && j >= range.kv_lo && j < range.kv_hi;
        f(i, valid, valid ? k_src : k_col, valid ? v_src : v_col);
        k_src += k_slot_bytes;
        v_src += v_slot_bytes;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kKeysPerRun; ++i) {
        const int j = j0 + i;
        const int b = j / p.block_size;
        std::int32_t id = -1;
        if (my_col && j >= range.kv_lo && j < range.kv_hi) {
          id = bt_row[b];
          if (id >= p.num_blocks) id = -1;
        }
        const bool valid = id >= 0;
        const std::int64_t slot = j - b * p.block_size;
        f(i, valid, valid ? k_col + id * k_block_bytes + slot * k_slot_bytes : k_col,
          valid ? v_col + id * v_block_bytes + slot * v_slot_bytes : v_col);
      }
    }
  }
};

// Copies this thread's run of per-token-head K and V scales of `kv_head` in
// tile t to k_dst[i] and v_dst[i] (shared memory, 16-byte aligned), i the
// key's index in the run: the keys and checks of walk, zeros for every key
// walk does not read (paged caches only: dense K/V has no scales).
// A run inside one block starts at a slot that is a multiple of kKeysPerRun;
// when its scales are consecutive (slot stride 1: the [NB, Hkv, BS] halves
// of kv_cache_scale_shape) and 16-byte aligned, it moves in 16-byte chunks of
// kScaleChunkKeys keys, each reading its keys before the range's end and
// zero-filling the rest. A chunk whose first key lies before the range's
// start while a later one lies inside, and every other run, copies each key's
// scale by itself (4 bytes).
template <int kKeysPerRun>
__device__ __forceinline__ void copy_token_scales(const KvRunWalker<kKeysPerRun>& w, int t, RunStart run,
                                                  int kv_head, const FlashParams& p, float* k_dst,
                                                  float* v_dst) {
  static_assert(kKeysPerRun % kScaleChunkKeys == 0, "a run is whole 16-byte scale chunks");
  const int j0 = w.first_key(t);
  const std::int64_t head_offset = kv_head * p.scale_head_stride;
  // Key i of the run from element `offset` of each scale half; invalid keys read nothing.
  const auto copy_key = [&](int i, bool valid, std::int64_t offset) {
    cp_async_ca<4>(k_dst + i, p.k_token_scale + offset, valid);
    cp_async_ca<4>(v_dst + i, p.v_token_scale + offset, valid);
  };
  if (w.runs_in_block) {
    const bool run_ok = run.block >= 0 && run.block < p.num_blocks;
    const std::int64_t first =
        run_ok ? run.block * p.scale_block_stride + run.slot * p.scale_slot_stride + head_offset : 0;
    const float* k_src = p.k_token_scale + first;
    const float* v_src = p.v_token_scale + first;
    const auto address = [](const float* a) { return reinterpret_cast<std::uintptr_t>(a); };
    if (p.scale_slot_stride == 1 && (address(k_src) | address(v_src)) % kScaleChunkBytes == 0) {
#pragma unroll
      for (int c = 0; c < kKeysPerRun; c += kScaleChunkKeys) {
        // The chunk's keys [lead, end) are in the range.
        const int lead = min(max(w.range.kv_lo - (j0 + c), 0), kScaleChunkKeys);
        const int end = run_ok ? min(max(w.range.kv_hi - (j0 + c), 0), kScaleChunkKeys) : 0;
        if (lead == 0 || end <= lead) {
          const int bytes = lead == 0 ? end * static_cast<int>(sizeof(float)) : 0;
          cp_async_16_prefix(k_dst + c, k_src + c, bytes);
          cp_async_16_prefix(v_dst + c, v_src + c, bytes);
        } else {
#pragma unroll
          for (int e = 0; e < kScaleChunkKeys; ++e) {
            const bool valid = e >= lead && e < end;
            copy_key(c + e, valid, valid ? first + c + e : 0);
          }
        }
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < kKeysPerRun; ++i) {
      const int j = j0 + i;
      const bool valid = run_ok && j >= w.range.kv_lo && j < w.range.kv_hi;
      copy_key(i, valid, valid ? first + i * p.scale_slot_stride : 0);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kKeysPerRun; ++i) {
    const int j = j0 + i;
    const int b = j / p.block_size;
    std::int32_t id = -1;
    if (j >= w.range.kv_lo && j < w.range.kv_hi) {
      id = w.bt_row[b];
      if (id >= p.num_blocks) id = -1;
    }
    const bool valid = id >= 0;
    const std::int64_t slot = j - b * p.block_size;
    copy_key(i, valid, valid ? id * p.scale_block_stride + slot * p.scale_slot_stride + head_offset : 0);
  }
}

// Whether keys [k0, k_last] are visible to every row of positions
// [pos_lo, pos_hi] with plain scores (no soft cap, no ALiBi): such a block
// needs neither masks nor per-score transforms. PrefixLM ranges only add
// keys, so the causal and window tests stay sufficient; blocks visible
// through a range alone take the masked path.
__device__ __forceinline__ bool whole_block(const FlashParams& p, PassRange range, int k0, int k_last,
                                            int pos_lo, int pos_hi) {
  bool whole = p.variant.soft_cap <= 0.0f && p.variant.alibi_slopes == nullptr && k0 >= range.kv_lo && k_last < range.kv_hi;
  if (p.variant.mask == MaskKind::Causal) whole = whole && k_last <= pos_lo;
  if (p.variant.window == WindowKind::Left) {
    whole = whole && k0 > pos_hi - p.variant.window_size && k_last <= pos_lo;
  } else if (p.variant.window == WindowKind::Bidirectional) {
    whole = whole && k0 > pos_hi - p.variant.window_size && k_last < pos_lo + p.variant.window_size;
  }
  return whole;
}

// Where a thread's two rows (g, g + 8 of a warp's 16-row tile) and keys are.
struct ScoreRows {
  int row[2];   // pass-relative row + row0: the item's packed row
  int row_end;  // row0 + rows: rows at or past it are padding
  int k0;       // first key of the warp's block
  int tig;      // lane % 4: the thread's key pair in each 8-key n-tile
};

// The factor O must be multiplied by after a softmax step, when `any`.
struct Rescale {
  float alpha[2];
  bool any;
};

template <int kDT>
__device__ __forceinline__ void apply_rescale(const Rescale& r, float (&o)[kDT][4]) {
  if (!r.any) return;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    o[dt][0] *= r.alpha[0];
    o[dt][1] *= r.alpha[0];
    o[dt][2] *= r.alpha[1];
    o[dt][3] *= r.alpha[1];
  }
}

// Scale, soft cap, ALiBi and the masks of a block's scores, into the log2
// domain (masked scores -inf). The soft cap is a template argument: its
// division and tanhf, inlined for each of a thread's scores, are most of a
// kernel's code, and a runtime test per score spread them through the loop
// that every diagonal tile runs.
template <bool kSoftCap, int kNT>
__device__ __forceinline__ void mask_scores(const FlashParams& p, const WorkItem& item, int kv_head, int group,
                                            PassRange range, const ScoreRows& at, float qk_scale,
                                            float (&s)[kNT][4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = at.row[i];
    const float slope = p.variant.alibi_slopes != nullptr && row < at.row_end
                            ? p.variant.alibi_slopes[kv_head * group + row % group]
                            : 0.0f;
    const int q_pos = item.position_begin + row / group;
    // The row's keys within the pass's (docs/semantics.md, visible_keys).
    const KeyInterval keys = visible_keys(p.variant, item.req, q_pos, range.kv_hi);
    const int lo = max(keys.lo, range.kv_lo);
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = at.k0 + nt * 8 + 2 * at.tig + e;
        float x = s[nt][2 * i + e] * qk_scale;
        if constexpr (kSoftCap) x = p.variant.soft_cap * tanhf(x / p.variant.soft_cap);
        x += slope * static_cast<float>(j - q_pos);
        const bool visible = j >= lo && j < keys.hi;
        s[nt][2 * i + e] = visible ? x * kLog2e : -CUDART_INF_F;
      }
    }
  }
}

// The online softmax of one warp's 16 rows over a block of kNT * 8 keys:
// raw scores s in, probabilities (scaled by 2^-m) out; m and l updated, and
// the factor O needs returned (apart, so a kernel whose O is still being
// written by an asynchronous MMA can scale it later). Whole blocks keep raw
// scores (the max commutes with the positive scale) and fold the scale into
// the exponent's multiply-add; the others go through mask_scores. Log2 domain.
template <int kNT>
__device__ __forceinline__ Rescale softmax_scores(const FlashParams& p, const WorkItem& item, int kv_head,
                                                  int group, PassRange range, const ScoreRows& at, bool whole,
                                                  float qk_scale, float qk_scale_log2, float (&s)[kNT][4],
                                                  float (&m)[2], float (&l)[2]) {
  float tile_max[2] = {};
  const float exp_scale = whole ? qk_scale_log2 : 1.0f;
  if (!whole) {
    if (p.variant.soft_cap > 0.0f) {
      mask_scores<true>(p, item, kv_head, group, range, at, qk_scale, s);
    } else {
      mask_scores<false>(p, item, kv_head, group, range, at, qk_scale, s);
    }
  }
  // The running max moves only when a row's max grows by more than
  // kRescaleLog2 (FlashAttention-4's lazy rescale): the exponentials stay
  // <= 2^kRescaleLog2, exact in fp32 and bf16 alike, and O and l are
  // rescaled only then, by the whole warp at once.
  Rescale rescale{{1.0f, 1.0f}, false};
  bool grow = false;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    tile_max[i] = row_reduce<kNT>(s, i, [](float x, float y) { return fmaxf(x, y); });
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2)) * exp_scale;
    grow = grow || tile_max[i] > m[i] + kRescaleLog2;
  }
  if (__any_sync(0xffffffffu, grow)) {
    rescale.any = true;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], tile_max[i]);
      rescale.alpha[i] = m_new == -CUDART_INF_F ? 1.0f : exp2_approx(m[i] - m_new);
      m[i] = m_new;
      l[i] *= rescale.alpha[i];
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_use = m[i] == -CUDART_INF_F ? 0.0f : m[i];  // all masked so far: avoid inf - inf
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      s[nt][2 * i] = exp2_approx(fmaf(s[nt][2 * i], exp_scale, -m_use));
      s[nt][2 * i + 1] = exp2_approx(fmaf(s[nt][2 * i + 1], exp_scale, -m_use));
    }
    l[i] += row_reduce<kNT>(s, i, [](float x, float y) { return x + y; });
  }
  return rescale;
}

// softmax_scores, then O rescaled at once.
template <int kNT, int kDT>
__device__ __forceinline__ void online_softmax(const FlashParams& p, const WorkItem& item, int kv_head,
                                               int group, PassRange range, const ScoreRows& at, bool whole,
                                               float qk_scale, float qk_scale_log2, float (&s)[kNT][4],
                                               float (&o)[kDT][4], float (&m)[2], float (&l)[2]) {
  apply_rescale(softmax_scores(p, item, kv_head, group, range, at, whole, qk_scale, qk_scale_log2, s, m, l),
                o);
}

// The A operand of P V for keys 16 kk .. 16 kk + 15: the score accumulators of
// n-tiles 2 kk and 2 kk + 1 (the m16n8 C layout is the m16k16 A layout).
template <typename T, int kNT>
__device__ __forceinline__ void scores_to_a(const float (&s)[kNT][4], int kk, std::uint32_t (&a)[4]) {
  a[0] = Elem<T>::pack(s[2 * kk][0], s[2 * kk][1]);
  a[1] = Elem<T>::pack(s[2 * kk][2], s[2 * kk][3]);
  a[2] = Elem<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = Elem<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// Stages a warp's 16 rows (O in the m16n8 C layout) in shared memory: fp32
// rows r0 and r0 + 8 of `stage` ([rows, kHC]) and their (m, l) in `ml`
// ([rows, 2]); l is summed over the row's 4 threads first. kEvenOddDims: the
// fp8 P V order, o[2j] holding dims 16j + 4t + {0, 2} and o[2j + 1] dims
// 16j + 4t + {1, 3}, put back in order here; else o[dt] holds dims 8 dt + 2t, +1.
template <int kHC, bool kEvenOddDims, int kDT>
__device__ __forceinline__ void stage_warp_rows(const float (&o)[kDT][4], const float (&m)[2], float (&l)[2],
                                                int r0, int tig, float* stage, float* ml) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  float* rows = stage + r0 * kHC;
  if constexpr (kEvenOddDims) {
#pragma unroll
    for (int dg = 0; dg < kHC / 16; ++dg) {
      const float(&e)[4] = o[2 * dg];
      const float(&d)[4] = o[2 * dg + 1];
      *reinterpret_cast<float4*>(rows + dg * 16 + 4 * tig) = make_float4(e[0], d[0], e[1], d[1]);
      *reinterpret_cast<float4*>(rows + 8 * kHC + dg * 16 + 4 * tig) = make_float4(e[2], d[2], e[3], d[3]);
    }
  } else {
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int d = dt * 8 + 2 * tig;
      *reinterpret_cast<float2*>(rows + d) = make_float2(o[dt][0], o[dt][1]);
      *reinterpret_cast<float2*>(rows + 8 * kHC + d) = make_float2(o[dt][2], o[dt][3]);
    }
  }
  if (tig == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      ml[(r0 + 8 * i) * 2] = m[i];
      ml[(r0 + 8 * i) * 2 + 1] = l[i];
    }
  }
}

// Where packed row `row` of an item goes: its query token and head, and its
// partial row when the item is one split of several.
struct RowOut {
  std::int64_t token;
  int head;
  std::int64_t partial_row;
};

__device__ __forceinline__ RowOut row_out(const FlashParams& p, const WorkItem& item, int kv_head, int group,
                                          int row) {
  const int token_rel = row / group;
  const int head = kv_head * group + row % group;
  const std::int64_t partial_row =
      static_cast<std::int64_t>(item.partial_index + item.split * item.num_tokens + token_rel) * p.num_heads + head;
  return {item.token_begin + token_rel, head, partial_row};
}

// The factor a row's O accumulator is multiplied by and the row's LSE
// (natural log), from its running max m (log2 units) and sum l: a partial
// (a split's, a cascade pass's) is normalized over its own keys (the merge
// adds the sink once); a whole row folds in the sink. A row that saw no key gives 0 and -inf.
struct RowFinish {
  float f;
  float lse;
};

__device__ __forceinline__ RowFinish finish_row(const FlashParams& p, const WorkItem& item, int head, float m,
                                                float l, float v_scale) {
  if (m == -CUDART_INF_F) return {0.0f, -CUDART_INF_F};
  if (item.writes_partial) return {v_scale / l, (m + log2f(l)) * kLn2};
  float mm = m;
  float den = l;
  if (p.variant.sinks != nullptr) {
    const float sink = p.variant.sinks[head] * kLog2e;
    mm = fmaxf(m, sink);
    den = l * exp2f(m - mm) + exp2f(sink - mm);
  }
  return {exp2f(m - mm) * v_scale / den, (mm + log2f(den)) * kLn2};
}

// The epilogue of a pass: reads the staged (m, l, O) of its rows (in decode
// passes one per warp, merged here), normalizes, adds the sink, and writes
// the output (and LSE), or a split's normalized partial and its LSE. One
// 8-element chunk of one row per thread iteration, kNumThreads threads.
template <int kHC, typename TIO, bool kDecode, int kNumThreads>
__device__ __forceinline__ void write_pass_output(const FlashParams& p, const WorkItem& item, int kv_head,
                                                  int group, int row0, int rows, const float* stage,
                                                  const float* ml, float v_scale) {
  const int chunks = p.head_size / kChunkElems;
  for (int u = static_cast<int>(threadIdx.x); u < rows * chunks; u += kNumThreads) {
    const int r = u / chunks;
    const int ch = u % chunks;
    float acc[8] = {};
    float m_tot = -CUDART_INF_F;
    float l_tot = 0.0f;
    if (kDecode) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m_tot = fmaxf(m_tot, ml[(w * kMmaRows + r) * 2]);
      if (m_tot != -CUDART_INF_F) {
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const float f = exp2f(ml[(w * kMmaRows + r) * 2] - m_tot);
          l_tot += f * ml[(w * kMmaRows + r) * 2 + 1];
          const float* src = stage + (w * kMmaRows + r) * kHC + ch * kChunkElems;
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[e] += f * src[e];
        }
      }
    } else {
      m_tot = ml[r * 2];
      l_tot = ml[r * 2 + 1];
      const float* src = stage + r * kHC + ch * kChunkElems;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = src[e];
    }
    const RowOut out = row_out(p, item, kv_head, group, row0 + r);
    const RowFinish fin = finish_row(p, item, out.head, m_tot, l_tot, v_scale);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= fin.f;
    if (item.writes_partial) {
      float* dst = p.partial_out + out.partial_row * p.head_size + ch * kChunkElems;
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = acc[e];
      if (ch == 0) p.partial_lse[out.partial_row] = fin.lse;
      continue;
    }
    store8<TIO>(static_cast<TIO*>(p.output) + out.token * p.o_row_stride + out.head * p.o_head_stride +
                    ch * kChunkElems,
                acc);
    if (p.lse != nullptr && ch == 0) p.lse[out.head * p.lse_head_stride + out.token * p.lse_token_stride] = fin.lse;
  }
}

// Calls f(entry, header) for the plan entries first, first + stride, ...
// below count(header) (work items or combine items), reading the first one
// beside the header, not after it: the header, the entry, its block ids and
// its first K/V form a chain of dependent loads before any byte of the cache
// arrives, and a lone decode's CTAs each read only 256 KB after it. Each
// region holds at least a grid's slots (its capacity starts above any GPU's
// multiprocessor count: a captured grid's wave) and is zero-filled when
// allocated, so a slot past the plan reads zeros it never uses.
template <typename Entry, typename Count, typename F>
__device__ __forceinline__ void for_each_plan_entry(const FlashParams& p, const Entry* entries, int first, int stride,
                                                    Count count, F&& f) {
  Entry entry = load_plan_entry(entries + first);
  const PlanHeader header = load_plan_entry(p.header);
  for (int i = first; i < count(header); i += stride) {
    f(entry, header);
    if (i + stride < count(header)) entry = load_plan_entry(entries + i + stride);
  }
}

// Calls f(item, kv_head, group, block_table_stride) for each work item of
// this CTA. The 1-D grid is item slots x KV heads with the KV head varying
// fastest: an item's heads run as adjacent CTAs and read whole cache rows of
// the same blocks (every head of a slot) at once. Items stride over the slots.
template <typename F>
__device__ __forceinline__ void for_each_item(const FlashParams& p, F&& f) {
  const int kv_head = static_cast<int>(blockIdx.x) % p.num_kv_heads;
  const int group = p.num_heads / p.num_kv_heads;
  for_each_plan_entry(
      p, p.items, static_cast<int>(blockIdx.x) / p.num_kv_heads, static_cast<int>(gridDim.x) / p.num_kv_heads,
      [](const PlanHeader& h) { return h.num_items; },
      [&](const WorkItem& item, const PlanHeader& h) { f(item, kv_head, group, h.block_table_stride); });
}

// Persistent kernels: calls f(item, kv_head, group, block_table_stride) for
// each (item, KV head) unit of this CTA, units numbered with the KV head
// fastest (an item's heads run at once, as in for_each_item) and strided over
// a grid of any size. The planner lists items heaviest first, so the stride
// deals every CTA a similar mix.
template <typename F>
__device__ __forceinline__ void for_each_unit(const FlashParams& p, F&& f) {
  const PlanHeader header = *p.header;
  const int group = p.num_heads / p.num_kv_heads;
  const std::int64_t units = static_cast<std::int64_t>(header.num_items) * p.num_kv_heads;
  for (std::int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    f(p.items[u / p.num_kv_heads], static_cast<int>(u % p.num_kv_heads), group, header.block_table_stride);
  }
}

// Host: launches an attention kernel over the step's items (the 1-D grid of
// for_each_item) with `threads` threads and `smem_bytes` of dynamic shared
// memory; a persistent kernel (for_each_unit) passes `max_ctas`, the most
// CTAs that run at once. The shared-memory opt-in runs once per device
// (`configured` holds a bit per device; a host call per launch costs more
// than a decode step's kernel). Returns kLaunchOk or a cudaError_t value.
template <typename Kernel>
int launch_over_items(Kernel kernel, int threads, int smem_bytes, std::atomic<std::uint64_t>& configured,
                      const FlashParams& p, cudaStream_t stream, int max_ctas = 0) {
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return static_cast<int>(e);
  const std::uint64_t bit = std::uint64_t{1} << (device % 64);
  if ((configured.load() & bit) == 0) {
    const cudaError_t attr =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (attr != cudaSuccess) return static_cast<int>(attr);
    configured.fetch_or(bit);
  }
  std::int64_t ctas = static_cast<std::int64_t>(p.grid_items) * p.num_kv_heads;
  if (max_ctas > 0) ctas = std::min<std::int64_t>(ctas, max_ctas);
  kernel<<<static_cast<unsigned>(ctas), threads, smem_bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pagedattn::cuda_flash::detail
