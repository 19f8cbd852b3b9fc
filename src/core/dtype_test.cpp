// Names and parsing of dtypes/devices, and the exact scalar conversions of
// scalar.h: exhaustive round trips, ties-to-even, saturation, subnormals, NaN.
#include <gtest/gtest.h>
#include <pagedattn/dtype.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>

namespace pagedattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr std::uint32_t kNumF16Codes = 1u << 16;
constexpr std::uint32_t kNumFp8Codes = 1u << 8;

// A narrow format under test: its decoder, encoder and code-space facts.
struct Format {
  std::string name;
  std::function<float(std::uint32_t)> decode;
  std::function<std::uint32_t(float)> encode;
  std::uint32_t num_codes;
  std::uint32_t sign_bit;
  std::uint32_t max_finite_code;  // largest positive finite code
  std::function<bool(std::uint32_t)> is_nan_code;
  std::function<bool(std::uint32_t)> is_inf_code;
};

Format f16_format() {
  return {"f16",
          [](std::uint32_t c) { return f16_bits_to_float(static_cast<std::uint16_t>(c)); },
          [](float f) { return std::uint32_t{float_to_f16_bits(f)}; },
          kNumF16Codes,
          0x8000u,
          0x7BFFu,
          [](std::uint32_t c) { return (c & 0x7C00u) == 0x7C00u && (c & 0x3FFu) != 0; },
          [](std::uint32_t c) { return (c & 0x7FFFu) == 0x7C00u; }};
}

Format bf16_format() {
  return {"bf16",
          [](std::uint32_t c) { return bf16_bits_to_float(static_cast<std::uint16_t>(c)); },
          [](float f) { return std::uint32_t{float_to_bf16_bits(f)}; },
          kNumF16Codes,
          0x8000u,
          0x7F7Fu,
          [](std::uint32_t c) { return (c & 0x7F80u) == 0x7F80u && (c & 0x7Fu) != 0; },
          [](std::uint32_t c) { return (c & 0x7FFFu) == 0x7F80u; }};
}

Format e4m3_format() {
  return {"fp8_e4m3",
          [](std::uint32_t c) { return fp8_e4m3_to_float(static_cast<std::uint8_t>(c)); },
          [](float f) { return std::uint32_t{float_to_fp8_e4m3(f)}; },
          kNumFp8Codes,
          0x80u,
          0x7Eu,
          [](std::uint32_t c) { return (c & 0x7Fu) == 0x7Fu; },
          [](std::uint32_t) { return false; }};
}

Format e5m2_format() {
  return {"fp8_e5m2",
          [](std::uint32_t c) { return fp8_e5m2_to_float(static_cast<std::uint8_t>(c)); },
          [](float f) { return std::uint32_t{float_to_fp8_e5m2(f)}; },
          kNumFp8Codes,
          0x80u,
          0x7Bu,
          [](std::uint32_t c) { return (c & 0x7Cu) == 0x7Cu && (c & 0x3u) != 0; },
          [](std::uint32_t c) { return (c & 0x7Fu) == 0x7Cu; }};
}

// gtest prints parameters; the name is enough.
void PrintTo(const Format& f, std::ostream* os) { *os << f.name; }

class ScalarFormatTest : public ::testing::TestWithParam<Format> {};

// decode -> encode gives back every finite code (and the infinities, where the
// format saturates nothing on the way back: f16/bf16).
TEST_P(ScalarFormatTest, ExhaustiveRoundTrip) {
  const Format& f = GetParam();
  for (std::uint32_t c = 0; c < f.num_codes; ++c) {
    if (f.is_nan_code(c)) continue;
    const float x = f.decode(c);
    if (f.is_inf_code(c)) {
      ASSERT_TRUE(std::isinf(x)) << f.name << " code " << c;
      continue;
    }
    ASSERT_EQ(f.encode(x), c) << f.name << " code " << c << " value " << x;
  }
}

