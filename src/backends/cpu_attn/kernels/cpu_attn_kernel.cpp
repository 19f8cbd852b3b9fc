// Per-target body of the CPU_ATTN kernel (Highway foreach_target: this file is
// compiled once per SIMD target) and the run-time dispatch between targets.
//
// One work item: rows = query tokens x the query heads of one KV head. For each
// tile of kTileKeys keys the kernel computes the score tile S = Q K^T, applies
// soft cap / ALiBi / masks, updates the online softmax (running max m, sum l)
// and accumulates P V into the output accumulator. K and V of a tile are read
// (and dequantized) once for all rows. Two score paths:
//  - few rows (decodes): per key, dot products straight from the cache row;
//  - many rows (prefills): the K tile is transposed into a [D, kTileKeys]
//    buffer so each query scalar multiplies a vector of keys (no reductions).
// The AVX-512 target adds specializations of both, including the AVX512-BF16
// paths (cpu_attn_kernel_avx3-inl.h, included below), and AVX2 its K-tile
// transposition (a section below) and its four-row decode tile
// (cpu_attn_kernel_avx2-inl.h, included below).

// Only the targets CPU_ATTN tests: AVX-512, AVX2 and the portable HWY_SCALAR
// (this toolchain's baseline fallback).
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_SSE4 | HWY_AVX3_DL)
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "backends/cpu_attn/kernels/cpu_attn_kernel.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target must come first; the rest follows.
#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"
#include "backends/cpu_attn/kernels/cpu_attn_exp_avx512.h"
#include "backends/cpu_attn/kernels/cpu_attn_kernel.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Rows sharing one pass over a K row or a transposed K column (register block).
constexpr int kRowBlock = 4;
// Items with at least this many rows take the transposed-K score path: its
// packing cost (one scalar scatter per key element) amortizes over the rows.
constexpr int kTransposeMinRows = 16;
// e4m3 bits placed into an IEEE half's exponent/mantissa fields read 2^-8
// too small (half bias 15 vs e4m3 bias 7), subnormals included; the item
// multiplies the K and V scales by this once instead.
constexpr float kE4M3HalfRescale = 256.0f;
// What the half reading of the e4m3 NaN code S.1111.111 gives (1.875 * 2^0).
constexpr float kE4M3NanAsHalf = 1.875f;

// Factor LoadKV's values are off by for a KV element type.
float kv_load_rescale(DType kv) { return kv == DType::FP8_E4M3 ? kE4M3HalfRescale : 1.0f; }

inline float neg_inf() { return -std::numeric_limits<float>::infinity(); }

// ---- element access ----------------------------------------------------------

// Lanes(d) elements of a K/V row at `p`, converted (dequantized) to float.
template <DType KV, class D>
HWY_INLINE hn::Vec<D> LoadKV(D d, const unsigned char* p) {
  if constexpr (KV == DType::F32) {
    return hn::LoadU(d, reinterpret_cast<const float*>(p));
  } else if constexpr (KV == DType::BF16) {
    const hn::Rebind<hwy::bfloat16_t, D> dbf;
    return hn::PromoteTo(d, hn::LoadU(dbf, reinterpret_cast<const hwy::bfloat16_t*>(p)));
  } else if constexpr (KV == DType::F16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    return hn::PromoteTo(d, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(p)));
  } else if constexpr (KV == DType::FP8_E5M2) {
    // e5m2 is the top byte of an IEEE half.
    const hn::Rebind<std::uint8_t, D> du8;
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::Rebind<hwy::float16_t, D> dh;
    const auto half_bits = hn::ShiftLeft<8>(hn::PromoteTo(du16, hn::LoadU(du8, p)));
    return hn::PromoteTo(d, hn::BitCast(dh, half_bits));
  } else {
    static_assert(KV == DType::FP8_E4M3, "unsupported KV dtype");
    // Rebuilt as a half (exact, no float denormals: those cost microcode
    // assists on some CPUs), converted by the hardware half-to-float.
    const hn::Rebind<std::uint8_t, D> du8;
    const hn::Rebind<std::uint16_t, D> du16;
    const hn::Rebind<hwy::float16_t, D> dh;
    const auto b = hn::PromoteTo(du16, hn::LoadU(du8, p));
    const auto half_bits = hn::Or(hn::ShiftLeft<8>(hn::And(b, hn::Set(du16, std::uint16_t{0x80}))),
                                  hn::ShiftLeft<7>(hn::And(b, hn::Set(du16, std::uint16_t{0x7F}))));
    const auto value = hn::PromoteTo(d, hn::BitCast(dh, half_bits));
    const auto is_nan = hn::Eq(hn::Abs(value), hn::Set(d, kE4M3NanAsHalf));
    return hn::IfThenElse(is_nan, hn::Set(d, std::numeric_limits<float>::quiet_NaN()), value);
  }
}

const unsigned char* element(const void* base, std::int64_t offset, DType t) {
  return static_cast<const unsigned char*>(base) + offset * static_cast<std::int64_t>(dtype_size(t));
}

// What a KV head's K or V values (`scales`: p.k_scale or p.v_scale) are
// multiplied by: the fp8 dequantization scale times LoadKV's rescale.
float dequant_scale(const AttentionParams& p, const float* scales, int kv_head) {
  const float scale = scales == nullptr ? 1.0f : scales[p.per_head_kv_scales ? kv_head : 0];
  return scale * kv_load_rescale(p.kv_dtype);
}

// ---- one work item -------------------------------------------------------------

struct ItemShape {
  int group = 0;
  int rows = 0;
  int num_keys = 0;  // keys of the request
  int q_len = 0;     // query tokens of the request
  int first_token = 0;
};

ItemShape item_shape(const AttentionParams& p, int request, int q_begin, int q_end) {
  ItemShape s;
  s.group = p.num_heads / p.num_kv_heads;
  s.rows = (q_end - q_begin) * s.group;
  s.first_token = p.query_start_loc[request];
  s.q_len = p.query_start_loc[request + 1] - s.first_token;
  s.num_keys = p.key_source == KeySource::DenseRows ? s.q_len : p.seq_lens[request];
  return s;
}

// Visible keys of every row (docs/semantics.md masks); returns their union.
void fill_rows(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, RowInfo* rows,
               int& union_lo, int& union_hi) {
  const int context_len = shape.num_keys - shape.q_len;
  union_lo = shape.num_keys;
  union_hi = 0;
  for (int r = 0; r < shape.rows; ++r) {
    const int qi = item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const int pos = context_len + qi;
    int lo = 0;
    int hi = shape.num_keys;
    if (p.causal) hi = std::min(hi, pos + 1);
    if (p.sliding_window > 0) {
      lo = std::max(lo, pos - p.sliding_window + 1);
      hi = std::min(hi, p.window_form == WindowForm::Left ? pos + 1 : pos + p.sliding_window);
    }
    rows[r] = RowInfo{lo, hi, static_cast<float>(pos), p.alibi_slopes ? p.alibi_slopes[head] : 0.0f};
    if (lo < hi) {
      union_lo = std::min(union_lo, lo);
      union_hi = std::max(union_hi, hi);
    }
  }
}

void load_queries(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, float q_scale,
                  float* q) {
  const int d_size = p.head_size;
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + item.q_begin + r / shape.group;
    const int head = item.kv_head * shape.group + r % shape.group;
    const unsigned char* src =
        element(p.query.data, token * p.query.row_stride + head * p.query.head_stride, p.query.dtype);
    const auto step = static_cast<std::int64_t>(dtype_size(p.query.dtype));
    for (int d = 0; d < d_size; ++d) q[r * d_size + d] = load_as_float(src + d * step, p.query.dtype) * q_scale;
  }
}

