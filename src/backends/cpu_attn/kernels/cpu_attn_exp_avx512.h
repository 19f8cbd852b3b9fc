// exp on AVX-512 float vectors for the decode softmax (cpu_attn_decode_tiles_avx512-inl.h),
// in 13 instructions where Highway's Exp takes about 24 (docs/cpu_attn.md).
// Intrinsics only, with its own target attribute, so the kernel's AVX-512 pass
// and the accuracy test (cpu_attn_exp_test.cpp) call the same code.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include <iterator>

namespace pagedattn::cpu_attn {

// Below this exp(x) is 0, as in Highway's Exp (float results there are
// subnormal or zero).
inline constexpr float kExpLowerBound = -104.0f;
inline constexpr float kLog2E = 1.44269504088896341f;
// ln 2 in two parts (Highway's): kLn2Hi has few mantissa bits, so n * kLn2Hi is exact.
inline constexpr float kLn2Hi = 0.693145751953125f;
inline constexpr float kLn2Lo = 1.428606765330187045e-6f;
// e^r on |r| <= ln(2) / 2: Highway's polynomial 1 + r + r^2 (0.5 + r (1/6 + ...)),
// highest coefficient first, in Horner form.
inline constexpr float kExpPoly[] = {0.000198527617612853646278381f,
                                     0.00139304355252534151077271f,
                                     0.00833336077630519866943359f,
                                     0.0416664853692054748535156f,
                                     0.166666671633720397949219f,
                                     0.5f,
                                     1.0f,
                                     1.0f};

// exp(x) per lane, within 1 ulp for normal results: n = round(x / ln 2),
// r = x - n ln 2, e^r by the polynomial, 2^n applied by vscalefps. Lanes below
// kExpLowerBound, -inf and NaN give 0 (the softmax's masked keys; a NaN score
// is handled by its caller).
__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLowerBound), _CMP_GE_OQ);
  // The all-lanes masked form: GCC 12's plain _mm512_roundscale_ps passes an
  // undefined vector that -Wuninitialized rejects; the instruction is the same.
  constexpr __mmask16 kAllLanes = 0xFFFF;
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(kLog2E));
  const __m512 n = _mm512_mask_roundscale_ps(t, kAllLanes, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 poly = _mm512_set1_ps(kExpPoly[0]);
  for (auto c = std::begin(kExpPoly) + 1; c != std::end(kExpPoly); ++c)
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(*c));
  return _mm512_maskz_scalef_ps(in_range, poly, n);
}

}  // namespace pagedattn::cpu_attn
#endif
