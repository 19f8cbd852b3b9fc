// reshape_and_cache into per-token-head caches (int8_per_token_head,
// fp8_per_token_head): each (token, KV head) row's scale, its rounding, zero
// and NaN rows, and the validation of the scale tensors.
#include <gtest/gtest.h>
#include <pagedattn/backend/token_head_quant.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/ops.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/ops_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

// A per-token-head cache: K/V halves and their [NB, Hkv, BS] scales, as one
// [NB, 2, Hkv, BS] f32 tensor (kv_cache_scale_shape), everything poisoned.
struct TokenHeadCache {
  KvCache kv;
  Tensor scales;  // [NB, 2, Hkv, BS]
  TensorView k_scale() const { return scales.select(1, 0); }
  TensorView v_scale() const { return scales.select(1, 1); }
};

TokenHeadCache make_token_head_cache(Layout layout, std::int64_t nb, std::int64_t bs, std::int64_t hkv,
                                     std::int64_t d, DType storage) {
  TokenHeadCache c{
      make_cache(layout, nb, bs, hkv, d, storage),
      Tensor::empty(kv_cache_scale_shape(nb, static_cast<int>(bs), static_cast<int>(hkv)), DType::F32)};
  fill_tensor_bits(c.scales, kPoison);
  return c;
}

DType storage_of(CacheDType t) { return t == CacheDType::Int8PerTokenHead ? DType::I8 : DType::FP8_E4M3; }

float quant_max(CacheDType t) { return t == CacheDType::Int8PerTokenHead ? 127.0f : 448.0f; }

// The stored value of x in a row of scale `scale`, written out independently
// of the library's int8 rounding: vLLM's x * (1 / scale), clamped, rounded to
// nearest even (the fp8 rounding is scalar.h's, tested with the dtypes).
float expected_stored(float x, float scale, CacheDType t) {
  const float q = x * (1.0f / scale);
  if (t == CacheDType::Fp8PerTokenHead) {
    std::uint8_t b = 0;
    store_from_float(&b, DType::FP8_E4M3, q);
    return fp8_e4m3_to_float(b);
  }
  return std::nearbyint(std::clamp(q, -128.0f, 127.0f));
}

float element(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
  const std::int64_t index[] = {b, s, h, d};
  return load_as_float(t.element_ptr(index), t.dtype());
}

float scale_at(const TensorView& t, std::int64_t b, std::int64_t s, std::int64_t h) {
  const std::int64_t index[] = {b, h, s};  // [NB, Hkv, BS]
  return *static_cast<const float*>(t.element_ptr(index));
}

struct TokenHeadCase {
  Layout layout;
  CacheDType dtype;
};

std::string case_name(const TokenHeadCase& c) {
  return std::string(c.layout == Layout::NHD ? "NHD_" : "HND_") + std::string(cache_dtype_name(c.dtype));
}

class OpsReshapeAndCacheTokenHead : public ::testing::TestWithParam<TokenHeadCase> {};

