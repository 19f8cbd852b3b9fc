// The cache and state ops through their front-ends: reshape_and_cache (exact
// copies, NHD/HND, fp8 quantization, padded and short slot mappings, strided
// rows), merge_attn_states (against a double-precision merge), copy_blocks,
// calc_kv_scales, dispatch, and every validation error leaving memory untouched.
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

namespace pagedattn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr std::uint64_t kPoison = 0x5A5A5A5A5A5A5A5Aull;
constexpr std::uint32_t kSeed = 1234;

enum class Layout { NHD, HND };

std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

Tensor random_tensor(Dims shape, DType dtype, std::mt19937& rng, float stddev = 1.0f) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return Tensor::from_floats(random_floats(static_cast<std::size_t>(n), rng, stddev), shape, dtype);
}

Tensor i64_tensor(const std::vector<std::int64_t>& values, Dims shape) {
  return Tensor::from_i64(values, shape);
}
Tensor i64_tensor(const std::vector<std::int64_t>& values) {
  return Tensor::from_i64(values, {static_cast<std::int64_t>(values.size())});
}

// Same memory, claimed to live on another device (never dereferenced: device
// checks run before anything is read).
TensorView on_device(const TensorView& t, Device d) {
  return TensorView(t.data(), t.dtype(), d, t.shape(), t.strides());
}

// Runs `fn`, expecting an InvalidArgument Error whose message contains `needle`.
template <typename Fn>
void expect_invalid(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
  }
}

// A paged KV cache as the backends allocate it: logical [2, NB, BS, Hkv, D]
// with the layout's stride order, split into its halves, poisoned.
struct KvCache {
  Tensor kv;     // [2, NB, BS, Hkv, D]
  Tensor key;    // [NB, BS, Hkv, D]
  Tensor value;  // [NB, BS, Hkv, D]
};

KvCache make_cache(Layout layout, std::int64_t nb, std::int64_t bs, std::int64_t hkv, std::int64_t d,
                   DType dtype) {
  const std::vector<int> nhd{0, 1, 2, 3, 4};
  const std::vector<int> hnd{0, 1, 3, 2, 4};
  KvCache c;
  c.kv = Tensor::empty_strided_order({2, nb, bs, hkv, d}, layout == Layout::NHD ? nhd : hnd, dtype,
                                     Device::cpu());
  fill_tensor_bits(c.kv, kPoison);
  c.key = c.kv.select(0, 0);
  c.value = c.kv.select(0, 1);
  return c;
}

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

// ---- merge_attn_states ----------------------------------------------------------------

struct MergeData {
  Tensor output, prefix_output, suffix_output;  // [T, H, D]
  Tensor prefix_lse, suffix_lse, output_lse;    // [H, T]
};

// LSE pairs covering vLLM's infinity rules, placed on head 0's first tokens.
const std::vector<std::pair<float, float>> kSpecialLse = {
    {-kInf, 1.5f},  {kInf, 0.25f}, {2.0f, -kInf}, {2.0f, kInf},
    {-kInf, -kInf}, {kInf, kInf},  {kInf, -kInf}, {3.0f, 3.0f},
};

MergeData make_merge_data(std::int64_t t, std::int64_t h, std::int64_t d, DType dtype, std::mt19937& rng) {
  MergeData m;
  m.prefix_output = random_tensor({t, h, d}, dtype, rng);
  m.suffix_output = random_tensor({t, h, d}, dtype, rng);
  m.output = Tensor::empty({t, h, d}, dtype);
  fill_tensor_bits(m.output, kPoison);
  std::vector<float> p = random_floats(static_cast<std::size_t>(h * t), rng, 3.0f);
  std::vector<float> s = random_floats(static_cast<std::size_t>(h * t), rng, 3.0f);
  for (std::size_t i = 0; i < kSpecialLse.size() && i < p.size(); ++i) std::tie(p[i], s[i]) = kSpecialLse[i];
  m.prefix_lse = Tensor::from_floats(p, {h, t}, DType::F32);
  m.suffix_lse = Tensor::from_floats(s, {h, t}, DType::F32);
  m.output_lse =
      Tensor::from_floats(std::vector<float>(static_cast<std::size_t>(h * t), 42.0f), {h, t}, DType::F32);
  return m;
}

