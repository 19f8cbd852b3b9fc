// Scalar element types and exact conversions between them and float.
//
// Dependency-free on purpose: kernels (CPU and CUDA) include this header, and
// kernels may not include core headers (docs/architecture.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PAGEDATTN_HD __host__ __device__ __forceinline__
#else
#define PAGEDATTN_HD inline
#endif

namespace pagedattn {

// Element types of tensors. The numeric values are part of the kernel ABI
// (kernels receive them in POD params structs); append only.
enum class DType : std::uint8_t {
  F32 = 0,
  F16 = 1,
  BF16 = 2,
  FP8_E4M3 = 3,  // OCP e4m3fn: no infinities, max finite 448, NaN = S.1111.111
  FP8_E5M2 = 4,  // OCP e5m2: IEEE-like, max finite 57344
  I32 = 5,
  I64 = 6,
  U8 = 7,
  I8 = 8,  // signed bytes (int8 per-token-head KV caches)
};

PAGEDATTN_HD constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I64:
      return 8;
    case DType::FP8_E4M3:
    case DType::FP8_E5M2:
    case DType::U8:
    case DType::I8:
      return 1;
  }
  return 0;
}

PAGEDATTN_HD constexpr bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::FP8_E4M3 ||
         t == DType::FP8_E5M2;
}

PAGEDATTN_HD constexpr bool is_fp8(DType t) {
  return t == DType::FP8_E4M3 || t == DType::FP8_E5M2;
}

// Largest finite magnitudes of the fp8 formats; stores saturate to these.
inline constexpr float kFp8E4M3Max = 448.0f;
inline constexpr float kFp8E5M2Max = 57344.0f;

namespace detail {

PAGEDATTN_HD std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

PAGEDATTN_HD float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds a finite float to a narrower binary format with `man_bits` explicit
// mantissa bits and exponent bias `bias`, round-to-nearest-even, and returns
// the encoding without the sign (exponent and mantissa fields). Values beyond
// the largest finite encoding `max_code` saturate to it. Handles subnormals of
// the target format. `a` must be finite and non-negative.
PAGEDATTN_HD std::uint32_t round_to_narrow(float a, int man_bits, int bias, std::uint32_t max_code) {
  const std::uint32_t u = float_bits(a);
  const int exp = static_cast<int>((u >> 23) & 0xFFu);  // biased float exponent
  if (exp == 0) {
    // Float zero or subnormal (< 2^-126): far below every narrow format's
    // smallest subnormal, so it rounds to zero.
    return 0;
  }
  const int e = exp - 127;                        // unbiased exponent
  std::uint32_t mant = (u & 0x7FFFFFu) | 0x800000u;  // 24-bit significand with implicit 1
  const int min_normal_e = 1 - bias;
  int shift = 23 - man_bits;  // bits dropped for a normal result
  int target_e = e;
  if (e < min_normal_e) {
    shift += min_normal_e - e;  // subnormal in the target: drop more bits
    target_e = min_normal_e - 1;
  }
  if (shift > 24) return 0;
  const std::uint32_t keep = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  std::uint32_t rounded = keep;
  if (rem > half || (rem == half && (keep & 1u))) rounded += 1;
  // Assemble: for a normal result `rounded` has the implicit bit at man_bits;
  // adding the biased exponent via addition lets a mantissa carry bump it.
  std::uint32_t code;
  if (target_e < min_normal_e) {
    code = rounded;  // subnormal encoding (exponent field 0); a carry makes it the min normal
  } else {
    code = (static_cast<std::uint32_t>(target_e + bias) << man_bits) + (rounded - (1u << man_bits));
  }
  return code > max_code ? max_code : code;
}

PAGEDATTN_HD float narrow_to_float(std::uint32_t code, int exp_bits, int man_bits, int bias) {
  const std::uint32_t man = code & ((1u << man_bits) - 1u);
  const std::uint32_t ex = (code >> man_bits) & ((1u << exp_bits) - 1u);
  if (ex == 0) {
    // Subnormal: man * 2^(1-bias-man_bits), exact in float.
    const float scale = bits_float(static_cast<std::uint32_t>(127 + 1 - bias - man_bits) << 23);
    return static_cast<float>(man) * scale;
  }
  return bits_float(((ex - bias + 127) << 23) | (man << (23 - man_bits)));
}

}  // namespace detail

// ---- IEEE half ----------------------------------------------------------
PAGEDATTN_HD std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const float a = detail::bits_float(u & 0x7FFFFFFFu);
  if (a != a) return static_cast<std::uint16_t>(sign | 0x7E00u);  // quiet NaN
  if (a >= 65520.0f) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds to inf
  return static_cast<std::uint16_t>(sign | detail::round_to_narrow(a, 10, 15, 0x7BFFu));
}

PAGEDATTN_HD float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t code = h & 0x7FFFu;
  if ((code & 0x7C00u) == 0x7C00u) {
    return detail::bits_float(sign | 0x7F800000u | ((code & 0x3FFu) << 13));  // inf / NaN
  }
  const float a = detail::narrow_to_float(code, 5, 10, 15);
  return detail::bits_float(detail::float_bits(a) | sign);
}

// ---- bfloat16 -----------------------------------------------------------
PAGEDATTN_HD std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = detail::float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  const std::uint32_t rounding = 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

PAGEDATTN_HD float bf16_bits_to_float(std::uint16_t b) {
  return detail::bits_float(static_cast<std::uint32_t>(b) << 16);
}

