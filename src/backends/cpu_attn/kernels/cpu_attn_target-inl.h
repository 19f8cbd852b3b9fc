// What differs between the compiled targets, in one place: the target's
// shape (TargetShape, cpu_attn_dispatch.h: the same table the host chooses
// variants from) and the lane sums of four vectors. Highway per-target header.
#if defined(PAGEDATTN_CPU_ATTN_TARGET_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef PAGEDATTN_CPU_ATTN_TARGET_INL_H_
#undef PAGEDATTN_CPU_ATTN_TARGET_INL_H_
#else
#define PAGEDATTN_CPU_ATTN_TARGET_INL_H_
#endif

#include <hwy/highway.h>

#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"

HWY_BEFORE_NAMESPACE();
namespace pagedattn::cpu_attn::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3
inline constexpr TargetShape kTarget = kAvx512Shape;
#elif HWY_TARGET == HWY_AVX2
inline constexpr TargetShape kTarget = kAvx2Shape;
#else
inline constexpr TargetShape kTarget = kScalarShape;
#endif

#if HWY_TARGET == HWY_AVX2
// Lane k of the result is the sum of a_k's lanes: three hadds and one add
// instead of four separate reductions.
HWY_INLINE __m128 sum_lanes4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Stores the lane sums of four vectors at out[0], out[stride], ... (the first
// `count`), reduced together (sum_lanes4).
template <class D>
HWY_INLINE void store_sums4(D, const hn::Vec<D> (&v)[4], float* out, int stride, int count) {
  alignas(16) float sums[4];
  _mm_store_ps(sums, sum_lanes4(v[0].raw, v[1].raw, v[2].raw, v[3].raw));
  for (int j = 0; j < count; ++j) out[j * stride] = sums[j];
}
#else
// Stores the lane sums of four vectors at out[0], out[stride], ... (the first `count`).
template <class D>
HWY_INLINE void store_sums4(D d, const hn::Vec<D> (&v)[4], float* out, int stride, int count) {
  for (int j = 0; j < count; ++j) out[j * stride] = hn::GetLane(hn::SumOfLanes(d, v[j]));
}
#endif

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::cpu_attn::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // PAGEDATTN_CPU_ATTN_TARGET_INL_H_