// Checks `out` / `out_lse` against the merge computed in double from the same inputs.
void check_merge(const MergeData& m, const TensorView& out, const TensorView& out_lse, double rel_tol) {
  const std::int64_t t_count = out.size(0), h_count = out.size(1), d_count = out.size(2);
  const std::vector<float> po = to_float_vector(m.prefix_output);
  const std::vector<float> so = to_float_vector(m.suffix_output);
  const std::vector<std::uint8_t> po_bytes = to_byte_vector(m.prefix_output);
  const std::vector<float> pl = to_float_vector(m.prefix_lse);
  const std::vector<float> sl = to_float_vector(m.suffix_lse);
  const std::vector<float> o = to_float_vector(out);
  const std::vector<std::uint8_t> o_bytes = to_byte_vector(out);
  const std::vector<float> ol = out_lse.defined() ? to_float_vector(out_lse) : std::vector<float>();
  const std::size_t es = out.element_size();
  for (std::int64_t t = 0; t < t_count; ++t) {
    for (std::int64_t h = 0; h < h_count; ++h) {
      const auto li = static_cast<std::size_t>(h * t_count + t);
      const double p = std::isinf(pl[li]) ? -INFINITY : pl[li];
      const double s = std::isinf(sl[li]) ? -INFINITY : sl[li];
      const double mx = std::max(p, s);
      const auto row = static_cast<std::size_t>((t * h_count + h) * d_count);
      if (mx == -INFINITY) {
        EXPECT_EQ(0, std::memcmp(o_bytes.data() + row * es, po_bytes.data() + row * es,
                                 static_cast<std::size_t>(d_count) * es))
            << "token " << t << " head " << h << ": prefix output copied";
        if (!ol.empty()) {
          EXPECT_EQ(ol[li], -kInf);
        }
        continue;
      }
      const double wp = std::exp(p - mx), ws = std::exp(s - mx);
      for (std::int64_t d = 0; d < d_count; ++d) {
        const auto i = row + static_cast<std::size_t>(d);
        const double ref = (wp * po[i] + ws * so[i]) / (wp + ws);
        ASSERT_NEAR(o[i], ref, rel_tol * std::fabs(ref) + 1e-6)
            << "token " << t << " head " << h << " dim " << d;
      }
      if (!ol.empty()) {
        EXPECT_NEAR(ol[li], std::log(wp + ws) + mx, 1e-5 * (1 + std::fabs(mx))) << t << "," << h;
      }
    }
  }
}

class OpsMergeAttnStates : public ::testing::TestWithParam<DType> {};

TEST_P(OpsMergeAttnStates, MatchesDoublePrecisionMergeWithInfinityRules) {
  const DType dtype = GetParam();
  // Output rounding: half an ulp of the element type (float math otherwise).
  const double rel_tol = dtype == DType::F32 ? 1e-5 : dtype == DType::F16 ? 1e-3 : 8e-3;
  std::mt19937 rng(kSeed);
  const MergeData m = make_merge_data(11, 3, 16, dtype, rng);
  merge_attn_states(m.output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse, m.output_lse);
  check_merge(m, m.output, m.output_lse, rel_tol);

  // The exact cases: one side -inf gives the other side unchanged.
  const std::vector<float> o = to_float_vector(m.output);
  const std::vector<float> po = to_float_vector(m.prefix_output);
  const std::vector<float> so = to_float_vector(m.suffix_output);
  const std::vector<float> lse = to_float_vector(m.output_lse);
  const std::size_t row = 3 * 16;  // token stride in elements
  for (std::size_t d = 0; d < 16; ++d) {
    EXPECT_EQ(o[0 * row + d], so[0 * row + d]);  // prefix -inf
    EXPECT_EQ(o[1 * row + d], so[1 * row + d]);  // prefix +inf
    EXPECT_EQ(o[2 * row + d], po[2 * row + d]);  // suffix -inf
    EXPECT_EQ(o[3 * row + d], po[3 * row + d]);  // suffix +inf
  }
  EXPECT_EQ(lse[0], 1.5f);
  EXPECT_EQ(lse[2], 2.0f);
  EXPECT_EQ(lse[4], -kInf);
  EXPECT_EQ(lse[5], -kInf);
  EXPECT_EQ(lse[6], -kInf);
  EXPECT_FLOAT_EQ(lse[7], 3.0f + std::log(2.0f));
}