// Row pointers of keys/values [t0, t0 + n) of one KV head.
void tile_pointers(const AttentionParams& p, const WorkItem& item, const ItemShape& shape, int t0, int n,
                   const unsigned char** k_rows, const unsigned char** v_rows) {
  if (p.key_source == KeySource::DenseRows) {
    for (int i = 0; i < n; ++i) {
      const std::int64_t row = shape.first_token + t0 + i;
      k_rows[i] = element(p.key.data, row * p.key.row_stride + item.kv_head * p.key.head_stride, p.kv_dtype);
      v_rows[i] = element(p.value.data, row * p.value.row_stride + item.kv_head * p.value.head_stride, p.kv_dtype);
    }
    return;
  }
  const std::int32_t* table = p.block_table + item.request * p.block_table_row_stride;
  const CacheOperand& kc = p.key_cache;
  const CacheOperand& vc = p.value_cache;
  // Walk the tile block by block: one table lookup per block, not per key.
  int i = 0;
  while (i < n) {
    const int j = t0 + i;
    const std::int64_t block = table[j / p.block_size];
    const int first_slot = j % p.block_size;
    const int run = std::min(n - i, p.block_size - first_slot);
    const unsigned char* k_row =
        element(kc.data, block * kc.block_stride + first_slot * kc.slot_stride + item.kv_head * kc.head_stride, p.kv_dtype);
    const unsigned char* v_row =
        element(vc.data, block * vc.block_stride + first_slot * vc.slot_stride + item.kv_head * vc.head_stride, p.kv_dtype);
    const std::int64_t k_step = kc.slot_stride * static_cast<std::int64_t>(dtype_size(p.kv_dtype));
    const std::int64_t v_step = vc.slot_stride * static_cast<std::int64_t>(dtype_size(p.kv_dtype));
    for (int s = 0; s < run; ++s, ++i) {
      k_rows[i] = k_row + s * k_step;
      v_rows[i] = v_row + s * v_step;
    }
  }
}

// Moves each row of x [rows, d_size] between head order and a kernel's
// working order, `block` elements at a time: slot s of a block holds head
// dimension slot_dim(s). tmp holds one row.
template <class T, class SlotDim>
void permute_rows(T* x, T* tmp, int rows, int d_size, int block, SlotDim slot_dim, bool to_slots) {
  for (int r = 0; r < rows; ++r) {
    T* row = x + static_cast<std::size_t>(r) * d_size;
    std::copy(row, row + d_size, tmp);
    for (int c = 0; c < d_size; c += block) {
      for (int s = 0; s < block; ++s) {
        if (to_slots) {
          row[c + s] = tmp[c + slot_dim(s)];
        } else {
          row[c + slot_dim(s)] = tmp[c + s];
        }
      }
    }
  }
}

// Paged blocks are scattered, so the hardware prefetchers lose the stream at
// every block: the kernel prefetches the next tile in software. Measured
// (docs/perf.md): the next tile into L1 beat two tiles ahead into L2, no
// prefetch, and prefetching only the start of each block (attempts 4, 10); once
// the AVX-512 decode loop got faster (attempt 13), another stream
// kFarPrefetchTiles ahead into L2 put more DRAM reads in flight (attempt 14).
// The chunked decode path instead spreads the next tile's prefetches over its
// score loops (TilePrefetch, attempt 26).
constexpr int kFarPrefetchTiles = 4;
// The same for RunChunkedDecode's tiles, in (tile, head) units, spread over
// the P V loop (docs/perf.md, attempts 41 and 48: 8 to 16 measured alike).
constexpr int kFarPrefetchUnits = 8;
// __builtin_prefetch locality hints.
constexpr int kKeepInL1 = 3;
constexpr int kKeepInL2 = 2;
constexpr int kCacheLine = 64;
// L1 data cache of the CPUs the AVX512-BF16 decode runs on (Zen 4, Cascade
// Lake, Cooper Lake; newer Intel cores have 48 KiB).
constexpr std::size_t kL1DataBytes = 32 * 1024;

// Prefetches the first `lines` cache lines of a row.
template <int kLocality>
HWY_INLINE void prefetch_lines(const unsigned char* row, int lines) {
  constexpr int kReadOnly = 0;
  for (int line = 0; line < lines; ++line) __builtin_prefetch(row + line * kCacheLine, kReadOnly, kLocality);
}

int cache_lines(std::size_t bytes) { return static_cast<int>((bytes + kCacheLine - 1) / kCacheLine); }

template <int kLocality>
void prefetch_rows(const unsigned char* const* rows, int n, std::size_t row_bytes) {
  for (int i = 0; i < n; ++i) prefetch_lines<kLocality>(rows[i], cache_lines(row_bytes));
}

// The tile after the one computed, for the chunked decode path to prefetch
// into L1 a few rows at a time from inside its score loop: a burst of a whole
// tile's prefetches fills the miss buffers and stalls the loads behind it,
// while spread out they keep DRAM busy under the arithmetic (docs/perf.md,
// attempt 26). The score loops of later row blocks of the same tile get
// `ahead` null.
struct TilePrefetch {
  const unsigned char* const* k_rows = nullptr;  // [n] K rows of the next tile
  const unsigned char* const* v_rows = nullptr;  // [n] V rows of the next tile
  int n = 0;
  int lines = 0;  // cache lines per K/V row
  bool into_l2 = false;  // the L2 hint instead of L1 (RunChunkedDecode: units that crowd L1)
};

// Prefetches the K and V rows of the tile ahead's keys [i0, i0 + count) in
// prefetch order (in the score loop only: prefetches in the P V loop measured
// slower). That order alternates between the two halves of the tile (its two
// blocks at the default block size), so four K/V streams advance together
// instead of two: the interleaved reads attempt 21 measured near the streaming
// roofline (docs/perf.md, attempt 34).
HWY_INLINE void prefetch_ahead(const TilePrefetch* ahead, int i0, int count) {
  if (ahead == nullptr) return;
  const int half = (ahead->n + 1) / 2;
  for (int i = i0; i < std::min(ahead->n, i0 + count); ++i) {
    const int key = i % 2 == 0 ? i / 2 : half + i / 2;  // 0, half, 1, half + 1, ...
    if (ahead->into_l2) {
      prefetch_lines<kKeepInL2>(ahead->k_rows[key], ahead->lines);
      prefetch_lines<kKeepInL2>(ahead->v_rows[key], ahead->lines);
    } else {
      prefetch_lines<kKeepInL1>(ahead->k_rows[key], ahead->lines);
      prefetch_lines<kKeepInL1>(ahead->v_rows[key], ahead->lines);
    }
  }
}

#if HWY_TARGET == HWY_AVX2
// Lane k of the result is the sum of a_k's lanes: three hadds and one add
// instead of four separate reductions.
HWY_INLINE __m128 SumLanes4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
#endif

// Stores the lane sums of four vectors at out[0], out[stride], ... (the first
// `count`). AVX2 reduces the four together (SumLanes4).
template <class D>
HWY_INLINE void store_sums4(D d, const hn::Vec<D> (&v)[4], float* out, int stride, int count) {
#if HWY_TARGET == HWY_AVX2
  static_cast<void>(d);
  alignas(16) float sums[4];
  _mm_store_ps(sums, SumLanes4(v[0].raw, v[1].raw, v[2].raw, v[3].raw));
  for (int j = 0; j < count; ++j) out[j * stride] = sums[j];
#else
  for (int j = 0; j < count; ++j) out[j * stride] = hn::GetLane(hn::SumOfLanes(d, v[j]));
#endif
}

// Stores the sums of kRowBlock accumulators into column i of the score tile
// (rows r0 .. r0 + rb).
template <class D>
HWY_INLINE void store_row_sums(D d, const Scratch& sc, int r0, int rb, int i, const hn::Vec<D> (&acc)[kRowBlock]) {
  static_assert(kRowBlock == 4, "rows are summed four at a time");
  store_sums4(d, acc, sc.s + r0 * kTileKeys + i, kTileKeys, rb);
}

