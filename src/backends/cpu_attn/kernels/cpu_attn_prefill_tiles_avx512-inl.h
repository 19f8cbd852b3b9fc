// AVX-512's tile-loop micro-kernels: the rowwise scores' joint reduction of
// four rows (store_row_sums for the full 16-lane vector), and the AVX512-BF16
// transposed scores and P V (Bf16Tiles). Highway per-target
// header; only the AVX3 pass compiles anything.
#if defined(PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX512_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX512_INL_H_
#undef PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX512_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX512_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_avx512-inl.h"
#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_AVX3

// The AVX512-BF16 kernels (Isa::Avx512Bf16, prefill tiles with bf16 queries
// and keys): scores with vdpbf16ps, which multiplies bf16 pairs exactly and
// accumulates in fp32 (equal to the fp32 path up to summation order), and P V
// with probabilities rounded to bf16. Compiled with the extra target flag and
// only chosen when the CPU has it (choose_kernel_variant).
#define PAGEDATTN_BF16_TARGET __attribute__((target("avx512bf16")))
static_assert(kBf16ScoresDimMultiple == kBf16PerVector, "the host's bf16 score rule");

// Sums of four vectors: lane r of the result is the sum of a[r].
HWY_INLINE __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// The rowwise scores' store of four rows' sums into column i of the score
// tile (rows r0 .. r0 + rb), with one joint reduction (reduce4): the overload
// of store_row_sums for the full 16-lane vector.
HWY_INLINE void store_row_sums(hn::Full512<float>, const Scratch& sc, int r0, int rb, int i,
                               const hn::Vec<hn::Full512<float>> (&acc)[kRowBlock]) {
  alignas(16) float v[kRowBlock];
  _mm_store_ps(v, reduce4(acc[0].raw, acc[1].raw, acc[2].raw, acc[3].raw));
  for (int r = 0; r < rb; ++r) sc.s[(r0 + r) * kTileKeys + i] = v[r];
}

// Transposed bf16 dot-product scores (prefills): the K tile is packed as bf16
// pairs [D / 2, kTileKeys] so one broadcast query pair meets 16 keys.
constexpr int kDotRowBlock = 8;    // 8 rows x 2 key vectors = 16 accumulators
constexpr int kDotKeyVectors = 2;  // key vectors per pass over the head dimension
constexpr int kDotPassKeys = kDotKeyVectors * kFloatsPerVector;
static_assert(kTileKeys % kDotPassKeys == 0, "score passes tile the key tile");
inline PAGEDATTN_BF16_TARGET void scores_transposed_bf16(const Scratch& sc, int rows, int d_size, int n,
                                                         const unsigned char* const* k_rows, float scale) {
  const int pairs = d_size / 2;
  auto* kt = reinterpret_cast<std::uint32_t*>(sc.kt);
  for (int i = 0; i < kTileKeys; ++i) {
    if (i < n) {
      const auto* row = reinterpret_cast<const std::uint32_t*>(k_rows[i]);
      for (int e = 0; e < pairs; ++e) kt[e * kTileKeys + i] = row[e];
    } else {
      for (int e = 0; e < pairs; ++e) kt[e * kTileKeys + i] = 0;
    }
  }
  const auto* q32 = reinterpret_cast<const std::uint32_t*>(sc.q);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int r0 = 0; r0 < rows; r0 += kDotRowBlock) {
    const int rb = std::min(kDotRowBlock, rows - r0);
    const std::uint32_t* q[kDotRowBlock];
    for (int r = 0; r < kDotRowBlock; ++r) q[r] = q32 + (r0 + (r < rb ? r : 0)) * pairs;
    for (int i0 = 0; i0 < kTileKeys; i0 += kDotPassKeys) {
      __m512 acc[kDotRowBlock][kDotKeyVectors];
      for (int r = 0; r < kDotRowBlock; ++r) {
        for (int v = 0; v < kDotKeyVectors; ++v) acc[r][v] = _mm512_setzero_ps();
      }
      for (int e = 0; e < pairs; ++e) {
        __m512bh k[kDotKeyVectors];
        for (int v = 0; v < kDotKeyVectors; ++v)
          k[v] = (__m512bh)_mm512_load_si512(kt + e * kTileKeys + i0 + v * kFloatsPerVector);
        for (int r = 0; r < kDotRowBlock; ++r) {
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][e]));
          for (int v = 0; v < kDotKeyVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qv, k[v]);
        }
      }
      for (int r = 0; r < rb; ++r) {
        float* out = sc.s + (r0 + r) * kTileKeys + i0;
        for (int v = 0; v < kDotKeyVectors; ++v)
          _mm512_store_ps(out + v * kFloatsPerVector, _mm512_mul_ps(acc[r][v], vscale));
      }
    }
  }
}