TEST_P(OpsMergeAttnStates, StridedInPlaceAndWithoutOutputLse) {
  const DType dtype = GetParam();
  const double rel_tol = dtype == DType::F32 ? 1e-5 : dtype == DType::F16 ? 1e-3 : 8e-3;
  constexpr std::int64_t kT = 9, kH = 2, kD = 8;
  std::mt19937 rng(kSeed + 1);
  MergeData m = make_merge_data(kT, kH, kD, dtype, rng);
  // Suffix rows inside a wider buffer; output LSE as a transposed [T, H] tensor.
  const Tensor wide = random_tensor({kT, kH, 2 * kD}, dtype, rng);
  m.suffix_output = wide.slice(2, kD, 2 * kD);
  const Tensor lse_th = Tensor::zeros({kT, kH}, DType::F32);
  const MergeData original{
      m.prefix_output.clone(), m.prefix_output.clone(), m.suffix_output, m.prefix_lse, m.suffix_lse, {}};
  // In place: the output is the prefix buffer.
  merge_attn_states(m.prefix_output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse,
                    lse_th.permute({1, 0}));
  check_merge(original, m.prefix_output, lse_th.permute({1, 0}), rel_tol);

  MergeData fresh = make_merge_data(kT, kH, kD, dtype, rng);
  merge_attn_states(fresh.output, fresh.prefix_output, fresh.prefix_lse, fresh.suffix_output,
                    fresh.suffix_lse);
  check_merge(fresh, fresh.output, TensorView(), rel_tol);
}

INSTANTIATE_TEST_SUITE_P(Ops, OpsMergeAttnStates, ::testing::Values(DType::F32, DType::F16, DType::BF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(dtype_name(info.param));
                         });

struct MergeArgs {
  TensorView output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse;
};

