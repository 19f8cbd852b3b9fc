// Test helper shared by the test files: tensors (bf16 unless asked) of
// standard-normal values from one seeded stream (each call continues it).
#pragma once

#include <pagedattn/tensor.h>

#include <cstdint>
#include <random>
#include <vector>

namespace pagedattn::test {

class NormalTensors {
 public:
  explicit NormalTensors(unsigned seed) : rng_(seed) {}

  Tensor operator()(const Dims& shape, DType dtype = DType::BF16) {
    std::int64_t n = 1;
    for (const std::int64_t extent : shape) n *= extent;
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& x : v) x = dist_(rng_);
    return Tensor::from_floats(v, shape, dtype);
  }

 private:
  std::mt19937 rng_;
  std::normal_distribution<float> dist_;
};

}  // namespace pagedattn::test