// S[r, i] = q_r . k_i for keys straight from their rows (few rows). Always
// kRowBlock rows (missing rows of a partial block reuse row r0 and are not
// stored), so the accumulators stay in registers.
template <DType KV, class D>
void scores_rowwise(D d, const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* k_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < n; ++i) {
    for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
      const int rb = std::min(kRowBlock, rows - r0);
      const float* q[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + (r < rb ? r : 0)) * d_size;
      hn::Vec<D> acc[kRowBlock];
      for (int r = 0; r < kRowBlock; ++r) acc[r] = hn::Zero(d);
      for (int c = 0; c < d_size; c += lanes) {
        const auto k = LoadKV<KV>(d, k_rows[i] + c * esize);
        for (int r = 0; r < kRowBlock; ++r) acc[r] = hn::MulAdd(hn::LoadU(d, q[r] + c), k, acc[r]);
      }
      store_row_sums(d, sc, r0, rb, i, acc);
    }
  }
}

#if HWY_TARGET == HWY_AVX2
// Transposes eight rows of eight floats: out[e] lane j = in[j] lane e.
HWY_INLINE void Transpose8x8(const __m256 (&in)[8], __m256 (&out)[8]) {
  constexpr int kLow2 = 0x44;   // lanes 0, 1 of each source per 128-bit half
  constexpr int kHigh2 = 0xEE;  // lanes 2, 3
  constexpr int kLowHalves = 0x20;
  constexpr int kHighHalves = 0x31;
  __m256 pairs[8];
  for (int j = 0; j < 8; j += 2) {
    pairs[j] = _mm256_unpacklo_ps(in[j], in[j + 1]);
    pairs[j + 1] = _mm256_unpackhi_ps(in[j], in[j + 1]);
  }
  __m256 quads[8];
  for (int j = 0; j < 8; j += 4) {
    quads[j] = _mm256_shuffle_ps(pairs[j], pairs[j + 2], kLow2);
    quads[j + 1] = _mm256_shuffle_ps(pairs[j], pairs[j + 2], kHigh2);
    quads[j + 2] = _mm256_shuffle_ps(pairs[j + 1], pairs[j + 3], kLow2);
    quads[j + 3] = _mm256_shuffle_ps(pairs[j + 1], pairs[j + 3], kHigh2);
  }
  for (int e = 0; e < 4; ++e) {
    out[e] = _mm256_permute2f128_ps(quads[e], quads[e + 4], kLowHalves);
    out[e + 4] = _mm256_permute2f128_ps(quads[e], quads[e + 4], kHighHalves);
  }
}

// sc.kt [D, kTileKeys] = the tile's K rows, converted and transposed in 8 x 8
// blocks (the scalar scatter it replaces cost a store per element, about a
// fifth of an AVX2 prefill tile; docs/perf.md, attempt 25). Keys past n repeat
// key n - 1: the softmax masks their columns.
template <DType KV, class D>
void transpose_k_tile(D d, const Scratch& sc, int d_size, int n, const unsigned char* const* k_rows) {
  constexpr int kBlock = 8;
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i0 = 0; i0 < kTileKeys; i0 += kBlock) {
    const unsigned char* k[kBlock];
    for (int j = 0; j < kBlock; ++j) k[j] = k_rows[std::min(i0 + j, n - 1)];
    for (int e0 = 0; e0 < d_size; e0 += kBlock) {
      __m256 in[kBlock];
      for (int j = 0; j < kBlock; ++j) in[j] = LoadKV<KV>(d, k[j] + e0 * esize).raw;
      __m256 out[kBlock];
      Transpose8x8(in, out);
      for (int e = 0; e < kBlock; ++e) _mm256_store_ps(sc.kt + (e0 + e) * kTileKeys + i0, out[e]);
    }
  }
}
#endif  // HWY_TARGET == HWY_AVX2

// S = Q K^T through a transposed K tile (many rows): no horizontal reductions.
// Not inlined: inside RunItemTyped its register block lost registers to the
// caller's live values and spilled (q2k ~10% slower, docs/perf.md attempt 39).
template <DType KV, class D>
HWY_NOINLINE void scores_transposed(D d, const Scratch& sc, int rows, int d_size, int n,
                                    const unsigned char* const* k_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
#if HWY_TARGET == HWY_AVX2
  transpose_k_tile<KV>(d, sc, d_size, n, k_rows);
#else
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i = 0; i < kTileKeys; ++i) {
    if (i < n) {
      for (int c = 0; c < d_size; c += lanes) hn::StoreU(LoadKV<KV>(d, k_rows[i] + c * esize), d, sc.tmp + c);
      for (int e = 0; e < d_size; ++e) sc.kt[e * kTileKeys + i] = sc.tmp[e];
    } else {
      for (int e = 0; e < d_size; ++e) sc.kt[e * kTileKeys + i] = 0.0f;
    }
  }