TEST(OpsMergeAttnStatesErrors, EveryErrorNamesItsArgumentAndWritesNothing) {
  using K = std::vector<Tensor>;
  using Mutate = std::function<void(MergeArgs&, K&)>;
  const std::vector<std::tuple<std::string, Mutate, std::string>> cases = {
      {"output rank", [](MergeArgs& a, K&) { a.output = a.output.select(0, 0); },
       "merge_attn_states: output rank must be 3"},
      {"prefix_output rank", [](MergeArgs& a, K&) { a.prefix_output = a.prefix_output.view({-1}); },
       "prefix_output rank must be 3"},
      {"suffix_lse rank", [](MergeArgs& a, K&) { a.suffix_lse = a.suffix_lse.select(0, 0); },
       "suffix_lse rank must be 2"},
      {"output_lse rank",
       [](MergeArgs& a, K&) {
         a.output_lse = a.output_lse.view({1, 3, 5});
       },
       "output_lse rank must be 2"},
      {"prefix_output device",
       [](MergeArgs& a, K&) { a.prefix_output = on_device(a.prefix_output, Device::cuda(0)); },
       "prefix_output device must be cpu, got cuda:0"},
      {"suffix_lse device", [](MergeArgs& a, K&) { a.suffix_lse = on_device(a.suffix_lse, Device::cuda(0)); },
       "suffix_lse device must be cpu"},
      {"output_lse device", [](MergeArgs& a, K&) { a.output_lse = on_device(a.output_lse, Device::cuda(0)); },
       "output_lse device must be cpu"},
      {"output dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 4}, DType::I32));
         a.output = a.prefix_output = a.suffix_output = k.back();
       },
       "output dtype must be f32, f16 or bf16, got i32"},
      {"suffix_output dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 4}, DType::F16));
         a.suffix_output = k.back();
       },
       "suffix_output dtype must be bf16, got f16"},
      {"prefix_lse dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({3, 5}, DType::BF16));
         a.prefix_lse = k.back();
       },
       "prefix_lse dtype must be f32, got bf16"},
      {"output_lse dtype",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({3, 5}, DType::F16));
         a.output_lse = k.back();
       },
       "output_lse dtype must be f32"},
      {"suffix_output shape", [](MergeArgs& a, K&) { a.suffix_output = a.suffix_output.slice(2, 0, 2); },
       "suffix_output shape must be [5, 3, 4] (the shape of output), got [5, 3, 2]"},
      {"prefix_lse transposed",
       [](MergeArgs& a, K&) {
         a.prefix_lse = a.prefix_lse.permute({1, 0});
       },
       "prefix_lse size(0) must be 3"},
      {"suffix_lse tokens", [](MergeArgs& a, K&) { a.suffix_lse = a.suffix_lse.slice(1, 0, 4); },
       "suffix_lse size(1) must be 5"},
      {"output last dim",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 8}, DType::BF16));
         a.output = TensorView(k.back().data(), DType::BF16, Device::cpu(), {5, 3, 4}, {24, 8, 2});
       },
       "merge_attn_states: output stride(-1) must be 1"},
      {"prefix_output last dim",
       [](MergeArgs& a, K& k) {
         k.push_back(Tensor::zeros({5, 3, 8}, DType::BF16));
         a.prefix_output = TensorView(k.back().data(), DType::BF16, Device::cpu(), {5, 3, 4}, {24, 8, 2});
       },
       "prefix_output stride(-1) must be 1"},
  };
  for (const auto& [name, mutate, message] : cases) {
    SCOPED_TRACE(name);
    std::mt19937 rng(kSeed);
    const MergeData m = make_merge_data(5, 3, 4, DType::BF16, rng);
    MergeArgs a{m.output, m.prefix_output, m.prefix_lse, m.suffix_output, m.suffix_lse, m.output_lse};
    K keep;
    mutate(a, keep);
    const std::vector<std::uint8_t> out_before = to_byte_vector(m.output);
    const std::vector<std::uint8_t> lse_before = to_byte_vector(m.output_lse);
    expect_invalid(
        [&] {
          merge_attn_states(a.output, a.prefix_output, a.prefix_lse, a.suffix_output, a.suffix_lse,
                            a.output_lse);
        },
        message);
    EXPECT_EQ(to_byte_vector(m.output), out_before);
    EXPECT_EQ(to_byte_vector(m.output_lse), lse_before);
  }
}

// ---- copy_blocks ------------------------------------------------------------------------

// Applies (src, dst) pairs in order to the row-major bytes of a cache of
// `num_blocks` equal blocks.
std::vector<std::uint8_t> expected_copy(std::vector<std::uint8_t> bytes, std::int64_t num_blocks,
                                        const std::vector<std::int64_t>& pairs) {
  const std::size_t block_bytes = bytes.size() / static_cast<std::size_t>(num_blocks);
  for (std::size_t i = 0; i + 1 < pairs.size(); i += 2) {
    std::memmove(bytes.data() + static_cast<std::size_t>(pairs[i + 1]) * block_bytes,
                 bytes.data() + static_cast<std::size_t>(pairs[i]) * block_bytes, block_bytes);
  }
  return bytes;
}

