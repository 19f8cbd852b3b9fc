// The cache and state ops through their front-ends: copy_blocks, calc_kv_scales,
// index_select, and dispatch to a registered implementation, with every
// validation error leaving memory untouched. reshape_and_cache and
// merge_attn_states have their own files (ops_*_test.cpp).
#include <gtest/gtest.h>
#include <pagedattn/ops.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/ops_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::test {
namespace {

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
                         const TensorView&, const TensorView&, const TensorView&, KVQuantMode,
                         KeyPacking) override {
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
}  // namespace pagedattn::test