// P V with vdpbf16ps for a bf16 V tile (prefills): V is packed as bf16 pairs
// of consecutive keys [kTileKeys / 2, D] and each row's probabilities are
// rounded to bf16 pairs, as FlashAttention does; half the instructions of the
// fp32 loop. Rows in pairs x kPvVectors vectors (16 accumulators); d_size a
// multiple of kPvVectors * 16.
constexpr int kPvVectors = 8;
static_assert(kBf16PvDimMultiple == kPvVectors * kFloatsPerVector, "the host's bf16 P V rule");
// A row's probabilities as bf16 pairs overwrite the first half of its own row
// of the score tile: their size follows the rows, as the score tile's does
// (the [D, kTileKeys] K tile buffer holds only 2 D rows of them).
HWY_INLINE std::uint32_t* prob_pairs_row(const Scratch& sc, int r) {
  return reinterpret_cast<std::uint32_t*>(sc.s + static_cast<std::size_t>(r) * kTileKeys);
}
inline PAGEDATTN_BF16_TARGET void accumulate_pv_bf16(const Scratch& sc, int rows, int d_size, int n,
                                                     const unsigned char* const* v_rows) {
  // Pack: pair j holds keys 2j and 2j + 1 (a missing key reads as zero).
  auto* vp = reinterpret_cast<std::uint16_t*>(sc.vf);  // [kTileKeys / 2, D, 2]
  const __m512i lo_idx = key_pair_index();
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(kFloatsPerVector));
  const int pairs = (n + 1) / 2;
  for (int j = 0; j < pairs; ++j) {
    const unsigned char* a = v_rows[2 * j];
    const bool has_b = 2 * j + 1 < n;
    for (int c = 0; c < d_size; c += kBf16PerVector) {
      const __m512i va = _mm512_loadu_si512(a + c * sizeof(std::uint16_t));
      const __m512i vb =
          has_b ? _mm512_loadu_si512(v_rows[2 * j + 1] + c * sizeof(std::uint16_t)) : _mm512_setzero_si512();
      std::uint16_t* dst = vp + (static_cast<std::size_t>(j) * d_size + c) * 2;
      _mm512_store_si512(dst, _mm512_permutex2var_epi16(va, lo_idx, vb));
      _mm512_store_si512(dst + kBf16PerVector, _mm512_permutex2var_epi16(va, hi_idx, vb));
    }
  }
  // Probabilities as bf16 pairs, in place: each store lands on floats its
  // loads (this step's or an earlier one's) already read.
  for (int r = 0; r < rows; ++r) {
    const float* prob = sc.s + r * kTileKeys;
    std::uint32_t* pairs_row = prob_pairs_row(sc, r);
    for (int i = 0; i < kTileKeys; i += 2 * kFloatsPerVector) {
      const __m512bh packed =
          _mm512_cvtne2ps_pbh(_mm512_load_ps(prob + i + kFloatsPerVector), _mm512_load_ps(prob + i));
      _mm512_store_si512(pairs_row + i / 2, (__m512i)packed);
    }
  }
  for (int r0 = 0; r0 < rows; r0 += 2) {
    const int r1 = std::min(r0 + 1, rows - 1);  // an odd last row is computed twice, stored once
    float* a0 = sc.acc + r0 * d_size;
    float* a1 = sc.acc + r1 * d_size;
    const std::uint32_t* p0 = prob_pairs_row(sc, r0);
    const std::uint32_t* p1 = prob_pairs_row(sc, r1);
    const __m512 alpha0 = _mm512_set1_ps(sc.alpha[r0]);
    const __m512 alpha1 = _mm512_set1_ps(sc.alpha[r1]);
    for (int c0 = 0; c0 < d_size; c0 += kPvVectors * kFloatsPerVector) {
      __m512 acc0[kPvVectors];
      __m512 acc1[kPvVectors];
      for (int v = 0; v < kPvVectors; ++v) {
        acc0[v] = _mm512_mul_ps(_mm512_load_ps(a0 + c0 + v * kFloatsPerVector), alpha0);
        acc1[v] = _mm512_mul_ps(_mm512_load_ps(a1 + c0 + v * kFloatsPerVector), alpha1);
      }
      for (int j = 0; j < pairs; ++j) {
        const __m512bh b0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p0[j]));
        const __m512bh b1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(p1[j]));
        const std::uint16_t* vrow = vp + (static_cast<std::size_t>(j) * d_size + c0) * 2;
        for (int v = 0; v < kPvVectors; ++v) {
          const __m512bh x = (__m512bh)_mm512_load_si512(vrow + v * kBf16PerVector);
          acc0[v] = _mm512_dpbf16_ps(acc0[v], b0, x);
          acc1[v] = _mm512_dpbf16_ps(acc1[v], b1, x);
        }
      }
      for (int v = 0; v < kPvVectors; ++v) {
        _mm512_store_ps(a0 + c0 + v * kFloatsPerVector, acc0[v]);
        if (r1 != r0) _mm512_store_ps(a1 + c0 + v * kFloatsPerVector, acc1[v]);
      }
    }
  }
}

template <DType KV>
struct Bf16Tiles {
  static_assert(KV == DType::BF16, "the AVX512-BF16 tile-loop kernels read bf16 K/V");
  static void scores(const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* k_rows,
                     float scale) {
    scores_transposed_bf16(sc, rows, d_size, n, k_rows, scale);
  }
  static void pv(const Scratch& sc, int rows, int d_size, int n, const unsigned char* const* v_rows) {
    accumulate_pv_bf16(sc, rows, d_size, n, v_rows);
  }
};
#endif  // HWY_TARGET == HWY_AVX3

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX512_INL_H_
