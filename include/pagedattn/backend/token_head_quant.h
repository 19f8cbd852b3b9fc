// Per-token-head KV quantization (vLLM's int8_per_token_head and
// fp8_per_token_head, its _reshape_cache_per_token_head kernel): each
// (token, KV head) row of K, and of V, is stored as q = x / scale with its
// own f32 scale = amax|x| / qmax, and read back as x̂ = q * scale. The cache
// writers (the CPU and CUDA reshape_and_cache) apply the rule from here, so
// both store the same bits; docs/semantics.md states it.
//
// Header-only and free of other pagedattn headers but scalar.h, so kernels
// may include it.
#pragma once

#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn {

// Smallest scale (vLLM's 1e-6): an all-zero row stores zeros with it.
inline constexpr float kTokenHeadMinScale = 1e-6f;

namespace detail {

// IEEE single-precision products and quotients, never contracted into an
// FMA, so the host and the device round alike.
PAGEDATTN_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

PAGEDATTN_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

}  // namespace detail

// The magnitude a row's amax is stored as: 127 for int8 (vLLM's range is
// [-128, 127]), 448 for fp8 e4m3.
PAGEDATTN_HD constexpr float token_head_quant_max(DType storage) {
  return storage == DType::I8 ? kInt8Max : kFp8E4M3Max;
}

// max(amax, |x|), NaN once any x was NaN.
PAGEDATTN_HD float token_head_amax(float amax, float x) {
  const float a = detail::bits_float(detail::float_bits(x) & 0x7FFFFFFFu);
  return (a > amax || a != a) ? a : amax;
}

// The scale of a row with largest magnitude `amax`: amax / qmax, at least
// kTokenHeadMinScale. A NaN amax gives a NaN scale (the row reads back NaN);
// an infinite one an infinite scale (its finite elements store 0, and every
// element reads back NaN or inf).
PAGEDATTN_HD float token_head_scale(float amax, DType storage) {
  const float s = detail::div_rn(amax, token_head_quant_max(storage));
  return s < kTokenHeadMinScale ? kTokenHeadMinScale : s;
}

// What a row's elements are multiplied by before rounding (vLLM multiplies
// by the reciprocal rather than dividing by the scale).
PAGEDATTN_HD float token_head_inv_scale(float scale) { return detail::div_rn(1.0f, scale); }

// Stores x of a row whose inverse scale is inv_scale: int8 rounds to nearest even and clamps to [-128, 127]
// (NaN stores 0), e4m3 rounds to nearest even and saturates at ±448 (NaN stays NaN).
PAGEDATTN_HD void store_token_head(void* dst, DType storage, float x, float inv_scale) {
  const float q = detail::mul_rn(x, inv_scale);
  if (storage == DType::I8) {
    *static_cast<std::int8_t*>(dst) = float_to_i8(q);
  } else {
    *static_cast<std::uint8_t*>(dst) = float_to_fp8_e4m3(q);
  }
}

}  // namespace pagedattn