#endif
  const int key_vecs = kTileKeys / lanes;
  for (int r0 = 0; r0 < rows; r0 += kRowBlock) {
    const int rb = std::min(kRowBlock, rows - r0);
    // Always kRowBlock rows (missing rows of a partial block reuse row r0 and
    // are not stored): a runtime row count would keep the accumulators in
    // memory, which is what AVX2 (no vdpbf16ps path) runs for every prefill.
    const float* q[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) q[r] = sc.q + (r0 + (r < rb ? r : 0)) * d_size;
    for (int kv0 = 0; kv0 < key_vecs; kv0 += 2) {
      // Two key vectors x four rows: eight accumulators stay in registers.
      const int kvn = std::min(2, key_vecs - kv0);
      hn::Vec<D> acc[kRowBlock][2];
      for (int r = 0; r < kRowBlock; ++r) acc[r][0] = acc[r][1] = hn::Zero(d);
      for (int e = 0; e < d_size; ++e) {
        const float* col = sc.kt + e * kTileKeys + kv0 * lanes;
        const auto k0 = hn::Load(d, col);
        const auto k1 = kvn > 1 ? hn::Load(d, col + lanes) : hn::Zero(d);
        for (int r = 0; r < kRowBlock; ++r) {
          const auto qv = hn::Set(d, q[r][e]);
          acc[r][0] = hn::MulAdd(qv, k0, acc[r][0]);
          acc[r][1] = hn::MulAdd(qv, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < rb; ++r) {
        float* out = sc.s + (r0 + r) * kTileKeys + kv0 * lanes;
        hn::Store(acc[r][0], d, out);
        if (kvn > 1) hn::Store(acc[r][1], d, out + lanes);
      }
    }
  }
}

// The score modifiers of the params (soft cap, then ALiBi), vector by vector.
template <class D>
struct ScoreModifiers {
  bool soft_cap;
  bool alibi;
  hn::Vec<D> cap;
  hn::Vec<D> inv_cap;

  ScoreModifiers(D d, const AttentionParams& p)
      : soft_cap(p.soft_cap > 0.0f),
        alibi(p.alibi_slopes != nullptr),
        cap(hn::Set(d, p.soft_cap)),
        inv_cap(hn::Set(d, soft_cap ? 1.0f / p.soft_cap : 0.0f)) {}

  bool any() const { return soft_cap || alibi; }
};

// The rows' visible keys [lo, hi) and ALiBi terms, per lane (the four-row
// softmaxes put several rows in one vector; softmax_tile repeats one row).
template <class D>
struct LaneRows {
  hn::Vec<hn::RebindToSigned<D>> lo_minus_one;
  hn::Vec<hn::RebindToSigned<D>> hi;
  hn::Vec<D> slope;
  hn::Vec<D> position;
};

// The end of a row's visible keys in the tile [t0, t0 + n), and whether the
// row sees all kTileKeys keys of it (then no key needs a mask).
inline int visible_end(const RowInfo& info, int t0, int n) { return std::min(info.hi, t0 + n); }
inline bool sees_whole_tile(const RowInfo& info, int t0, int n) {
  return info.lo <= t0 && visible_end(info, t0, n) >= t0 + kTileKeys;
}

// Soft cap, then ALiBi, then the visible interval on scores sv of keys j
// (per lane): keys a row does not see become -inf, and `nan` gains the lanes
// whose visible score was NaN before the modifiers. Every softmax of the
// kernel masks through this.
template <class D>
HWY_INLINE hn::Vec<D> mask_scores(D d, const ScoreModifiers<D>& modifiers, const LaneRows<D>& rows,
                                  hn::Vec<D> sv, hn::Vec<hn::RebindToSigned<D>> j, hn::Mask<D>& nan) {
  const auto raw_nan = hn::IsNaN(sv);
  if (modifiers.soft_cap) sv = hn::Mul(modifiers.cap, hn::Tanh(d, hn::Mul(sv, modifiers.inv_cap)));
  if (modifiers.alibi) sv = hn::MulAdd(rows.slope, hn::Sub(hn::ConvertTo(d, j), rows.position), sv);
  const auto visible = hn::RebindMask(d, hn::And(hn::Gt(j, rows.lo_minus_one), hn::Lt(j, rows.hi)));
  nan = hn::Or(nan, hn::And(raw_nan, visible));
  return hn::IfThenElse(visible, sv, hn::Set(d, neg_inf()));
}

// The AVX-512 specializations (compiled in the AVX3 pass only).
#include "backends/cpu_attn/kernels/cpu_attn_kernel_avx3-inl.h"

// Soft cap, ALiBi and masks on the score tile, then the online-softmax update:
// S becomes P = exp(S - m_new) (times prob_scale, kChunkRescale; l sums the
// unscaled P), alpha = exp(m_old - m_new).
template <class D>
void softmax_tile(D d, const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                  float prob_scale = 1.0f) {
  const hn::RebindToSigned<D> di;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const ScoreModifiers<D> modifiers(d, p);
  const auto minus_inf = hn::Set(d, neg_inf());
  for (int r = 0; r < rows; ++r) {
    const RowInfo& info = sc.rows[r];
    float* srow = sc.s + r * kTileKeys;
    const int lo = info.lo;
    const int hi = visible_end(info, t0, n);
    if (lo >= hi || hi <= t0 || lo >= t0 + n) {
      sc.alpha[r] = 1.0f;
      for (int i = 0; i < kTileKeys; ++i) srow[i] = 0.0f;
      continue;
    }
    auto vmax = minus_inf;
    const LaneRows<D> lane_rows{hn::Set(di, lo - 1), hn::Set(di, hi), hn::Set(d, info.slope),
                                hn::Set(d, info.position)};
    // A tile the row sees whole (most tiles of a long row) needs no mask.
    const bool whole = sees_whole_tile(info, t0, n);
    auto nan = hn::FirstN(d, 0);  // a visible score is NaN
    for (int i = 0; i < kTileKeys; i += lanes) {
      auto sv = hn::Load(d, srow + i);
      if (whole && !modifiers.any()) {
        vmax = hn::Max(vmax, sv);
        nan = hn::Or(nan, hn::IsNaN(sv));
        continue;
      }
      sv = mask_scores(d, modifiers, lane_rows, sv, hn::Iota(di, t0 + i), nan);
      hn::Store(sv, d, srow + i);
      vmax = hn::Max(vmax, sv);
    }
    const float m_old = sc.m[r];
    const float m_new = std::max(m_old, hn::GetLane(hn::MaxOfLanes(d, vmax)));
    const auto vm = hn::Set(d, m_new);
    auto vsum = hn::Zero(d);
    const auto vscale = hn::Set(d, prob_scale);
    for (int i = 0; i < kTileKeys; i += lanes) {
      const auto pv = hn::Exp(d, hn::Sub(hn::Load(d, srow + i), vm));  // exp(-inf) = 0 for masked keys
      hn::Store(hn::Mul(pv, vscale), d, srow + i);
      vsum = hn::Add(vsum, pv);
    }
    // Exp clamps its argument, which turns a NaN score into P = 0: a NaN alpha
    // makes the row's accumulator and sum NaN instead, as the oracle's are.
    const float alpha = !hn::AllFalse(d, nan) ? std::numeric_limits<float>::quiet_NaN()
                        : m_old == neg_inf()  ? 0.0f
                                              : std::exp(m_old - m_new);
    sc.alpha[r] = alpha;
    sc.l[r] = sc.l[r] * alpha + hn::GetLane(hn::SumOfLanes(d, vsum));
    sc.m[r] = m_new;
  }
}

// acc = alpha * acc + P V. `v_rows` point at the rows of the tile, or null when
// the tile was converted into sc.vf. Full blocks of kRowBlock rows keep their
// accumulators in registers (a runtime row count would spill them).
template <DType KV, class D>
HWY_INLINE hn::Vec<D> LoadV(D d, const Scratch& sc, const unsigned char* const* v_rows, int i, int c, int d_size) {
  if (v_rows != nullptr) return LoadKV<KV>(d, v_rows[i] + c * static_cast<int>(dtype_size(KV)));
  return hn::Load(d, sc.vf + i * d_size + c);
}

template <DType KV, class D>
void accumulate_pv(D d, const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* v_rows) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  int r0 = 0;
  for (; r0 + kRowBlock <= rows; r0 += kRowBlock) {
    float* a[kRowBlock];
    const float* prob[kRowBlock];
    for (int r = 0; r < kRowBlock; ++r) {
      a[r] = sc.acc + (r0 + r) * d_size;
      prob[r] = sc.s + (r0 + r) * kTileKeys;
    }
    const auto alpha0 = hn::Set(d, sc.alpha[r0]);
    const auto alpha1 = hn::Set(d, sc.alpha[r0 + 1]);
    const auto alpha2 = hn::Set(d, sc.alpha[r0 + 2]);
    const auto alpha3 = hn::Set(d, sc.alpha[r0 + 3]);
    for (int c = 0; c < d_size; c += lanes) {
      auto acc0 = hn::Mul(hn::Load(d, a[0] + c), alpha0);
      auto acc1 = hn::Mul(hn::Load(d, a[1] + c), alpha1);
      auto acc2 = hn::Mul(hn::Load(d, a[2] + c), alpha2);
      auto acc3 = hn::Mul(hn::Load(d, a[3] + c), alpha3);
      for (int i = 0; i < n; ++i) {
        const auto v = LoadV<KV>(d, sc, v_rows, i, c, d_size);
        acc0 = hn::MulAdd(hn::Set(d, prob[0][i]), v, acc0);
        acc1 = hn::MulAdd(hn::Set(d, prob[1][i]), v, acc1);
        acc2 = hn::MulAdd(hn::Set(d, prob[2][i]), v, acc2);
        acc3 = hn::MulAdd(hn::Set(d, prob[3][i]), v, acc3);
      }
      hn::Store(acc0, d, a[0] + c);
      hn::Store(acc1, d, a[1] + c);
      hn::Store(acc2, d, a[2] + c);
      hn::Store(acc3, d, a[3] + c);
    }
  }
  for (; r0 < rows; ++r0) {  // leftover rows, one at a time
    float* a = sc.acc + r0 * d_size;
    const float* prob = sc.s + r0 * kTileKeys;
    const auto alpha = hn::Set(d, sc.alpha[r0]);
    for (int c = 0; c < d_size; c += lanes) {
      auto acc = hn::Mul(hn::Load(d, a + c), alpha);
      for (int i = 0; i < n; ++i) acc = hn::MulAdd(hn::Set(d, prob[i]), LoadV<KV>(d, sc, v_rows, i, c, d_size), acc);
      hn::Store(acc, d, a + c);
    }
  }
}

// The register accumulators of a P V pass: rows r0 .. r0 + kR of sc.acc (a[r]),
// kV vectors from element c0, rescaled by the rows' alpha on the way in.
template <int kR, int kV, class D>
HWY_INLINE void load_rescaled(D d, const Scratch& sc, int r0, float* const (&a)[kR], int c0,
                              hn::Vec<D> (&acc)[kR][kV]) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int r = 0; r < kR; ++r) {
    const auto alpha = hn::Set(d, sc.alpha[r0 + r]);
    for (int v = 0; v < kV; ++v) acc[r][v] = hn::Mul(hn::Load(d, a[r] + c0 + v * lanes), alpha);
  }
}