TEST(OpsCopyBlocks, CopiesWholeBlocksOfEveryCacheAndLayout) {
  constexpr std::int64_t kNB = 6, kBS = 4, kHkv = 2, kD = 8;
  std::mt19937 rng(kSeed);
  for (Layout layout : {Layout::NHD, Layout::HND}) {
    KvCache cache = make_cache(layout, kNB, kBS, kHkv, kD, DType::BF16);
    copy_tensor(cache.kv, random_tensor({2, kNB, kBS, kHkv, kD}, DType::BF16, rng));
    // Also: a cache whose blocks are not dense (half of each row) and a plain byte cache.
    const Tensor wide = random_tensor({kNB, kBS, 2 * kD}, DType::F32, rng);
    const Tensor half_rows = wide.slice(2, 0, kD);
    std::vector<float> byte_values(kNB * 3);
    for (std::size_t i = 0; i < byte_values.size(); ++i) byte_values[i] = static_cast<float>(i * 37 % 251);
    const Tensor bytes = Tensor::from_floats(byte_values, {kNB, 3}, DType::U8);
    const std::vector<std::int64_t> pairs{0, 3, 2, 1, 4, 4, 3, 5};  // 3 -> 5 sees the copied block 0
    const std::vector<TensorView> caches{cache.key, cache.value, half_rows, bytes};
    std::vector<std::vector<std::uint8_t>> expected;
    for (const TensorView& c : caches) expected.push_back(expected_copy(to_byte_vector(c), kNB, pairs));
    const std::vector<std::uint8_t> wide_tail_before = to_byte_vector(wide.slice(2, kD, 2 * kD));

    copy_blocks(caches, i64_tensor(pairs, {4, 2}));

    for (std::size_t i = 0; i < caches.size(); ++i)
      EXPECT_EQ(to_byte_vector(caches[i]), expected[i]) << "cache " << i;
    EXPECT_EQ(to_byte_vector(wide.slice(2, kD, 2 * kD)), wide_tail_before)
        << "bytes outside the view written";
  }
  // No pairs, or no caches: nothing happens.
  KvCache cache = make_cache(Layout::NHD, kNB, kBS, kHkv, kD, DType::BF16);
  const std::vector<std::uint8_t> before = to_byte_vector(cache.kv);
  copy_blocks({cache.key, cache.value}, i64_tensor({}, {0, 2}));
  copy_blocks({}, i64_tensor({0, 1}, {1, 2}));
  EXPECT_EQ(to_byte_vector(cache.kv), before);
}

