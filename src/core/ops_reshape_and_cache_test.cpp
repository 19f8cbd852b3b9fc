// reshape_and_cache through its front-end: exact copies (NHD/HND, padded and
// short slot mappings, strided rows), fp8 quantization with scales and
// saturation, and every validation error leaving the cache untouched.
#include <gtest/gtest.h>
#include <pagedattn/ops.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/ops_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

// The expected logical bytes of a [NB, BS, Hkv, D] cache after writing the
// first slots.size() rows of `rows` (row-major [T, Hkv, D] bytes in the cache
// dtype), indexed by hand as cache[slot / BS][slot % BS].
std::vector<std::uint8_t> expected_cache(std::vector<std::uint8_t> cache,
                                         const std::vector<std::uint8_t>& rows,
                                         const std::vector<std::int64_t>& slots, std::int64_t bs,
                                         std::int64_t hkv, std::int64_t d, std::size_t es) {
  const auto row_bytes = static_cast<std::size_t>(hkv * d) * es;
  for (std::size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    const std::int64_t block = slots[t] / bs;
    const std::int64_t offset = slots[t] % bs;
    std::memcpy(cache.data() + static_cast<std::size_t>(block * bs + offset) * row_bytes,
                rows.data() + t * row_bytes, row_bytes);
  }
  return cache;
}

// Distinct random slots of an NB*BS cache, with slot `padded` set to -1.
std::vector<std::int64_t> random_slots(std::size_t n, std::int64_t num_slots, std::mt19937& rng,
                                       std::size_t padded) {
  std::vector<std::int64_t> all(static_cast<std::size_t>(num_slots));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(n);
  if (padded < n) all[padded] = -1;
  return all;
}

// Quantizes row-major [T, Hkv, D] floats as the fp8 cache stores them.
std::vector<std::uint8_t> quantize_rows(const std::vector<float>& x, const std::vector<float>& scales,
                                        std::int64_t hkv, std::int64_t d, DType fp8) {
  std::vector<std::uint8_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const auto h = static_cast<std::size_t>((static_cast<std::int64_t>(i) / d) % hkv);
    store_from_float(&out[i], fp8, x[i] / scales[scales.size() == 1 ? 0 : h]);
  }
  return out;
}

// ---- reshape_and_cache: exact copies --------------------------------------------

struct CopyCase {
  Layout layout;
  DType dtype;
};

std::string layout_name(Layout l) { return l == Layout::NHD ? "NHD" : "HND"; }

std::string case_name(const CopyCase& c) {
  return layout_name(c.layout) + "_" + std::string(dtype_name(c.dtype));
}
void PrintTo(const CopyCase& c, std::ostream* os) { *os << case_name(c); }

class OpsReshapeAndCacheCopy : public ::testing::TestWithParam<CopyCase> {};

TEST_P(OpsReshapeAndCacheCopy, CopiesBitsToHandIndexedSlots) {
  const auto [layout, dtype] = GetParam();
  constexpr std::int64_t kNB = 5, kBS = 4, kHkv = 2, kD = 8, kT = 7;
  std::mt19937 rng(kSeed);
  KvCache cache = make_cache(layout, kNB, kBS, kHkv, kD, dtype);
  const Tensor key = random_tensor({kT, kHkv, kD}, dtype, rng);
  const Tensor value = random_tensor({kT, kHkv, kD}, dtype, rng);
  const std::vector<std::int64_t> slots = random_slots(kT, kNB * kBS, rng, 3);
  const std::vector<std::uint8_t> key_before = to_byte_vector(cache.key);
  const std::vector<std::uint8_t> value_before = to_byte_vector(cache.value);

  reshape_and_cache(key, value, cache.key, cache.value, i64_tensor(slots), CacheDType::Auto, {}, {});

  const std::size_t es = dtype_size(dtype);
  EXPECT_EQ(to_byte_vector(cache.key),
            expected_cache(key_before, to_byte_vector(key), slots, kBS, kHkv, kD, es));
  EXPECT_EQ(to_byte_vector(cache.value),
            expected_cache(value_before, to_byte_vector(value), slots, kBS, kHkv, kD, es));
}