template <int kR, int kV, class D>
HWY_INLINE void store_accumulators(D d, float* const (&a)[kR], int c0, const hn::Vec<D> (&acc)[kR][kV]) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  for (int r = 0; r < kR; ++r) {
    for (int v = 0; v < kV; ++v) hn::Store(acc[r][v], d, a[r] + c0 + v * lanes);
  }
}

// acc = alpha * acc + P V for a converted V tile (prefills), kWidePvRows rows
// x kWidePvVectors vectors at a time, so each V load feeds kWidePvRows FMAs
// and each probability broadcast kWidePvVectors (the 4-row loop above is
// load-bound). AVX-512: 2 x 8 accumulators of its 32 registers; AVX2: 3 x 4 =
// 12 of 16, since 8 FMA chains are the latency limit (4-cycle FMAs, two per
// cycle) and left no slack (docs/perf.md, attempt 27). Needs d_size %
// (kWidePvVectors lanes) == 0.
constexpr int kWidePvVectors = HWY_TARGET == HWY_AVX3 ? 8 : 4;
constexpr int kWidePvRows = HWY_TARGET == HWY_AVX2 ? 3 : 2;

template <int kR, class D>
void pv_wide_block(D d, const Scratch& sc, int r0, int d_size, int n) {
  const int lanes = static_cast<int>(hn::Lanes(d));
  float* a[kR];
  const float* prob[kR];
  for (int r = 0; r < kR; ++r) {
    a[r] = sc.acc + (r0 + r) * d_size;
    prob[r] = sc.s + (r0 + r) * kTileKeys;
  }
  for (int c0 = 0; c0 < d_size; c0 += kWidePvVectors * lanes) {
    hn::Vec<D> acc[kR][kWidePvVectors];
    load_rescaled(d, sc, r0, a, c0, acc);
    for (int i = 0; i < n; ++i) {
      const float* vrow = sc.vf + i * d_size + c0;
      for (int r = 0; r < kR; ++r) {
        const auto b = hn::Set(d, prob[r][i]);
        for (int v = 0; v < kWidePvVectors; ++v)
          acc[r][v] = hn::MulAdd(b, hn::Load(d, vrow + v * lanes), acc[r][v]);
      }
    }
    store_accumulators(d, a, c0, acc);
  }
}

template <class D>
void accumulate_pv_wide(D d, const Scratch& sc, int rows, int d_size, int n) {
  int r0 = 0;
  for (; r0 + kWidePvRows <= rows; r0 += kWidePvRows) pv_wide_block<kWidePvRows>(d, sc, r0, d_size, n);
  if constexpr (kWidePvRows > 2) {
    if (rows - r0 >= 2) {
      pv_wide_block<2>(d, sc, r0, d_size, n);
      r0 += 2;
    }
  }
  if (r0 < rows) pv_wide_block<1>(d, sc, r0, d_size, n);
}

// The chunked decode path: chunk loads, score and P V passes, tile_decode.
#include "backends/cpu_attn/kernels/cpu_attn_kernel_chunked-inl.h"

#if HWY_TARGET == HWY_AVX3
// One tile of the AVX512-BF16 decode path: `ahead` is prefetched into L1 from
// the score loop, `far` into L2 from the P V loop. `score_scale`: the softmax
// scale times the KV head's K dequantization scale (the bf16 queries stay
// unscaled). `packed_scores`: K is a Keys16-packed e4m3 cache and the tile
// starts a group (k_rows point at the rows' row-major positions).
template <DType KV>
void tile_decode_dot(const AttentionParams& p, const Scratch& sc, int rows, int t0, int n,
                     const unsigned char* const* k_rows, const unsigned char* const* v_rows,
                     const TilePrefetch& ahead, const TilePrefetch& far, float score_scale, bool packed_scores) {
  if (KV == DType::FP8_E4M3 && packed_scores) {
    ScoresDecodePackedE4M3(sc, rows, p.head_size, n, k_rows, score_scale, ahead);
  } else {
    ScoresDecodeBf16<KV>(sc, rows, p.head_size, n, k_rows, score_scale, ahead);
  }
  SoftmaxDecode(p, sc, rows, t0, n);
  AccumulatePvDecodeBf16<KV>(sc, rows, p.head_size, n, v_rows, far);
}
#endif

// out[e] = acc[e] * factor (zeros when acc is null) for e < n, stored as
// `out_dtype`: a DType, or a std::integral_constant of one. A constant dtype
// lets the compiler vectorize the conversion, which a per-element dtype switch
// kept scalar (~10% of a 256-key decode item, docs/perf.md attempt 55).
template <class OutDType>
void store_row_as(OutDType out_dtype, unsigned char* out, const float* acc, float factor, int n) {
  const auto step = static_cast<std::int64_t>(dtype_size(out_dtype));
  for (int e = 0; e < n; ++e) store_from_float(out + e * step, out_dtype, acc == nullptr ? 0.0f : acc[e] * factor);
}

template <DType kOut>
using OutDTypeConstant = std::integral_constant<DType, kOut>;

void store_output_row(DType out_dtype, unsigned char* out, const float* acc, float factor, int n) {
  switch (out_dtype) {
    case DType::F32:
      return store_row_as(OutDTypeConstant<DType::F32>{}, out, acc, factor, n);
    case DType::F16:
      return store_row_as(OutDTypeConstant<DType::F16>{}, out, acc, factor, n);
    case DType::BF16:
      return store_row_as(OutDTypeConstant<DType::BF16>{}, out, acc, factor, n);
    default:
      return store_row_as(out_dtype, out, acc, factor, n);
  }
}

// Writes one finished row: output in the query dtype, LSE; sink and v_scale applied.
void finish_row(const AttentionParams& p, int token, int head, float m, float l, const float* acc, float v_scale) {
  const int d_size = p.head_size;
  const DType out_dtype = p.query.dtype;
  auto* out = static_cast<unsigned char*>(p.output) +
              (token * p.output_row_stride + head * p.output_head_stride) * static_cast<std::int64_t>(dtype_size(out_dtype));
  float* lse = p.lse == nullptr ? nullptr : p.lse + head * p.lse_head_stride + token * p.lse_token_stride;
  // No visible key: zeros, LSE -inf (also with a sink). A row whose every
  // visible score was NaN can end with m = -inf too (a max may drop NaN), but
  // its sum is NaN (the softmaxes give it a NaN alpha): it comes out NaN.
  if (m == neg_inf() && !std::isnan(l)) {
    store_output_row(out_dtype, out, nullptr, 0.0f, d_size);
    if (lse != nullptr) *lse = neg_inf();
    return;
  }
  if (p.sinks != nullptr) {
    const float sink = p.sinks[head];
    const float m_all = std::max(m, sink);
    l = l * std::exp(m - m_all) + std::exp(sink - m_all);
    v_scale *= std::exp(m - m_all);
    m = m_all;
  }
  store_output_row(out_dtype, out, acc, v_scale / l, d_size);
  if (lse != nullptr) *lse = m + std::log(l);
}

// Whether K comes from a packed cache (kv_packing.h).
bool keys_packed(const AttentionParams& p) {
  return p.key_source == KeySource::PagedCache && p.key_cache.packing != KeyPacking::None;
}

// Whether one KV head's consecutive K or V rows are not adjacent in memory
// (NHD caches with several KV heads, or strided new keys).
bool rows_scattered(const AttentionParams& p, int d_size) {
  if (p.key_source == KeySource::DenseRows) return p.key.row_stride != d_size || p.value.row_stride != d_size;
  return p.key_cache.slot_stride != d_size || p.value_cache.slot_stride != d_size;
}

