// AVX2's tile-loop micro-kernel: the K tile converted and transposed in 8 x 8
// blocks of registers (transpose_k_tile for the full 8-lane vector).
// Highway per-target header; only the AVX2 pass compiles anything.
#if defined(PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX2_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX2_INL_H_
#undef PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX2_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX2_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_common-inl.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_AVX2

// Transposes eight rows of eight floats: out[e] lane j = in[j] lane e.
HWY_INLINE void transpose8x8(const __m256 (&in)[8], __m256 (&out)[8]) {
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
// blocks (the element-by-element scatter cost a store per element, about a
// fifth of an AVX2 prefill tile; docs/cpu_attn.md). Keys past n repeat key
// n - 1: the softmax masks their columns.
template <DType KV>
void transpose_k_tile(hn::Full256<float> d, const Scratch& sc, int d_size, int n,
                      const unsigned char* const* k_rows) {
  constexpr int kBlock = 8;
  const auto esize = static_cast<int>(dtype_size(KV));
  for (int i0 = 0; i0 < kTileKeys; i0 += kBlock) {
    const unsigned char* k[kBlock];
    for (int j = 0; j < kBlock; ++j) k[j] = k_rows[std::min(i0 + j, n - 1)];
    for (int e0 = 0; e0 < d_size; e0 += kBlock) {
      __m256 in[kBlock];
      for (int j = 0; j < kBlock; ++j) in[j] = load_kv<KV>(d, k[j] + e0 * esize).raw;
      __m256 out[kBlock];
      transpose8x8(in, out);
      for (int e = 0; e < kBlock; ++e) _mm256_store_ps(sc.kt + (e0 + e) * kTileKeys + i0, out[e]);
    }
  }
}
#endif  // HWY_TARGET == HWY_AVX2

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_PREFILL_TILES_AVX2_INL_H_
