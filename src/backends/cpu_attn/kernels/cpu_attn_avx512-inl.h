// AVX-512 constants and helpers that the AVX512-BF16 tile-loop kernels
// (cpu_attn_prefill_tiles_avx512-inl.h) and decode tiles
// (cpu_attn_decode_tiles_avx512-inl.h) share. Highway per-target header; only
// the AVX3 pass compiles anything.
#if defined(PAGEDATTN_CPU_ATTN_AVX512_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_AVX512_INL_H_
#undef PAGEDATTN_CPU_ATTN_AVX512_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_AVX512_INL_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
#if HWY_TARGET == HWY_AVX3

// Bf16 elements and floats per 512-bit vector.
constexpr int kBf16PerVector = 32;
constexpr int kFloatsPerVector = 16;

// vpermt2w indices that interleave words 0-15 of two vectors a, b into
// (a[i], b[i]) pairs; plus 16, words 16-31.
HWY_INLINE __m512i key_pair_index() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                          36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
}

#endif  // HWY_TARGET == HWY_AVX3

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_AVX512_INL_H_