// Copies n rows of row_bytes into out, one after another, and points
// staged[i] at row i's copy. Reads nothing past a row (rows need not be a
// whole number of vectors: e5m2 head size 80 is 80 bytes).
template <class D>
void stage_rows([[maybe_unused]] D d, const unsigned char* const* rows, int n, std::size_t row_bytes,
                unsigned char* out, const unsigned char** staged) {
  std::size_t whole = 0;  // bytes copied a vector at a time
#if HWY_TARGET != HWY_SCALAR
  const hn::Repartition<std::uint8_t, D> du8;
  whole = row_bytes / hn::Lanes(du8) * hn::Lanes(du8);
#endif
  for (int i = 0; i < n; ++i) {
    unsigned char* dst = out + static_cast<std::size_t>(i) * row_bytes;
#if HWY_TARGET != HWY_SCALAR
    for (std::size_t b = 0; b < whole; b += hn::Lanes(du8)) hn::StoreU(hn::LoadU(du8, rows[i] + b), du8, dst + b);
#endif
    if (whole < row_bytes) std::memcpy(dst + whole, rows[i] + whole, row_bytes - whole);
    staged[i] = dst;
  }
}

// Copies the K rows of keys [t0, t0 + n) of a Keys16-packed cache (k_rows:
// their row-major positions, tile_pointers) into out in row order, each
// dimension pair at once, and points staged[i] at row i: the paths that read
// rows (prefill, the chunked decode, e4m3 tiles not starting a group) read these.
template <DType KV>
void unpack_key_rows(const AttentionParams& p, int t0, int n, const unsigned char* const* k_rows,
                     unsigned char* out, const unsigned char** staged) {
  constexpr std::size_t kPairBytes = 2 * dtype_size(KV);
  const int d_size = p.head_size;
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(KV);
  for (int i = 0; i < n; ++i) {
    const int t = (t0 + i) % p.block_size % kPackedKeyGroup;
    const unsigned char* group = k_rows[i] - static_cast<std::size_t>(t) * row_bytes;
    unsigned char* dst = out + static_cast<std::size_t>(i) * row_bytes;
    for (int d = 0; d < d_size; d += 2) {
      std::memcpy(dst + d * dtype_size(KV), group + packed_key_group_offset(t, d) * dtype_size(KV), kPairBytes);
    }
    staged[i] = dst;
  }
}

// Whether an item of `rows` rows takes the chunked decode path with its
// chunk tiles (AVX-512 with AVX512-BF16 walks it with its vdpbf16ps tiles
// where takes_decode_dot; AVX-512 without it with these, docs/perf.md
// attempt 46).
template <DType KV>
bool takes_chunked_path(int rows, int d_size, int lanes) {
  return rows < kTransposeMinRows && d_size % chunk_block<KV>(lanes) == 0;
}

// Whether a decode item takes the AVX512-BF16 decode path (bf16 queries, bf16
// or e4m3 K/V, head size a multiple of kDecodeChunk; `dot`: the CPU has
// AVX512-BF16). Its tiles are walked like the chunked path's
// (RunChunkedDecode); a rowwise vdpbf16ps loop measured slower than fp32
// (docs/perf.md, attempt 2): converting whole 64-value chunks and pairing V
// keys is what makes it pay (attempt 13).
template <DType KV>
bool takes_decode_dot([[maybe_unused]] const AttentionParams& p, [[maybe_unused]] int rows,
                      [[maybe_unused]] bool dot) {
#if HWY_TARGET == HWY_AVX3
  return kDecodeDotKV<KV> && dot && rows < kTransposeMinRows && p.query.dtype == DType::BF16 &&
         p.head_size % kDecodeChunk == 0;
#else
  return false;
#endif
}

// The item restricted to its KV head number h.
WorkItem head_of(const WorkItem& item, int h) {
  WorkItem one = item;
  one.kv_head = item.kv_head + h;
  one.kv_heads = 1;
  if (item.partial_token >= 0) one.partial_token = item.partial_token + h * item.partial_head_stride;
  return one;
}

// A single-head item's rows, the keys [lo, hi) it reads and its zeroed
// online-softmax state.
void begin_head(const AttentionParams& p, const WorkItem& one, const ItemShape& shape, const Scratch& sc,
                int& lo, int& hi) {
  fill_rows(p, one, shape, sc.rows, lo, hi);
  lo = std::max(lo, one.k_begin);
  hi = std::min(hi, one.k_end);
  std::fill(sc.acc, sc.acc + static_cast<std::size_t>(shape.rows) * p.head_size, 0.0f);
  std::fill(sc.m, sc.m + shape.rows, neg_inf());
  std::fill(sc.l, sc.l + shape.rows, 0.0f);
}

// Writes a single-head item's result: its split partial, or its output rows.
void end_head(const AttentionParams& p, const WorkItem& one, const ItemShape& shape, const Scratch& sc,
              const PartialState& partials) {
  const int d_size = p.head_size;
  if (one.partial_token >= 0) {
    const std::size_t row_floats = partial_row_floats(d_size);
    float* base = partials.data + static_cast<std::size_t>(one.partial_token) * shape.group * row_floats;
    for (int r = 0; r < shape.rows; ++r) {
      float* dst = base + static_cast<std::size_t>(r) * row_floats;
      std::copy(sc.acc + r * d_size, sc.acc + (r + 1) * d_size, dst);
      dst[d_size] = sc.m[r];
      dst[d_size + 1] = sc.l[r];
    }
    return;
  }
  const float v_scale = dequant_scale(p, p.v_scale, one.kv_head);
  for (int r = 0; r < shape.rows; ++r) {
    const int token = shape.first_token + one.q_begin + r / shape.group;
    const int head = one.kv_head * shape.group + r % shape.group;
    finish_row(p, token, head, sc.m[r], sc.l[r], sc.acc + r * d_size, v_scale);
  }
}