TEST_P(ScalarFormatTest, DecodeIsMonotonic) {
  const Format& f = GetParam();
  for (std::uint32_t c = 0; c < f.max_finite_code; ++c) {
    ASSERT_LT(f.decode(c), f.decode(c + 1)) << f.name << " code " << c;
    ASSERT_GT(f.decode(c | f.sign_bit), f.decode((c + 1) | f.sign_bit)) << f.name << " code " << c;
  }
}

// The exact midpoint between neighbours rounds to the even code; one float ulp
// either side of it rounds to the nearer neighbour. Covers subnormals, the
// subnormal/normal boundary and every binade, for both signs.
TEST_P(ScalarFormatTest, RoundsToNearestEvenAtTies) {
  const Format& f = GetParam();
  for (std::uint32_t c = 0; c < f.max_finite_code; ++c) {
    const float lo = f.decode(c);
    const float hi = f.decode(c + 1);
    const float mid = lo + (hi - lo) / 2;  // exact: the formats are much narrower than float
    ASSERT_GT(mid, lo);
    ASSERT_LT(mid, hi);
    const std::uint32_t even = (c % 2 == 0) ? c : c + 1;
    ASSERT_EQ(f.encode(mid), even) << f.name << " midpoint of codes " << c << ", " << c + 1;
    ASSERT_EQ(f.encode(-mid), even | f.sign_bit) << f.name << " -midpoint of codes " << c << ", " << c + 1;
    ASSERT_EQ(f.encode(std::nextafter(mid, 0.0f)), c) << f.name << " below midpoint " << c;
    ASSERT_EQ(f.encode(std::nextafter(mid, kInf)), c + 1) << f.name << " above midpoint " << c;
  }
}

TEST_P(ScalarFormatTest, NaNIsPreserved) {
  const Format& f = GetParam();
  EXPECT_TRUE(f.is_nan_code(f.encode(kNaN))) << f.name;
  const std::uint32_t neg = f.encode(-kNaN);
  EXPECT_TRUE(f.is_nan_code(neg)) << f.name;
  EXPECT_EQ(neg & f.sign_bit, f.sign_bit) << f.name << ": the sign of a NaN is kept";
  for (std::uint32_t c = 0; c < f.num_codes; ++c) {
    if (f.is_nan_code(c)) {
      ASSERT_TRUE(std::isnan(f.decode(c))) << f.name << " code " << c;
    }
  }
}

TEST_P(ScalarFormatTest, SignedZeros) {
  const Format& f = GetParam();
  EXPECT_EQ(f.encode(0.0f), 0u);
  EXPECT_EQ(f.encode(-0.0f), f.sign_bit);
  EXPECT_TRUE(std::signbit(f.decode(f.sign_bit)));
  // Far below every format's smallest subnormal: rounds to a zero of the same sign.
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(f.encode(tiny), 0u);
  EXPECT_EQ(f.encode(-tiny), f.sign_bit);
}

INSTANTIATE_TEST_SUITE_P(Scalar, ScalarFormatTest,
                         ::testing::Values(f16_format(), bf16_format(), e4m3_format(), e5m2_format()),
                         [](const ::testing::TestParamInfo<Format>& info) { return info.param.name; });

TEST(ScalarSaturation, Fp8E4M3SaturatesToMaxFinite) {
  EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7Eu);
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), kFp8E4M3Max);
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xFEu);
  EXPECT_EQ(float_to_fp8_e4m3(kInf), 0x7Eu);
  EXPECT_EQ(float_to_fp8_e4m3(-kInf), 0xFEu);
  EXPECT_EQ(fp8_e4m3_to_float(float_to_fp8_e4m3(-kInf)), -448.0f);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7Eu);  // would round to 480 without saturation
  EXPECT_EQ(float_to_fp8_e4m3(500.0f), 0x7Eu);
}

TEST(ScalarSaturation, Fp8E5M2SaturatesToMaxFinite) {
  EXPECT_EQ(float_to_fp8_e5m2(1e9f), 0x7Bu);
  EXPECT_EQ(fp8_e5m2_to_float(0x7B), kFp8E5M2Max);
  EXPECT_EQ(float_to_fp8_e5m2(-1e9f), 0xFBu);
  EXPECT_EQ(float_to_fp8_e5m2(kInf), 0x7Bu);
  EXPECT_EQ(float_to_fp8_e5m2(-kInf), 0xFBu);
  EXPECT_EQ(float_to_fp8_e5m2(61440.0f), 0x7Bu);  // midpoint to the next (inf) step
  EXPECT_TRUE(std::isinf(fp8_e5m2_to_float(0x7C)));
}