// ---- fp8 (saturating stores, as vLLM's SATFINITE conversions) -------------
PAGEDATTN_HD std::uint8_t float_to_fp8_e4m3(float f) {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const float a = detail::bits_float(u & 0x7FFFFFFFu);
  if (a != a) return static_cast<std::uint8_t>(sign | 0x7Fu);
  if (a >= kFp8E4M3Max) return static_cast<std::uint8_t>(sign | 0x7Eu);  // also saturates inf
  return static_cast<std::uint8_t>(sign | detail::round_to_narrow(a, 3, 7, 0x7Eu));
}

PAGEDATTN_HD float fp8_e4m3_to_float(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  if ((b & 0x7Fu) == 0x7Fu) return detail::bits_float(sign | 0x7FC00000u);
  const float a = detail::narrow_to_float(b & 0x7Fu, 4, 3, 7);
  return detail::bits_float(detail::float_bits(a) | sign);
}

// A query element as an impl that quantizes its queries (quantizes_query_for)
// sees it, back in the query's units: e4m3(q / q_scale) * q_scale. The
// oracles of such impls read their queries through this.
PAGEDATTN_HD float fp8_query_round_trip(float q, float q_scale) {
  return fp8_e4m3_to_float(float_to_fp8_e4m3(q / q_scale)) * q_scale;
}

PAGEDATTN_HD std::uint8_t float_to_fp8_e5m2(float f) {
  const std::uint32_t u = detail::float_bits(f);
  const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
  const float a = detail::bits_float(u & 0x7FFFFFFFu);
  if (a != a) return static_cast<std::uint8_t>(sign | 0x7Fu);
  if (a >= kFp8E5M2Max) return static_cast<std::uint8_t>(sign | 0x7Bu);  // also saturates inf
  return static_cast<std::uint8_t>(sign | detail::round_to_narrow(a, 2, 15, 0x7Bu));
}

// ---- int8 (saturating stores, round to nearest even; NaN stores 0) ---------
inline constexpr float kInt8Max = 127.0f;
inline constexpr float kInt8Min = -128.0f;

PAGEDATTN_HD std::int8_t float_to_i8(float f) {
  if (f != f) return 0;
  const float c = f < kInt8Min ? kInt8Min : (f > kInt8Max ? kInt8Max : f);
  // Adding and subtracting 1.5 * 2^23 rounds |c| <= 2^22 to an integer, to
  // nearest even, in IEEE float arithmetic alone (host and device alike;
  // the build never allows reassociation).
  constexpr float kRoundMagic = 12582912.0f;
  return static_cast<std::int8_t>((c + kRoundMagic) - kRoundMagic);
}

PAGEDATTN_HD float fp8_e5m2_to_float(std::uint8_t b) {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t code = b & 0x7Fu;
  if ((code & 0x7Cu) == 0x7Cu) {
    return detail::bits_float(sign | 0x7F800000u | ((code & 0x3u) << 21));  // inf / NaN
  }
  const float a = detail::narrow_to_float(code, 5, 2, 15);
  return detail::bits_float(detail::float_bits(a) | sign);
}

// ---- generic element access (scalar paths: reference kernels, tests) ------
PAGEDATTN_HD float load_as_float(const void* p, DType t) {
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p, sizeof f);
      return f;
    }
    case DType::F16: {
      std::uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return f16_bits_to_float(h);
    }
    case DType::BF16: {
      std::uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return bf16_bits_to_float(h);
    }
    case DType::FP8_E4M3:
      return fp8_e4m3_to_float(*static_cast<const std::uint8_t*>(p));
    case DType::FP8_E5M2:
      return fp8_e5m2_to_float(*static_cast<const std::uint8_t*>(p));
    case DType::I32: {
      std::int32_t i;
      std::memcpy(&i, p, sizeof i);
      return static_cast<float>(i);
    }
    case DType::I64: {
      std::int64_t i;
      std::memcpy(&i, p, sizeof i);
      return static_cast<float>(i);
    }
    case DType::U8:
      return static_cast<float>(*static_cast<const std::uint8_t*>(p));
    case DType::I8:
      return static_cast<float>(*static_cast<const std::int8_t*>(p));
  }
  return 0.0f;
}

PAGEDATTN_HD void store_from_float(void* p, DType t, float f) {
  switch (t) {
    case DType::F32:
      std::memcpy(p, &f, sizeof f);
      return;
    case DType::F16: {
      const std::uint16_t h = float_to_f16_bits(f);
      std::memcpy(p, &h, sizeof h);
      return;
    }
    case DType::BF16: {
      const std::uint16_t h = float_to_bf16_bits(f);
      std::memcpy(p, &h, sizeof h);
      return;
    }
    case DType::FP8_E4M3:
      *static_cast<std::uint8_t*>(p) = float_to_fp8_e4m3(f);
      return;
    case DType::FP8_E5M2:
      *static_cast<std::uint8_t*>(p) = float_to_fp8_e5m2(f);
      return;
    case DType::I32: {
      const auto i = static_cast<std::int32_t>(f);
      std::memcpy(p, &i, sizeof i);
      return;
    }
    case DType::I64: {
      const auto i = static_cast<std::int64_t>(f);
      std::memcpy(p, &i, sizeof i);
      return;
    }
    case DType::U8:
      *static_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(f);
      return;
    case DType::I8:
      *static_cast<std::int8_t*>(p) = float_to_i8(f);
      return;
  }
}

}  // namespace pagedattn