// The chunked decode path over an item's KV heads: tile by tile, and within a
// tile head by head, each head with its own state. One KV head per item reads
// 4 KiB of each HND block (16 keys, head size 128, bf16) and jumps; all heads
// of a block range read whole blocks, measured faster (docs/perf.md, attempt
// 39; the software prefetches still carry the reads). The next (tile, head)
// unit is prefetched into L1 while one is computed, and the unit
// kFarPrefetchUnits ahead into L2 (on Zen 4 the L2 hint leaves the L1 miss
// buffers to the near prefetches and the demand loads, attempts 41 and 48).
// `decode_dot`: the tiles are the AVX512-BF16 decode path's
// (takes_decode_dot), with bf16 queries in head order.
template <DType KV, class D>
void RunChunkedDecode(D d, const AttentionParams& p, const WorkItem& item, const PartialState& partials,
                      void* scratch, bool decode_dot) {
  const ItemShape shape = item_shape(p, item.request, item.q_begin, item.q_end);
  const int d_size = p.head_size;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const int heads = item.kv_heads;
  const auto head_scratch = [&](int h) { return Scratch(scratch, d_size, shape.rows, h, heads); };
  int lo = 0;
  int hi = 0;  // the same for every head: no mask depends on the head
  const bool packed_k = keys_packed(p);
  // e4m3 tiles that start a Keys16 group read the packed K as it is; other
  // packed K is unpacked per tile. lo is the same for all of the item's tiles.
  bool packed_scores = false;
  for (int h = 0; h < heads; ++h) {
    const WorkItem one = head_of(item, h);
    const Scratch sc = head_scratch(h);
    begin_head(p, one, shape, sc, lo, hi);
    packed_scores = decode_dot && KV == DType::FP8_E4M3 && packed_k && lo % kPackedKeyGroup == 0;
#if HWY_TARGET == HWY_AVX3
    if constexpr (kDecodeDotKV<KV>) {
      if (decode_dot) {
        LoadQueriesBf16(p, one, shape, reinterpret_cast<std::uint16_t*>(sc.q));
        if (!packed_scores) QueriesToKeySlotOrder<KV>(reinterpret_cast<std::uint16_t*>(sc.q), shape.rows, d_size);
        continue;
      }
    }
#endif
    load_queries(p, one, shape, p.scale * dequant_scale(p, p.k_scale, one.kv_head), sc.q);
    reorder_rows<KV>(sc.q, sc.tmp, shape.rows, d_size, lanes, true);
  }
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(KV);
  // A KV head's rows 2 KiB apart (NHD) share a few L1 sets, which one tile
  // overflows: each unit's rows are copied together first (docs/perf.md,
  // attempt 36), into the transposed-K and V-tile buffers this path leaves unused.
  const bool staged = rows_scattered(p, d_size);
  const unsigned char* staged_k[kTileKeys];
  const unsigned char* staged_v[kTileKeys];
  // Units in order: (tile 0, head 0), (tile 0, head 1), ... Row pointers of
  // the units from the one computed to the last one prefetched, each computed
  // once: the next unit is prefetched into L1 and the one kFarPrefetchUnits
  // ahead into L2.
  constexpr int kUnitRing = kFarPrefetchUnits + 1;
  const unsigned char* unit_k[kUnitRing][kTileKeys];
  const unsigned char* unit_v[kUnitRing][kTileKeys];
  // The chunk tiles take the far stream for 2- and 4-byte K/V only: with
  // 1-byte K/V it measured slower (docs/perf.md, attempt 48).
  const bool far_stream = decode_dot || dtype_size(KV) > 1;
  const int lookahead = far_stream ? kFarPrefetchUnits : 1;
  // The AVX512-BF16 tiles prefetch the next unit into L1 only when it and the
  // unit computed take at most half of L1: bf16 units at head size 128 evicted
  // the unit computed, and the L2 hint measured faster (docs/perf.md, attempt
  // 43); with 64-key tiles e4m3 units (16 KiB) measured faster with it too
  // (attempt 50).
  const std::size_t unit_bytes = 2 * kTileKeys * row_bytes;
  const bool near_into_l2 = decode_dot && 2 * unit_bytes > kL1DataBytes / 2;
  const int units = lo < hi ? (hi - lo + kTileKeys - 1) / kTileKeys * heads : 0;
  const auto unit_t0 = [&](int u) { return lo + u / heads * kTileKeys; };
  const auto unit_n = [&](int u) { return u < units ? std::min(kTileKeys, hi - unit_t0(u)) : 0; };
  const auto pointers = [&](int u) {
    tile_pointers(p, head_of(item, u % heads), shape, unit_t0(u), unit_n(u), unit_k[u % kUnitRing],
                  unit_v[u % kUnitRing]);
  };
  const auto prefetch_of = [&](int u, int lines) {
    return TilePrefetch{unit_k[u % kUnitRing], unit_v[u % kUnitRing], unit_n(u), lines, near_into_l2};
  };
  for (int u = 0; u < std::min(units, lookahead); ++u) pointers(u);
  for (int u = 0; u < units; ++u) {
    if (u + lookahead < units) pointers(u + lookahead);
    const TilePrefetch ahead = prefetch_of(u + 1, cache_lines(row_bytes));
    const unsigned char* const* k_rows = unit_k[u % kUnitRing];  // [n] this unit's rows
    const unsigned char* const* v_rows = unit_v[u % kUnitRing];
    const int n = unit_n(u);
    const Scratch sc = head_scratch(u % heads);
    if (packed_k && !packed_scores) {
      unpack_key_rows<KV>(p, unit_t0(u), n, k_rows, sc.ks, staged_k);
      k_rows = staged_k;
    } else if (staged) {
      // A packed K's rows are adjacent, so its groups are copied whole.
      stage_rows(d, k_rows, n, row_bytes, reinterpret_cast<unsigned char*>(sc.kt), staged_k);
      k_rows = staged_k;
    }
    if (staged) {
      stage_rows(d, v_rows, n, row_bytes, reinterpret_cast<unsigned char*>(sc.vf), staged_v);
      v_rows = staged_v;
    }
    const TilePrefetch far =
        far_stream ? prefetch_of(u + kFarPrefetchUnits, cache_lines(row_bytes)) : TilePrefetch{};
#if HWY_TARGET == HWY_AVX3
    if constexpr (kDecodeDotKV<KV>) {
      if (decode_dot) {
        const float score_scale = p.scale * dequant_scale(p, p.k_scale, item.kv_head + u % heads);
        tile_decode_dot<KV>(p, sc, shape.rows, unit_t0(u), n, k_rows, v_rows, ahead, far, score_scale,
                            packed_scores);
        continue;
      }
    }
#endif
    tile_decode<KV>(d, p, sc, shape.rows, unit_t0(u), n, k_rows, v_rows, ahead, far);
  }
  for (int h = 0; h < heads; ++h) {
    const Scratch sc = head_scratch(h);
    if (!decode_dot) reorder_rows<KV>(sc.acc, sc.tmp, shape.rows, d_size, lanes, false);
#if HWY_TARGET == HWY_AVX3
    if constexpr (kDecodeDotKV<KV>) {
      if (decode_dot) AccToHeadOrder<KV>(sc.acc, shape.rows, d_size);
    }
#endif
    end_head(p, head_of(item, h), shape, sc, partials);
  }
}

// `dot`: take the AVX512-BF16 prefill paths where they apply (bf16 queries and
// keys; head size a multiple of 32 for the scores, of 128 for P V).
template <DType KV, class D>
void RunItemTyped(D d, const AttentionParams& p, const WorkItem& item, const PartialState& partials, void* scratch,
                  bool dot) {
  const ItemShape shape = item_shape(p, item.request, item.q_begin, item.q_end);
  const int d_size = p.head_size;
  const int lanes = static_cast<int>(hn::Lanes(d));
  const Scratch sc(scratch, d_size, shape.rows, 0, 1);
  int lo = 0;
  int hi = 0;
  begin_head(p, item, shape, sc, lo, hi);
  const float k_scale = dequant_scale(p, p.k_scale, item.kv_head);
  const bool packed = shape.rows >= kTransposeMinRows;
#if HWY_TARGET == HWY_AVX3
  const bool full_vectors = d_size % static_cast<int>(hn::Lanes(d)) == 0 && hn::Lanes(d) == 16;
  // The prefill (packed) bf16 dot-product paths.
  const bool bf16_dot =
      dot && packed && KV == DType::BF16 && p.query.dtype == DType::BF16 && d_size % kBf16PerVector == 0;
  if (bf16_dot) {
    LoadQueriesBf16(p, item, shape, reinterpret_cast<std::uint16_t*>(sc.q));
  } else {
    load_queries(p, item, shape, p.scale * k_scale, sc.q);
  }
#else
  static_cast<void>(dot);
  load_queries(p, item, shape, p.scale * k_scale, sc.q);
#endif

  const auto esize = static_cast<int>(dtype_size(KV));
  const std::size_t row_bytes = static_cast<std::size_t>(d_size) * dtype_size(KV);
  // Row pointers of the tile computed and of the next one, which is
  // prefetched meanwhile and computed in the next iteration.
  const unsigned char* tile_k[2][kTileKeys];
  const unsigned char* tile_v[2][kTileKeys];
  const unsigned char* far_k[kTileKeys];
  const unsigned char* far_v[kTileKeys];
  int cur = 0;
  if (lo < hi) tile_pointers(p, item, shape, lo, std::min(kTileKeys, hi - lo), tile_k[cur], tile_v[cur]);
  const bool packed_k = keys_packed(p);
  const unsigned char* unpacked_k[kTileKeys];
  for (int t0 = lo; t0 < hi; t0 += kTileKeys, cur ^= 1) {
    const int n = std::min(kTileKeys, hi - t0);
    const unsigned char* const* k_rows = tile_k[cur];  // [n] this tile's rows
    const unsigned char* const* v_rows = tile_v[cur];
    const int next = t0 + kTileKeys;
    const int next_n = next < hi ? std::min(kTileKeys, hi - next) : 0;
    if (next_n > 0) tile_pointers(p, item, shape, next, next_n, tile_k[cur ^ 1], tile_v[cur ^ 1]);
    prefetch_rows<kKeepInL1>(tile_k[cur ^ 1], next_n, row_bytes);
    prefetch_rows<kKeepInL1>(tile_v[cur ^ 1], next_n, row_bytes);
    const int far = t0 + kFarPrefetchTiles * kTileKeys;
    if (far < hi) {
      const int far_n = std::min(kTileKeys, hi - far);
      tile_pointers(p, item, shape, far, far_n, far_k, far_v);
      prefetch_rows<kKeepInL2>(far_k, far_n, row_bytes);
      prefetch_rows<kKeepInL2>(far_v, far_n, row_bytes);
    }
    if (packed_k) {
      unpack_key_rows<KV>(p, t0, n, k_rows, sc.ks, unpacked_k);
      k_rows = unpacked_k;
    }
#if HWY_TARGET == HWY_AVX3
    if (bf16_dot) {
      ScoresTransposedBf16(sc, shape.rows, d_size, n, k_rows, p.scale);
    } else if (packed) {
      scores_transposed<KV>(d, sc, shape.rows, d_size, n, k_rows);
    } else if (full_vectors) {
      ScoresRowwiseAvx3<KV>(sc, shape.rows, d_size, n, k_rows);
    } else {
      scores_rowwise<KV>(d, sc, shape.rows, d_size, n, k_rows);
    }
#else
    if (packed) {
      scores_transposed<KV>(d, sc, shape.rows, d_size, n, k_rows);
    } else {
      scores_rowwise<KV>(d, sc, shape.rows, d_size, n, k_rows);
    }
#endif
    softmax_tile(d, p, sc, shape.rows, t0, n);
    if (packed) {
#if HWY_TARGET == HWY_AVX3
      if (bf16_dot && d_size % (kPvVectors * kFloatsPerVector) == 0) {
        AccumulatePvBf16(sc, shape.rows, d_size, n, v_rows);
        continue;
      }
#endif
      for (int i = 0; i < n; ++i) {
        for (int c = 0; c < d_size; c += lanes) hn::Store(LoadKV<KV>(d, v_rows[i] + c * esize), d, sc.vf + i * d_size + c);
      }
      if (d_size % (kWidePvVectors * lanes) == 0) {
        accumulate_pv_wide(d, sc, shape.rows, d_size, n);
        continue;
      }
      accumulate_pv<KV>(d, sc, shape.rows, d_size, n, nullptr);
    } else {
      accumulate_pv<KV>(d, sc, shape.rows, d_size, n, v_rows);
    }
  }

  end_head(p, item, shape, sc, partials);
}