INSTANTIATE_TEST_SUITE_P(
    Ops, OpsReshapeAndCacheCopy,
    ::testing::Values(CopyCase{Layout::NHD, DType::BF16}, CopyCase{Layout::HND, DType::BF16},
                      CopyCase{Layout::NHD, DType::F16}, CopyCase{Layout::HND, DType::F16},
                      CopyCase{Layout::NHD, DType::F32}, CopyCase{Layout::HND, DType::F32}),
    [](const ::testing::TestParamInfo<CopyCase>& info) { return case_name(info.param); });

TEST(OpsReshapeAndCache, ExplicitUnquantizedCacheDTypesAndUnusedScales) {
  constexpr std::int64_t kNB = 2, kBS = 2, kHkv = 1, kD = 4, kT = 2;
  std::mt19937 rng(kSeed);
  const std::vector<float> one{1.0f};
  const Tensor scale = Tensor::from_floats(one, {1}, DType::F32);
  for (const auto& [cache_dtype, dtype] :
       {std::pair{CacheDType::BFloat16, DType::BF16}, std::pair{CacheDType::Float16, DType::F16}}) {
    KvCache cache = make_cache(Layout::NHD, kNB, kBS, kHkv, kD, dtype);
    const Tensor key = random_tensor({kT, kHkv, kD}, dtype, rng);
    const std::vector<std::int64_t> slots{3, 0};
    const std::vector<std::uint8_t> before = to_byte_vector(cache.key);
    reshape_and_cache(key, key, cache.key, cache.value, i64_tensor(slots), cache_dtype, scale, scale);
    EXPECT_EQ(to_byte_vector(cache.key),
              expected_cache(before, to_byte_vector(key), slots, kBS, kHkv, kD, dtype_size(dtype)));
  }
}

TEST(OpsReshapeAndCache, ShortSlotMappingWritesOnlyItsTokens) {
  constexpr std::int64_t kNB = 3, kBS = 4, kHkv = 2, kD = 4, kT = 6;
  std::mt19937 rng(kSeed);
  KvCache cache = make_cache(Layout::HND, kNB, kBS, kHkv, kD, DType::BF16);
  const Tensor key = random_tensor({kT, kHkv, kD}, DType::BF16, rng);
  const Tensor value = random_tensor({kT, kHkv, kD}, DType::BF16, rng);
  const std::vector<std::int64_t> slots{5, -1, 11};  // N = 3 < T = 6
  const std::vector<std::uint8_t> key_before = to_byte_vector(cache.key);
  const std::vector<std::uint8_t> value_before = to_byte_vector(cache.value);

  reshape_and_cache(key, value, cache.key, cache.value, i64_tensor(slots), CacheDType::Auto, {}, {});

  EXPECT_EQ(to_byte_vector(cache.key),
            expected_cache(key_before, to_byte_vector(key), slots, kBS, kHkv, kD, 2));
  EXPECT_EQ(to_byte_vector(cache.value),
            expected_cache(value_before, to_byte_vector(value), slots, kBS, kHkv, kD, 2));

  // An empty mapping writes nothing.
  const std::vector<std::uint8_t> all_before = to_byte_vector(cache.kv);
  reshape_and_cache(key, value, cache.key, cache.value, i64_tensor({}, {0}), CacheDType::Auto, {}, {});
  EXPECT_EQ(to_byte_vector(cache.kv), all_before);
}