TEST_P(OpsReshapeAndCacheTokenHead, EachRowHasItsOwnScale) {
  const auto [layout, dtype] = GetParam();
  constexpr std::int64_t kNB = 4, kBS = 4, kHkv = 3, kD = 16, kT = 6;
  std::mt19937 rng(kSeed);
  TokenHeadCache cache = make_token_head_cache(layout, kNB, kBS, kHkv, kD, storage_of(dtype));
  // Rows of very different magnitudes: one scale per tensor could not serve them.
  std::vector<float> k = random_floats(kT * kHkv * kD, rng);
  std::vector<float> v = random_floats(kT * kHkv * kD, rng);
  for (std::size_t i = 0; i < k.size(); ++i) {
    const float magnitude = std::ldexp(1.0f, static_cast<int>(i / kD % 7) * 3 - 9);
    k[i] *= magnitude;
    v[i] *= 2.0f * magnitude;
  }
  const Tensor key = Tensor::from_floats(k, {kT, kHkv, kD}, DType::BF16);
  const Tensor value = Tensor::from_floats(v, {kT, kHkv, kD}, DType::BF16);
  const std::vector<std::int64_t> slots{5, 0, -1, 15, 6, 9};

  reshape_and_cache(key, value, cache.kv.key, cache.kv.value, i64_tensor(slots), dtype, cache.k_scale(),
                    cache.v_scale());

  std::vector<bool> written(kNB * kBS, false);
  for (std::size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    written[static_cast<std::size_t>(slots[t])] = true;
    const std::int64_t b = slots[t] / kBS;
    const std::int64_t s = slots[t] % kBS;
    for (std::int64_t h = 0; h < kHkv; ++h) {
      for (const auto& [src, half, scales] : {std::tuple{&key, &cache.kv.key, cache.k_scale()},
                                              std::tuple{&value, &cache.kv.value, cache.v_scale()}}) {
        const std::vector<float> row_all = to_float_vector(*src);
        const float* row = row_all.data() + (static_cast<std::int64_t>(t) * kHkv + h) * kD;
        float amax = 0.0f;
        for (std::int64_t d = 0; d < kD; ++d) amax = std::max(amax, std::fabs(row[d]));
        const float scale = std::max(amax / quant_max(dtype), kTokenHeadMinScale);
        ASSERT_EQ(scale_at(scales, b, s, h), scale) << "slot " << slots[t] << " head " << h;
        for (std::int64_t d = 0; d < kD; ++d) {
          const float stored = element(*half, b, s, h, d);
          ASSERT_EQ(stored, expected_stored(row[d], scale, dtype)) << "slot " << slots[t] << " head " << h;
          // Read back as stored * scale: int8 within half a step, e4m3 within
          // half a step of its 3 mantissa bits.
          const float bound = dtype == CacheDType::Int8PerTokenHead
                                  ? 0.5f * scale
                                  : std::ldexp(std::fabs(row[d]), -4) + scale;
          EXPECT_LE(std::fabs(stored * scale - row[d]), bound);
        }
      }
    }
  }
  // Every other slot, its elements and its scales, keeps the poison.
  constexpr auto kPoisonByte = static_cast<std::uint8_t>(kPoison);
  for (std::int64_t slot = 0; slot < kNB * kBS; ++slot) {
    if (written[static_cast<std::size_t>(slot)]) continue;
    const std::int64_t b = slot / kBS;
    const std::int64_t s = slot % kBS;
    for (std::int64_t h = 0; h < kHkv; ++h) {
      EXPECT_EQ(std::bit_cast<std::uint32_t>(scale_at(cache.k_scale(), b, s, h)),
                static_cast<std::uint32_t>(kPoison));
      EXPECT_EQ(std::bit_cast<std::uint32_t>(scale_at(cache.v_scale(), b, s, h)),
                static_cast<std::uint32_t>(kPoison));
      for (std::int64_t d = 0; d < kD; ++d) {
        const std::int64_t index[] = {b, s, h, d};
        EXPECT_EQ(*static_cast<const std::uint8_t*>(cache.kv.key.element_ptr(index)), kPoisonByte);
        EXPECT_EQ(*static_cast<const std::uint8_t*>(cache.kv.value.element_ptr(index)), kPoisonByte);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, OpsReshapeAndCacheTokenHead,
                         ::testing::Values(TokenHeadCase{Layout::NHD, CacheDType::Int8PerTokenHead},
                                           TokenHeadCase{Layout::HND, CacheDType::Int8PerTokenHead},
                                           TokenHeadCase{Layout::NHD, CacheDType::Fp8PerTokenHead},
                                           TokenHeadCase{Layout::HND, CacheDType::Fp8PerTokenHead}),
                         [](const ::testing::TestParamInfo<TokenHeadCase>& info) {
                           return case_name(info.param);
                         });

// Writes one f32 row [D] into slot 0 of a one-head cache; returns (stored, scale).
std::pair<std::vector<float>, float> write_row(const std::vector<float>& row, CacheDType dtype) {
  const auto d = static_cast<std::int64_t>(row.size());
  TokenHeadCache cache = make_token_head_cache(Layout::NHD, 1, 1, 1, d, storage_of(dtype));
  const Tensor key = Tensor::from_floats(row, {1, 1, d}, DType::F32);
  reshape_and_cache(key, key, cache.kv.key, cache.kv.value, i64_tensor({0}), dtype, cache.k_scale(),
                    cache.v_scale());
  std::vector<float> stored(row.size());
  for (std::int64_t i = 0; i < d; ++i)
    stored[static_cast<std::size_t>(i)] = element(cache.kv.key, 0, 0, 0, i);
  return {stored, scale_at(cache.k_scale(), 0, 0, 0)};
}

TEST(OpsReshapeAndCacheTokenHead, Int8RoundsHalfToEven) {
  // amax 127: the scale is exactly 1, so each value is stored rounded.
  const auto [stored, scale] =
      write_row({127.0f, 2.5f, 3.5f, -2.5f, -0.5f, 0.5f, 1.5f, -126.5f}, CacheDType::Int8PerTokenHead);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(stored, (std::vector<float>{127.0f, 2.0f, 4.0f, -2.0f, 0.0f, 0.0f, 2.0f, -126.0f}));
}

TEST(OpsReshapeAndCacheTokenHead, Fp8RoundsHalfToEvenAndMapsAmaxTo448) {
  // amax 448: the scale is exactly 1; e4m3 steps by 2 in [16, 32).
  const auto [stored, scale] = write_row({448.0f, 17.0f, 19.0f, -17.0f}, CacheDType::Fp8PerTokenHead);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(stored, (std::vector<float>{448.0f, 16.0f, 20.0f, -16.0f}));
  // Any amax is stored as +-448.
  const auto [big, big_scale] = write_row({-1000.0f, 10.0f}, CacheDType::Fp8PerTokenHead);
  EXPECT_EQ(big_scale, 1000.0f / 448.0f);
  EXPECT_EQ(big[0], -448.0f);
}

TEST(OpsReshapeAndCacheTokenHead, ZeroRowsStoreZerosWithTheSmallestScale) {
  for (const CacheDType dtype : {CacheDType::Int8PerTokenHead, CacheDType::Fp8PerTokenHead}) {
    const auto [stored, scale] = write_row(std::vector<float>(8, 0.0f), dtype);
    EXPECT_EQ(scale, kTokenHeadMinScale) << cache_dtype_name(dtype);
    EXPECT_EQ(stored, std::vector<float>(8, 0.0f)) << cache_dtype_name(dtype);
    // A row below the smallest scale's range keeps that scale and rounds.
    const auto [tiny, tiny_scale] = write_row({1e-5f, -2e-7f}, dtype);
    EXPECT_EQ(tiny_scale, std::max(1e-5f / quant_max(dtype), kTokenHeadMinScale)) << cache_dtype_name(dtype);
  }
}

TEST(OpsReshapeAndCacheTokenHead, NanRowsReadBackAsNan) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto [i8, i8_scale] = write_row({1.0f, nan, -3.0f}, CacheDType::Int8PerTokenHead);
  EXPECT_TRUE(std::isnan(i8_scale));
  EXPECT_EQ(i8, (std::vector<float>{0.0f, 0.0f, 0.0f}));  // int8 has no NaN: the scale carries it
  const auto [f8, f8_scale] = write_row({1.0f, nan, -3.0f}, CacheDType::Fp8PerTokenHead);
  EXPECT_TRUE(std::isnan(f8_scale));
  EXPECT_TRUE(std::isnan(f8[1]));
}

TEST(OpsReshapeAndCacheTokenHead, RejectsBadScalesAndLeavesTheCacheUnchanged) {
  constexpr std::int64_t kNB = 2, kBS = 4, kHkv = 2, kD = 8;
  std::mt19937 rng(kSeed);
  TokenHeadCache cache = make_token_head_cache(Layout::NHD, kNB, kBS, kHkv, kD, DType::I8);
  const Tensor key = random_tensor({2, kHkv, kD}, DType::BF16, rng);
  const Tensor slots = i64_tensor({1, 6});
  const CacheDType int8 = CacheDType::Int8PerTokenHead;
  const std::vector<std::uint8_t> before = to_byte_vector(cache.kv.kv);
  const std::vector<std::uint8_t> scales_before = to_byte_vector(cache.scales);
  const Tensor per_tensor = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
  const Tensor f16_scales = Tensor::zeros({kNB, kHkv, kBS}, DType::F16);
  const Tensor short_scales = Tensor::zeros({kNB, kHkv, kBS - 1}, DType::F32);
  const Tensor slot_major = Tensor::zeros({kNB, kBS, kHkv}, DType::F32);  // [NB, BS, Hkv]

  expect_invalid(
      [&] { reshape_and_cache(key, key, cache.kv.key, cache.kv.value, slots, int8, {}, cache.v_scale()); },
      "reshape_and_cache: k_scale must be a [2, 2, 4] f32 tensor ([num_blocks, num_kv_heads, block_size]) "
      "for kv_cache_dtype int8_per_token_head, got undefined");
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, cache.kv.key, cache.kv.value, slots, int8, cache.k_scale(), per_tensor);
      },
      "v_scale shape must be [2, 2, 4] ([num_blocks, num_kv_heads, block_size]), got [1]");
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, cache.kv.key, cache.kv.value, slots, int8, slot_major, cache.v_scale());
      },
      "reshape_and_cache: k_scale shape must be [2, 2, 4] ([num_blocks, num_kv_heads, block_size]), got "
      "[2, 4, 2]");
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, cache.kv.key, cache.kv.value, slots, int8, f16_scales, cache.v_scale());
      },
      "k_scale dtype must be f32, got f16");
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, cache.kv.key, cache.kv.value, slots, int8, cache.k_scale(), short_scales);
      },
      "v_scale shape must be [2, 2, 4] ([num_blocks, num_kv_heads, block_size]), got [2, 2, 3]");
  // The cache elements must be the dtype's storage.
  TokenHeadCache fp8 = make_token_head_cache(Layout::NHD, kNB, kBS, kHkv, kD, DType::FP8_E4M3);
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, fp8.kv.key, fp8.kv.value, slots, int8, fp8.k_scale(), fp8.v_scale());
      },
      "key_cache dtype must be i8 (kv_cache_dtype int8_per_token_head), got fp8_e4m3");
  EXPECT_EQ(to_byte_vector(cache.kv.kv), before);
  EXPECT_EQ(to_byte_vector(cache.scales), scales_before);
}

}  // namespace
}  // namespace pagedattn::test