// An item of one or more KV heads: the chunked decode path walks the heads
// together; the other paths take them one after another.
template <DType KV, class D>
void RunItemHeads(D d, const AttentionParams& p, const WorkItem& item, const PartialState& partials,
                  void* scratch, bool dot) {
  const int rows = (item.q_end - item.q_begin) * (p.num_heads / p.num_kv_heads);
  const bool decode_dot = takes_decode_dot<KV>(p, rows, dot);
  if (decode_dot || takes_chunked_path<KV>(rows, p.head_size, static_cast<int>(hn::Lanes(d)))) {
    return RunChunkedDecode<KV>(d, p, item, partials, scratch, decode_dot);
  }
  for (int h = 0; h < item.kv_heads; ++h) RunItemTyped<KV>(d, p, head_of(item, h), partials, scratch, dot);
}

template <class D>
void RunItemForDescriptor(D d, const AttentionParams& p, const WorkItem& item, const PartialState& partials,
                          void* scratch, bool dot) {
  switch (p.kv_dtype) {
    case DType::F32:
      return RunItemHeads<DType::F32>(d, p, item, partials, scratch, dot);
    case DType::F16:
      return RunItemHeads<DType::F16>(d, p, item, partials, scratch, dot);
    case DType::BF16:
      return RunItemHeads<DType::BF16>(d, p, item, partials, scratch, dot);
    case DType::FP8_E4M3:
      return RunItemHeads<DType::FP8_E4M3>(d, p, item, partials, scratch, dot);
    case DType::FP8_E5M2:
      return RunItemHeads<DType::FP8_E5M2>(d, p, item, partials, scratch, dot);
    default:
      return;  // the backend admits no other KV dtype
  }
}

// Head sizes are multiples of 8: full vectors when the head size is a multiple
// of the lane count, else 8-lane vectors (every target has them).
template <bool kDot>
void RunItem(const AttentionParams& p, const WorkItem& item, const PartialState& partials, void* scratch) {
  const hn::ScalableTag<float> full;
  if (p.head_size % static_cast<int>(hn::Lanes(full)) == 0) {
    return RunItemForDescriptor(full, p, item, partials, scratch, kDot);
  }
  const hn::CappedTag<float, kMinHeadSizeMultiple> capped;
  return RunItemForDescriptor(capped, p, item, partials, scratch, kDot);
}

// Combines split partials in split order (deterministic), then finishes each row.
void RunMerge(const AttentionParams& p, const MergeItem& item, const PartialState& partials) {
  const int d_size = p.head_size;
  const int group = p.num_heads / p.num_kv_heads;
  const int q_tokens = item.q_end - item.q_begin;
  const int rows = q_tokens * group;
  const std::size_t row_floats = partial_row_floats(d_size);
  const std::size_t split_floats = static_cast<std::size_t>(q_tokens) * group * row_floats;
  float* first = partials.data + static_cast<std::size_t>(item.first_partial_token) * group * row_floats;
  const float v_scale = dequant_scale(p, p.v_scale, item.kv_head);
  const int first_token = p.query_start_loc[item.request];
  // The first split's accumulator row is rescaled in place; partials are scratch.
  for (int r = 0; r < rows; ++r) {
    float m = neg_inf();
    for (int s = 0; s < item.num_splits; ++s) m = std::max(m, first[s * split_floats + r * row_floats + d_size]);
    float* acc = first + r * row_floats;
    // Also when m is -inf: a split whose visible scores were all NaN has
    // m = -inf and a NaN sum, which makes l NaN (finish_row).
    float l = 0.0f;
    for (int s = 0; s < item.num_splits; ++s) {
      const float* part = first + s * split_floats + r * row_floats;
      const float w = part[d_size] == neg_inf() ? 0.0f : std::exp(part[d_size] - m);
      l += part[d_size + 1] * w;
      if (s == 0) {
        for (int e = 0; e < d_size; ++e) acc[e] *= w;
      } else {
        for (int e = 0; e < d_size; ++e) acc[e] += part[e] * w;
      }
    }
    const int token = first_token + item.q_begin + r / group;
    const int head = item.kv_head * group + r % group;
    finish_row(p, token, head, m, l, acc, v_scale);
  }
}

// `bf16_dot`: the table of Isa::Avx512Bf16 (only the AVX3 target has that path).
KernelTable GetKernelTable(bool bf16_dot) {
  return KernelTable{bf16_dot ? &RunItem<true> : &RunItem<false>, &RunMerge};
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace pagedattn::cpu_attn {

KernelTable kernel_table_for(Isa isa) {
  switch (isa) {
#if HWY_TARGETS & HWY_AVX3
    case Isa::Avx512Bf16:
      return N_AVX3::GetKernelTable(true);
    case Isa::Avx512:
      return N_AVX3::GetKernelTable(false);
#endif
#if HWY_TARGETS & HWY_AVX2
    case Isa::Avx2:
      return N_AVX2::GetKernelTable(false);
#endif
    default:
      return N_SCALAR::GetKernelTable(false);
  }
}

bool isa_compiled(Isa isa) {
  switch (isa) {
    case Isa::Avx512Bf16:
    case Isa::Avx512:
      return (HWY_TARGETS & HWY_AVX3) != 0;
    case Isa::Avx2:
      return (HWY_TARGETS & HWY_AVX2) != 0;
    case Isa::Scalar:
      return (HWY_TARGETS & HWY_SCALAR) != 0;
  }
  return false;
}

}  // namespace pagedattn::cpu_attn
#endif  // HWY_ONCE