TEST(OpsReshapeAndCache, StridedRowsOfAFusedQkvBuffer) {
  constexpr std::int64_t kNB = 4, kBS = 2, kHkv = 2, kD = 8, kT = 5;
  std::mt19937 rng(kSeed);
  // [T, q|k|v, Hkv, D]: key and value rows are Hkv*D apart inside 3*Hkv*D-wide rows.
  const Tensor fused = random_tensor({kT, 3, kHkv, kD}, DType::F16, rng);
  const Tensor key = fused.select(1, 1);
  const Tensor value = fused.select(1, 2);
  ASSERT_EQ(key.stride(0), 3 * kHkv * kD);
  for (Layout layout : {Layout::NHD, Layout::HND}) {
    KvCache cache = make_cache(layout, kNB, kBS, kHkv, kD, DType::F16);
    const std::vector<std::int64_t> slots = random_slots(kT, kNB * kBS, rng, 0);
    const std::vector<std::uint8_t> key_before = to_byte_vector(cache.key);
    const std::vector<std::uint8_t> value_before = to_byte_vector(cache.value);
    reshape_and_cache(key, value, cache.key, cache.value, i64_tensor(slots), CacheDType::Auto, {}, {});
    EXPECT_EQ(to_byte_vector(cache.key),
              expected_cache(key_before, to_byte_vector(key), slots, kBS, kHkv, kD, 2));
    EXPECT_EQ(to_byte_vector(cache.value),
              expected_cache(value_before, to_byte_vector(value), slots, kBS, kHkv, kD, 2));
  }
}

// ---- reshape_and_cache: fp8 -------------------------------------------------------

struct Fp8Case {
  Layout layout;
  CacheDType cache_dtype;
  DType src_dtype;
  bool per_head;
};

std::string case_name(const Fp8Case& c) {
  return layout_name(c.layout) + "_" + std::string(cache_dtype_name(c.cache_dtype)) + "_" +
         std::string(dtype_name(c.src_dtype)) + (c.per_head ? "_per_head" : "_per_tensor");
}
void PrintTo(const Fp8Case& c, std::ostream* os) { *os << case_name(c); }

class OpsReshapeAndCacheFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(OpsReshapeAndCacheFp8, QuantizesWithScalesAndSaturates) {
  const Fp8Case c = GetParam();
  constexpr std::int64_t kNB = 3, kBS = 4, kHkv = 2, kD = 16, kT = 6;
  const DType fp8 = c.cache_dtype == CacheDType::Fp8E5M2 ? DType::FP8_E5M2 : DType::FP8_E4M3;
  const float max_finite = fp8 == DType::FP8_E5M2 ? kFp8E5M2Max : kFp8E4M3Max;
  // Half an ulp relative to the value, and half the smallest subnormal (in scaled units).
  const float rel_err = fp8 == DType::FP8_E5M2 ? 0x1p-3f : 0x1p-4f;
  const float half_min_sub = fp8 == DType::FP8_E5M2 ? 0x1p-17f : 0x1p-10f;

  std::mt19937 rng(kSeed);
  KvCache cache = make_cache(c.layout, kNB, kBS, kHkv, kD, fp8);
  std::vector<float> key_values = random_floats(kT * kHkv * kD, rng, 2.0f);
  key_values[5] = 1e6f;  // far beyond the range: saturates
  key_values[6] = -1e6f;
  key_values[7] = 1e-7f;  // below the smallest subnormal once scaled: rounds to zero
  const Tensor key = Tensor::from_floats(key_values, {kT, kHkv, kD}, c.src_dtype);
  const Tensor value = random_tensor({kT, kHkv, kD}, c.src_dtype, rng, 3.0f);
  const std::vector<float> k_scales = c.per_head ? std::vector<float>{0.05f, 0.2f} : std::vector<float>{0.1f};
  const std::vector<float> v_scales =
      c.per_head ? std::vector<float>{0.5f, 0.03f} : std::vector<float>{0.07f};
  const Dims scale_shape{static_cast<std::int64_t>(k_scales.size())};
  const Tensor k_scale = Tensor::from_floats(k_scales, scale_shape, DType::F32);
  const Tensor v_scale = Tensor::from_floats(v_scales, scale_shape, DType::F32);
  const std::vector<std::int64_t> slots = random_slots(kT, kNB * kBS, rng, 4);
  const std::vector<std::uint8_t> key_before = to_byte_vector(cache.key);
  const std::vector<std::uint8_t> value_before = to_byte_vector(cache.value);

