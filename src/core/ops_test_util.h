// Helpers shared by the ops tests (ops_*test.cpp): seeded random tensors,
// poisoned paged KV caches in either layout, and views claimed to live on
// another device.
#pragma once

#include <pagedattn/ops.h>

#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace pagedattn::test {

inline constexpr float kInf = std::numeric_limits<float>::infinity();
inline constexpr std::uint64_t kPoison = 0x5A5A5A5A5A5A5A5Aull;
inline constexpr std::uint32_t kSeed = 1234;

enum class Layout { NHD, HND };

inline std::vector<float> random_floats(std::size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

inline Tensor random_tensor(Dims shape, DType dtype, std::mt19937& rng, float stddev = 1.0f) {
  std::int64_t n = 1;
  for (std::int64_t s : shape) n *= s;
  return Tensor::from_floats(random_floats(static_cast<std::size_t>(n), rng, stddev), shape, dtype);
}

inline Tensor i64_tensor(const std::vector<std::int64_t>& values, Dims shape) {
  return Tensor::from_i64(values, shape);
}
inline Tensor i64_tensor(const std::vector<std::int64_t>& values) {
  return Tensor::from_i64(values, {static_cast<std::int64_t>(values.size())});
}

// Same memory, claimed to live on another device (never dereferenced: device
// checks run before anything is read).
inline TensorView on_device(const TensorView& t, Device d) {
  return TensorView(t.data(), t.dtype(), d, t.shape(), t.strides());
}
// A paged KV cache as the backends allocate it: logical [2, NB, BS, Hkv, D]
// with the layout's stride order, split into its halves, poisoned.
struct KvCache {
  Tensor kv;     // [2, NB, BS, Hkv, D]
  Tensor key;    // [NB, BS, Hkv, D]
  Tensor value;  // [NB, BS, Hkv, D]
};

inline KvCache make_cache(Layout layout, std::int64_t nb, std::int64_t bs, std::int64_t hkv, std::int64_t d,
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

}  // namespace pagedattn::test