TEST(OpsCopyBlocksErrors, EveryErrorNamesItsArgumentAndWritesNothing) {
  constexpr std::int64_t kNB = 5;
  using Mutate = std::function<void(std::vector<TensorView>&, Tensor&)>;
  const std::vector<std::tuple<std::string, Mutate, std::string>> cases = {
      {"mapping rank",
       [](std::vector<TensorView>&, Tensor& m) {
         m = i64_tensor({0, 1});
       },
       "copy_blocks: block_mapping rank must be 2"},
      {"mapping width",
       [](std::vector<TensorView>&, Tensor& m) {
         m = i64_tensor({0, 1, 2}, {1, 3});
       },
       "block_mapping size(1) must be 2"},
      {"mapping dtype",
       [](std::vector<TensorView>&, Tensor& m) {
         const std::vector<std::int32_t> v{0, 1};
         m = Tensor::from_i32(v, {1, 2});
       },
       "block_mapping dtype must be i64, got i32"},
      {"mapping dst out of range",
       [](std::vector<TensorView>&, Tensor& m) {
         m = i64_tensor({0, 1, 2, kNB}, {2, 2});
       },
       "block_mapping[1][1] must be in [0, 5) (num_blocks), got 5"},
      {"mapping src negative",
       [](std::vector<TensorView>&, Tensor& m) {
         m = i64_tensor({0, 1, -1, 2}, {2, 2});
       },
       "block_mapping[1][0] must be in [0, 5)"},
      {"caches disagree on NB", [](std::vector<TensorView>& c, Tensor&) { c[1] = c[1].slice(0, 0, kNB - 1); },
       "caches[1] size(0) must be 5"},
      {"undefined cache", [](std::vector<TensorView>& c, Tensor&) { c[1] = TensorView(); },
       "caches[1] must be a defined tensor"},
      {"cache device", [](std::vector<TensorView>& c, Tensor&) { c[0] = on_device(c[0], Device::cuda(0)); },
       "caches[0] device must be cpu, got cuda:0"},
  };
  for (const auto& [name, mutate, message] : cases) {
    SCOPED_TRACE(name);
    std::mt19937 rng(kSeed);
    KvCache cache = make_cache(Layout::HND, kNB, 2, 2, 4, DType::F16);
    copy_tensor(cache.kv, random_tensor({2, kNB, 2, 2, 4}, DType::F16, rng));
    std::vector<TensorView> caches{cache.key, cache.value};
    Tensor mapping = i64_tensor({0, 1, 2, 3}, {2, 2});
    mutate(caches, mapping);
    const std::vector<std::uint8_t> before = to_byte_vector(cache.kv);
    expect_invalid([&] { copy_blocks(caches, mapping); }, message);
    EXPECT_EQ(to_byte_vector(cache.kv), before);
  }
}

// ---- calc_kv_scales ---------------------------------------------------------------------

TEST(OpsCalcKvScales, AbsMaxOverRanges) {
  std::mt19937 rng(kSeed);
  std::vector<float> q = random_floats(4 * 3 * 8, rng, 0.5f);
  q[17] = -7.5f;
  std::vector<float> k = random_floats(4 * 2 * 8, rng, 0.5f);
  k[3] = 3.0f;
  std::vector<float> v = random_floats(8 * 2 * 4, rng, 0.5f);
  v[40] = -12.0f;
  const Tensor query = Tensor::from_floats(q, {4, 3, 8}, DType::F32);
  const Tensor key = Tensor::from_floats(k, {4, 2, 8}, DType::BF16);
  const Tensor value = Tensor::from_floats(v, {8, 2, 4}, DType::F16).permute({2, 1, 0});  // any strides
  const KVScales s = calc_kv_scales(query, key, value);
  EXPECT_EQ(s.q_scale, 7.5f / kQScaleRange);
  EXPECT_EQ(s.k_scale, 3.0f / kKScaleRange);
  EXPECT_EQ(s.v_scale, 12.0f / kVScaleRange);
  EXPECT_EQ(kQScaleRange, 200.0f);
  EXPECT_EQ(kKScaleRange, 200.0f);
  EXPECT_EQ(kVScaleRange, 100.0f);

  // All-zero input keeps the neutral scale rather than a zero divisor.
  const Tensor zeros = Tensor::zeros({2, 2, 2}, DType::BF16);
  EXPECT_EQ(calc_kv_scales(zeros, zeros, zeros).k_scale, 1.0f);
  // abs_max propagates NaN so a broken activation is not silently scaled.
  std::vector<float> with_nan(6, 1.0f);
  with_nan[4] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(
      std::isnan(ops_impl(DeviceType::CPU).abs_max(Tensor::from_floats(with_nan, {2, 3}, DType::F32))));
}

TEST(OpsCalcKvScales, Errors) {
  const Tensor x = Tensor::zeros({2, 2, 2}, DType::BF16);
  const Tensor ints = Tensor::zeros({2, 2, 2}, DType::I32);
  expect_invalid([&] { (void)calc_kv_scales(x, TensorView(), x); },
                 "calc_kv_scales: key must be a defined tensor");
  expect_invalid([&] { (void)calc_kv_scales(x, x, ints); }, "value dtype must be f32, f16 or bf16, got i32");
  expect_invalid([&] { (void)calc_kv_scales(x, on_device(x, Device::cuda(0)), x); },
                 "key device must be cpu");
}