  reshape_and_cache(key, value, cache.key, cache.value, i64_tensor(slots), c.cache_dtype, k_scale, v_scale);

  // Exactly the scalar conversion of x / scale.
  const std::vector<float> k_src = to_float_vector(key);
  const std::vector<float> v_src = to_float_vector(value);
  const std::vector<std::uint8_t> k_rows = quantize_rows(k_src, k_scales, kHkv, kD, fp8);
  EXPECT_EQ(to_byte_vector(cache.key), expected_cache(key_before, k_rows, slots, kBS, kHkv, kD, 1));
  EXPECT_EQ(
      to_byte_vector(cache.value),
      expected_cache(value_before, quantize_rows(v_src, v_scales, kHkv, kD, fp8), slots, kBS, kHkv, kD, 1));

  // And, independently of the encoder, the dequantized values are within the
  // format's rounding of the input (or saturated to its largest finite value).
  const std::vector<float> stored = to_float_vector(cache.key);
  for (std::size_t t = 0; t < slots.size(); ++t) {
    if (slots[t] < 0) continue;
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const float scale = k_scales[c.per_head ? static_cast<std::size_t>(h) : 0];
      for (std::int64_t d = 0; d < kD; ++d) {
        const float x = k_src[static_cast<std::size_t>((static_cast<std::int64_t>(t) * kHkv + h) * kD + d)];
        const float y = stored[static_cast<std::size_t>((slots[t] * kHkv + h) * kD + d)] * scale;
        if (std::fabs(x / scale) >= max_finite) {
          EXPECT_EQ(y, std::copysign(max_finite, x) * scale)
              << "token " << t << " head " << h << " dim " << d;
        } else {
          EXPECT_LE(std::fabs(y - x), rel_err * std::fabs(x) + half_min_sub * scale)
              << "token " << t << " head " << h << " dim " << d << " x " << x << " y " << y;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ops, OpsReshapeAndCacheFp8,
                         ::testing::Values(Fp8Case{Layout::NHD, CacheDType::Fp8, DType::BF16, false},
                                           Fp8Case{Layout::HND, CacheDType::Fp8, DType::BF16, true},
                                           Fp8Case{Layout::NHD, CacheDType::Fp8E4M3, DType::F32, true},
                                           Fp8Case{Layout::HND, CacheDType::Fp8E4M3, DType::F16, false},
                                           Fp8Case{Layout::NHD, CacheDType::Fp8E5M2, DType::BF16, true},
                                           Fp8Case{Layout::HND, CacheDType::Fp8E5M2, DType::F32, false}),
                         [](const ::testing::TestParamInfo<Fp8Case>& info) { return case_name(info.param); });

// ---- reshape_and_cache: validation --------------------------------------------------

struct ReshapeArgs {
  TensorView key;
  TensorView value;
  TensorView key_cache;
  TensorView value_cache;
  TensorView slot_mapping;
  CacheDType cache_dtype = CacheDType::Auto;
  TensorView k_scale;
  TensorView v_scale;
};

struct ReshapeErrorCase {
  std::string name;
  bool fp8_base;  // start from a valid fp8_e4m3 call instead of a bf16 one
  std::function<void(ReshapeArgs&, std::vector<Tensor>&)> mutate;
  std::string message;  // substring of the expected message
};

class OpsReshapeAndCacheErrors : public ::testing::Test {
 protected:
  static constexpr std::int64_t kNB = 4, kBS = 4, kHkv = 2, kD = 8, kT = 3;

  // Runs the case and checks the error, and that neither cache changed.
  void run(const ReshapeErrorCase& c) {
    SCOPED_TRACE(c.name);
    std::mt19937 rng(kSeed);
    const DType cache_dtype = c.fp8_base ? DType::FP8_E4M3 : DType::BF16;
    KvCache cache = make_cache(Layout::HND, kNB, kBS, kHkv, kD, cache_dtype);
    const Tensor key = random_tensor({kT, kHkv, kD}, DType::BF16, rng);
    const Tensor value = random_tensor({kT, kHkv, kD}, DType::BF16, rng);
    const std::vector<float> scales{0.1f, 0.2f};
    const Tensor k_scale = Tensor::from_floats(scales, {kHkv}, DType::F32);
    const Tensor v_scale = Tensor::from_floats(scales, {kHkv}, DType::F32);
    const Tensor slots = i64_tensor({1, 6, 13});
    ReshapeArgs a{key, value, cache.key, cache.value, slots, CacheDType::Auto, {}, {}};
    if (c.fp8_base) {
      a.cache_dtype = CacheDType::Fp8E4M3;
      a.k_scale = k_scale;
      a.v_scale = v_scale;
    }
    std::vector<Tensor> keep;
    c.mutate(a, keep);
    const std::vector<std::uint8_t> before = to_byte_vector(cache.kv);
    expect_invalid(
        [&] {
          reshape_and_cache(a.key, a.value, a.key_cache, a.value_cache, a.slot_mapping, a.cache_dtype,
                            a.k_scale, a.v_scale);
        },
        c.message);
    EXPECT_EQ(to_byte_vector(cache.kv), before) << "a rejected call wrote to the cache";
  }

  // A view of `like`'s shape whose last dimension has stride 2 (inside a fresh buffer).
  static TensorView last_dim_strided(const TensorView& like, std::vector<Tensor>& keep) {
    Dims wide = like.shape();
    wide[wide.size() - 1] *= 2;
    keep.push_back(Tensor::zeros(wide, like.dtype()));
    Dims strides = keep.back().strides();
    strides[strides.size() - 1] = 2;
    return TensorView(keep.back().data(), like.dtype(), like.device(), like.shape(), strides);
  }
};

TEST_F(OpsReshapeAndCacheErrors, ValidCallsOfBothBasesSucceed) {
  for (bool fp8 : {false, true}) {
    std::mt19937 rng(kSeed);
    KvCache cache = make_cache(Layout::HND, kNB, kBS, kHkv, kD, fp8 ? DType::FP8_E4M3 : DType::BF16);
    const Tensor key = random_tensor({kT, kHkv, kD}, DType::BF16, rng);
    const std::vector<float> scales{0.1f, 0.2f};
    const Tensor scale = Tensor::from_floats(scales, {kHkv}, DType::F32);
    const std::vector<std::uint8_t> before = to_byte_vector(cache.kv);
    reshape_and_cache(key, key, cache.key, cache.value, i64_tensor({1, 6, 13}),
                      fp8 ? CacheDType::Fp8E4M3 : CacheDType::Auto, fp8 ? scale : Tensor(),
                      fp8 ? scale : Tensor());
    EXPECT_NE(to_byte_vector(cache.kv), before);
  }
}

TEST_F(OpsReshapeAndCacheErrors, EveryErrorNamesItsArgumentAndWritesNothing) {
  using K = std::vector<Tensor>;
  const std::vector<ReshapeErrorCase> cases = {
      {"key rank", false, [](ReshapeArgs& a, K&) { a.key = a.key.select(0, 0); },
       "reshape_and_cache: key rank must be 3"},
      {"value rank", false,
       [](ReshapeArgs& a, K&) {
         a.value = a.value.view({kT, kHkv * kD});
       },
       "value rank must be 3"},
      {"key_cache rank", false, [](ReshapeArgs& a, K&) { a.key_cache = a.key_cache.select(0, 0); },
       "key_cache rank must be 4"},
      {"value_cache rank", false, [](ReshapeArgs& a, K&) { a.value_cache = a.value_cache.select(1, 0); },
       "value_cache rank must be 4"},
      {"slot_mapping rank", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(i64_tensor({1, 2, 3}, {3, 1}));
         a.slot_mapping = k.back();
       },
       "slot_mapping rank must be 1"},
      {"value device", false, [](ReshapeArgs& a, K&) { a.value = on_device(a.value, Device::cuda(0)); },
       "value device must be cpu, got cuda:0"},
      {"key_cache device", false,
       [](ReshapeArgs& a, K&) { a.key_cache = on_device(a.key_cache, Device::cuda(0)); },
       "key_cache device must be cpu"},
      {"value_cache device", false,
       [](ReshapeArgs& a, K&) { a.value_cache = on_device(a.value_cache, Device::cuda(1)); },
       "value_cache device must be cpu, got cuda:1"},
      {"slot_mapping device", false,
       [](ReshapeArgs& a, K&) { a.slot_mapping = on_device(a.slot_mapping, Device::cuda(0)); },
       "slot_mapping device must be cpu"},
      {"k_scale device", true, [](ReshapeArgs& a, K&) { a.k_scale = on_device(a.k_scale, Device::cuda(0)); },
       "k_scale device must be cpu"},
      {"key dtype not float", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({kT, kHkv, kD}, DType::I32));
         a.key = a.value = k.back();
       },
       "key dtype must be f32, f16 or bf16, got i32"},
      {"value dtype", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({kT, kHkv, kD}, DType::F16));
         a.value = k.back();
       },
       "value dtype must be bf16, got f16"},
      {"slot_mapping dtype", false,
       [](ReshapeArgs& a, K& k) {
         const std::vector<std::int32_t> s{1, 6, 13};
         k.push_back(Tensor::from_i32(s, {3}));
         a.slot_mapping = k.back();
       },
       "slot_mapping dtype must be i64, got i32"},
      {"key dtype vs cache", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({kT, kHkv, kD}, DType::F16));
         a.key = a.value = k.back();
       },
       "reshape_and_cache: key dtype must be bf16, got f16"},
      {"float16 cache dtype on a bf16 cache", false,
       [](ReshapeArgs& a, K&) { a.cache_dtype = CacheDType::Float16; },
       "key_cache dtype must be f16 (kv_cache_dtype float16), got bf16"},
      {"fp8 on a bf16 cache", false,
       [](ReshapeArgs& a, K& k) {
         a.cache_dtype = CacheDType::Fp8;
         const std::vector<float> one{1.0f};
         k.push_back(Tensor::from_floats(one, {1}, DType::F32));
         a.k_scale = a.v_scale = k.back();
       },
       "key_cache dtype must be fp8_e4m3 (kv_cache_dtype fp8), got bf16"},
      {"fp8_e5m2 on an e4m3 cache", true, [](ReshapeArgs& a, K&) { a.cache_dtype = CacheDType::Fp8E5M2; },
       "key_cache dtype must be fp8_e5m2 (kv_cache_dtype fp8_e5m2), got fp8_e4m3"},
      {"value_cache dtype", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({kNB, kBS, kHkv, kD}, DType::F16));
         a.value_cache = k.back();
       },
       "value_cache dtype must be bf16, got f16"},
      {"value shape", false, [](ReshapeArgs& a, K&) { a.value = a.value.slice(1, 0, 1); },
       "value shape must be [3, 2, 8] (the shape of key), got [3, 1, 8]"},
      {"key_cache heads", false,
       [](ReshapeArgs& a, K&) {
         a.key_cache = a.key_cache.slice(2, 0, 1);
         a.value_cache = a.value_cache.slice(2, 0, 1);
       },
       "key_cache size(2) must be 2"},
      {"key_cache head size", false,
       [](ReshapeArgs& a, K&) {
         a.key_cache = a.key_cache.slice(3, 0, 4);
         a.value_cache = a.value_cache.slice(3, 0, 4);
       },
       "key_cache size(3) must be 8"},
      {"value_cache shape", false, [](ReshapeArgs& a, K&) { a.value_cache = a.value_cache.slice(0, 0, 2); },
       "value_cache shape must be [4, 4, 2, 8] (the shape of key_cache), got [2, 4, 2, 8]"},
      {"key last dim", false, [](ReshapeArgs& a, K& k) { a.key = last_dim_strided(a.key, k); },
       "key stride(-1) must be 1"},
      {"value_cache last dim", false,
       [](ReshapeArgs& a, K& k) { a.value_cache = last_dim_strided(a.value_cache, k); },
       "value_cache stride(-1) must be 1"},
      {"slot_mapping longer than key", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(i64_tensor({0, 1, 2, 3}));
         a.slot_mapping = k.back();
       },
       "slot_mapping size(0) must be <= 3 (key size(0)), got 4"},
      {"slot out of range", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(i64_tensor({0, 5, 16}));
         a.slot_mapping = k.back();
       },
       "slot_mapping[2] must be < 16 (num_blocks 4 * block_size 4)"},
      {"slot far out of range", true,
       [](ReshapeArgs& a, K& k) {
         k.push_back(i64_tensor({-1, std::int64_t{1} << 40, 2}));
         a.slot_mapping = k.back();
       },
       "slot_mapping[1] must be < 16"},
      {"k_scale missing", true, [](ReshapeArgs& a, K&) { a.k_scale = TensorView(); },
       "k_scale must be a [1] or [2] f32 tensor for kv_cache_dtype fp8_e4m3, got undefined"},
      {"v_scale missing", true, [](ReshapeArgs& a, K&) { a.v_scale = TensorView(); }, "v_scale must be"},
      {"k_scale rank", true,
       [](ReshapeArgs& a, K&) {
         a.k_scale = a.k_scale.view({1, kHkv});
       },
       "k_scale rank must be 1"},
      {"k_scale dtype", true,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({kHkv}, DType::F16));
         a.k_scale = k.back();
       },
       "k_scale dtype must be f32, got f16"},
      {"unused scale still validated", false,
       [](ReshapeArgs& a, K& k) {
         k.push_back(Tensor::zeros({1}, DType::I32));
         a.k_scale = k.back();
       },
       "k_scale dtype must be f32"},
      {"k_scale size", true,
       [](ReshapeArgs& a, K& k) {
         const std::vector<float> s{1, 1, 1};
         k.push_back(Tensor::from_floats(s, {3}, DType::F32));
         a.k_scale = k.back();
       },
       "k_scale size(0) must be 1 or 2 (num_kv_heads), got 3"},
      {"scale shapes differ", true, [](ReshapeArgs& a, K&) { a.v_scale = a.v_scale.slice(0, 0, 1); },
       "v_scale shape must be [2] (the shape of k_scale), got [1]"},
      {"k_scale zero", true,
       [](ReshapeArgs& a, K& k) {
         const std::vector<float> s{0.0f, 1.0f};
         k.push_back(Tensor::from_floats(s, {2}, DType::F32));
         a.k_scale = k.back();
       },
       "k_scale[0] must be finite and > 0, got 0"},
      {"v_scale negative", true,
       [](ReshapeArgs& a, K& k) {
         const std::vector<float> s{1.0f, -2.0f};
         k.push_back(Tensor::from_floats(s, {2}, DType::F32));
         a.v_scale = k.back();
       },
       "v_scale[1] must be finite and > 0, got -2"},
      {"k_scale NaN", true,
       [](ReshapeArgs& a, K& k) {
         const std::vector<float> s{1.0f, std::numeric_limits<float>::quiet_NaN()};
         k.push_back(Tensor::from_floats(s, {2}, DType::F32));
         a.k_scale = k.back();
       },
       "k_scale[1] must be finite and > 0, got nan"},
      {"k_scale inf", true,
       [](ReshapeArgs& a, K& k) {
         const std::vector<float> s{kInf, 1.0f};
         k.push_back(Tensor::from_floats(s, {2}, DType::F32));
         a.k_scale = k.back();
       },
       "k_scale[0] must be finite and > 0, got inf"},
  };
  for (const ReshapeErrorCase& c : cases) run(c);
}

}  // namespace
}  // namespace pagedattn::test