TEST(ScalarSaturation, Int8RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(float_to_i8(2.5f), 2);
  EXPECT_EQ(float_to_i8(3.5f), 4);
  EXPECT_EQ(float_to_i8(-2.5f), -2);
  EXPECT_EQ(float_to_i8(2.4999998f), 2);
  EXPECT_EQ(float_to_i8(126.5f), 126);
  EXPECT_EQ(float_to_i8(127.5f), 127);
  EXPECT_EQ(float_to_i8(1e9f), 127);
  EXPECT_EQ(float_to_i8(-128.5f), -128);
  EXPECT_EQ(float_to_i8(-kInf), -128);
  EXPECT_EQ(float_to_i8(std::numeric_limits<float>::quiet_NaN()), 0);
  EXPECT_EQ(dtype_size(DType::I8), 1u);
  EXPECT_FALSE(is_floating(DType::I8));
  std::int8_t b = 0;
  store_from_float(&b, DType::I8, -7.0f);
  EXPECT_EQ(load_as_float(&b, DType::I8), -7.0f);
}

TEST(ScalarSaturation, F16AndBF16OverflowToInfinity) {
  EXPECT_EQ(float_to_f16_bits(kInf), 0x7C00u);
  EXPECT_EQ(float_to_f16_bits(-kInf), 0xFC00u);
  EXPECT_EQ(float_to_f16_bits(1e9f), 0x7C00u);
  EXPECT_EQ(float_to_f16_bits(65519.0f), 0x7BFFu);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7C00u);  // tie between 65504 (odd) and 65536 (even = inf)
  EXPECT_EQ(f16_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float_to_bf16_bits(kInf), 0x7F80u);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80u);
}

TEST(ScalarSubnormals, F16) {
  const float min_sub = std::ldexp(1.0f, -24);
  EXPECT_EQ(f16_bits_to_float(0x0001), min_sub);
  EXPECT_EQ(f16_bits_to_float(0x03FF), 1023 * min_sub);
  EXPECT_EQ(f16_bits_to_float(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(float_to_f16_bits(min_sub), 0x0001u);
  EXPECT_EQ(float_to_f16_bits(min_sub / 2), 0x0000u);  // tie to even (zero)
  EXPECT_EQ(float_to_f16_bits(std::nextafter(min_sub / 2, 1.0f)), 0x0001u);
  EXPECT_EQ(float_to_f16_bits(1.5f * min_sub), 0x0002u);     // tie to even (2)
  EXPECT_EQ(float_to_f16_bits(1023.5f * min_sub), 0x0400u);  // carries into the min normal
}

TEST(ScalarSubnormals, BF16) {
  const float min_sub = std::ldexp(1.0f, -133);
  EXPECT_EQ(bf16_bits_to_float(0x0001), min_sub);
  EXPECT_EQ(float_to_bf16_bits(min_sub), 0x0001u);
  EXPECT_EQ(float_to_bf16_bits(min_sub / 2), 0x0000u);
  EXPECT_EQ(float_to_bf16_bits(1.5f * min_sub), 0x0002u);
  EXPECT_EQ(bf16_bits_to_float(0x0080), std::numeric_limits<float>::min());
}

TEST(ScalarSubnormals, Fp8E4M3) {
  const float min_sub = std::ldexp(1.0f, -9);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), min_sub);
  EXPECT_EQ(fp8_e4m3_to_float(0x07), 7 * min_sub);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(float_to_fp8_e4m3(min_sub / 2), 0x00u);
  EXPECT_EQ(float_to_fp8_e4m3(std::nextafter(min_sub / 2, 1.0f)), 0x01u);
  EXPECT_EQ(float_to_fp8_e4m3(7.5f * min_sub), 0x08u);
  EXPECT_EQ(float_to_fp8_e4m3(-3 * min_sub), 0x83u);
}