// ---- index_select ----------------------------------------------------------------------

// src [3, 2, 4] holding 0..23; dst rows take src rows {2, -1, 0, 3}: -1 and
// 3 (past src's 3 rows) select nothing and get the fill value.
TEST(OpsIndexSelect, GathersRowsAndFillsTheRest) {
  std::vector<float> values(24);
  std::iota(values.begin(), values.end(), 0.0f);
  const Tensor src = Tensor::from_floats(values, {3, 2, 4}, DType::BF16);
  const Tensor dst = Tensor::empty({4, 2, 4}, DType::BF16);
  index_select(dst, src, 0, Tensor::from_i32(std::vector<std::int32_t>{2, -1, 0, 3}, {4}), -7.0f);
  const std::vector<float> got = to_float_vector(dst);
  for (int e = 0; e < 8; ++e) {
    EXPECT_EQ(got[static_cast<std::size_t>(e)], 16.0f + e) << e;
    EXPECT_EQ(got[static_cast<std::size_t>(8 + e)], -7.0f) << e;
    EXPECT_EQ(got[static_cast<std::size_t>(16 + e)], static_cast<float>(e)) << e;
    EXPECT_EQ(got[static_cast<std::size_t>(24 + e)], -7.0f) << e;
  }
}

// Along dimension 1 of an [H, T] LSE, into a strided view: the columns of
// [2, 5] outside the view keep their poison.
TEST(OpsIndexSelect, AlongAnInnerDimensionIntoAStridedView) {
  const Tensor src = Tensor::from_floats(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3}, DType::F32);
  const Tensor wide = Tensor::empty({2, 5}, DType::F32);
  fill_tensor(wide, 99.0f);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  index_select(wide.slice(1, 0, 4), src, 1, Tensor::from_i32(std::vector<std::int32_t>{1, -1, 2, 0}, {4}), neg_inf);
  EXPECT_EQ(to_float_vector(wide), (std::vector<float>{2, neg_inf, 3, 1, 99, 5, neg_inf, 6, 4, 99}));
}

TEST(OpsIndexSelectErrors, EveryErrorNamesItsArgument) {
  const Tensor src = Tensor::zeros({3, 2, 4}, DType::BF16);
  const Tensor dst = Tensor::zeros({2, 2, 4}, DType::BF16);
  const Tensor index = Tensor::from_i32(std::vector<std::int32_t>{0, 1}, {2});
  expect_invalid([&] { index_select(dst, src, 3, index); }, "index_select: dim must be in [0, 3) (dst rank), got 3");
  expect_invalid([&] { index_select(dst, src.select(0, 0), 0, index); }, "index_select: src rank must be 3");
  expect_invalid([&] { index_select(dst, Tensor::zeros({3, 2, 4}, DType::F32), 0, index); }, "src dtype must be bf16");
  expect_invalid([&] { index_select(dst, Tensor::zeros({3, 3, 4}, DType::BF16), 0, index); }, "src size(1) must be 2");
  expect_invalid([&] { index_select(dst, src, 0, Tensor::from_i64(std::vector<std::int64_t>{0, 1}, {2})); },
                 "index dtype must be i32, got i64");
  expect_invalid([&] { index_select(dst, src, 0, Tensor::from_i32(std::vector<std::int32_t>{0}, {1})); },
                 "index size(0) must be 2");
}

// ---- dispatch ---------------------------------------------------------------------------