TEST(ScalarSubnormals, Fp8E5M2) {
  const float min_sub = std::ldexp(1.0f, -16);
  EXPECT_EQ(fp8_e5m2_to_float(0x01), min_sub);
  EXPECT_EQ(fp8_e5m2_to_float(0x03), 3 * min_sub);
  EXPECT_EQ(fp8_e5m2_to_float(0x04), std::ldexp(1.0f, -14));
  EXPECT_EQ(float_to_fp8_e5m2(min_sub / 2), 0x00u);
  EXPECT_EQ(float_to_fp8_e5m2(3.5f * min_sub), 0x04u);
  EXPECT_EQ(float_to_fp8_e5m2(-2 * min_sub), 0x82u);
}

TEST(ScalarGeneric, LoadStoreEveryDType) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::FP8_E4M3, DType::FP8_E5M2, DType::I32,
                  DType::I64, DType::U8, DType::I8}) {
    std::uint64_t storage = 0;
    store_from_float(&storage, t, 3.0f);
    EXPECT_EQ(load_as_float(&storage, t), 3.0f) << dtype_name(t);
  }
  std::uint16_t h = 0;
  store_from_float(&h, DType::BF16, 1.0f + std::ldexp(1.0f, -8));  // tie: rounds to even (1.0)
  EXPECT_EQ(h, 0x3F80u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::FP8_E5M2), 1u);
  EXPECT_TRUE(is_fp8(DType::FP8_E4M3));
  EXPECT_FALSE(is_floating(DType::U8));
}

TEST(DtypeNames, CanonicalNamesRoundTrip) {
  for (DType t : {DType::F32, DType::F16, DType::BF16, DType::FP8_E4M3, DType::FP8_E5M2, DType::I32,
                  DType::I64, DType::U8, DType::I8}) {
    EXPECT_EQ(parse_dtype(dtype_name(t)), t) << dtype_name(t);
  }
  EXPECT_EQ(dtype_name(DType::FP8_E4M3), "fp8_e4m3");
  EXPECT_EQ(fmt::format("{}", DType::BF16), "bf16");
}

TEST(DtypeNames, Aliases) {
  EXPECT_EQ(parse_dtype("float32"), DType::F32);
  EXPECT_EQ(parse_dtype("float"), DType::F32);
  EXPECT_EQ(parse_dtype("half"), DType::F16);
  EXPECT_EQ(parse_dtype("float16"), DType::F16);
  EXPECT_EQ(parse_dtype("BFloat16"), DType::BF16);
  EXPECT_EQ(parse_dtype("fp8"), DType::FP8_E4M3);
  EXPECT_EQ(parse_dtype("float8_e5m2"), DType::FP8_E5M2);
  EXPECT_EQ(parse_dtype("int32"), DType::I32);
  EXPECT_EQ(parse_dtype("int64"), DType::I64);
  EXPECT_EQ(parse_dtype("uint8"), DType::U8);
  EXPECT_EQ(parse_dtype("int8"), DType::I8);
  EXPECT_FALSE(parse_dtype("f64").has_value());
  EXPECT_FALSE(parse_dtype("").has_value());
}

TEST(DtypeDevices, NamesAndParsing) {
  EXPECT_EQ(device_name(Device::cpu()), "cpu");
  EXPECT_EQ(device_name(Device::cuda(3)), "cuda:3");
  EXPECT_EQ(fmt::format("{}", Device::cuda(1)), "cuda:1");
  EXPECT_EQ(device_type_name(DeviceType::CUDA), "cuda");
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("CPU"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:7"), Device::cuda(7));
  for (const char* bad : {"cuda:", "cuda:-1", "cuda:1x", "gpu", "cpu:0", "cuda:+1", ""}) {
    EXPECT_FALSE(parse_device(bad).has_value()) << bad;
  }
  EXPECT_EQ(DeviceCapability({8, 6}).as_int(), 86);
}

}  // namespace
}  // namespace pagedattn