// Records calls instead of computing.
struct RecordingOps final : OpsImpl {
  void reshape_and_cache(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&, const TensorView&, KeyPacking) override {
    ++reshape_calls;
  }
  void merge_attn_states(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                         const TensorView&, const TensorView&) override {
    ++merge_calls;
  }
  void copy_blocks(const std::vector<TensorView>&, const TensorView&) override { ++copy_calls; }
  void index_select(const TensorView&, const TensorView&, int, const TensorView&, std::uint64_t) override {}
  float abs_max(const TensorView&) override { return 2.0f; }
  int reshape_calls = 0, merge_calls = 0, copy_calls = 0;
};

// A stand-in "CUDA" device backed by host memory.
struct HostBackedDevice final : DeviceAllocator {
  void* allocate(std::size_t bytes, Device) override { return host().allocate(bytes, Device::cpu()); }
  void deallocate(void* p, Device) noexcept override { host().deallocate(p, Device::cpu()); }
  void copy(void* dst, Device, const void* src, Device, std::size_t bytes) override {
    std::memmove(dst, src, bytes);
  }
  void memset(void* dst, Device, int value, std::size_t bytes) override { std::memset(dst, value, bytes); }
  int device_count() const override { return 1; }
  DeviceCapability capability(Device) const override { return {9, 0}; }
  static DeviceAllocator& host() { return device_allocator(DeviceType::CPU); }
};

TEST(OpsDispatch, RegisteredImplReplacesTheBuiltInCpuOne) {
  RecordingOps recording;
  OpsImpl& builtin = ops_impl(DeviceType::CPU);
  register_ops_impl(DeviceType::CPU, &recording);
  EXPECT_EQ(&ops_impl(DeviceType::CPU), &recording);
  const Tensor x = Tensor::zeros({1, 1, 4}, DType::BF16);
  EXPECT_EQ(calc_kv_scales(x, x, x).v_scale, 2.0f / kVScaleRange);
  register_ops_impl(DeviceType::CPU, nullptr);
  EXPECT_EQ(&ops_impl(DeviceType::CPU), &builtin);
}

TEST(OpsDispatch, DeviceTensorsAreValidatedOnTheHostThenDispatched) {
  DeviceAllocator* previous_alloc = find_device_allocator(DeviceType::CUDA);
  OpsImpl* previous_ops = nullptr;
  try {
    previous_ops = &ops_impl(DeviceType::CUDA);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
  }
  HostBackedDevice device;
  RecordingOps recording;
  register_device_allocator(DeviceType::CUDA, &device);
  register_ops_impl(DeviceType::CUDA, &recording);

  const Device cuda = Device::cuda(0);
  KvCache host_cache = make_cache(Layout::NHD, 2, 2, 1, 4, DType::BF16);
  const Tensor kv = host_cache.kv.to(cuda);
  const Tensor key = Tensor::zeros({2, 1, 4}, DType::BF16, cuda);
  expect_invalid(
      [&] {
        reshape_and_cache(key, key, kv.select(0, 0), kv.select(0, 1),
                          Tensor::from_i64(std::vector<std::int64_t>{0, 4}, {2}, cuda), CacheDType::Auto, {},
                          {});
      },
      "slot_mapping[1] must be < 4");
  EXPECT_EQ(recording.reshape_calls, 0);
  reshape_and_cache(key, key, kv.select(0, 0), kv.select(0, 1),
                    Tensor::from_i64(std::vector<std::int64_t>{0, 3}, {2}, cuda), CacheDType::Auto, {}, {});
  EXPECT_EQ(recording.reshape_calls, 1);
  copy_blocks({kv.select(0, 0)}, Tensor::from_i64(std::vector<std::int64_t>{0, 1}, {1, 2}, cuda));
  EXPECT_EQ(recording.copy_calls, 1);

  register_ops_impl(DeviceType::CUDA, previous_ops);
  register_device_allocator(DeviceType::CUDA, previous_alloc);
  if (previous_ops == nullptr) {
    try {
      (void)ops_impl(DeviceType::CUDA);
      ADD_FAILURE() << "expected Unsupported";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Unsupported);
      EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace pagedattn
