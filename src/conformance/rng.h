// The conformance suite's deterministic generator (SplitMix64), also used by
// fuzz_attention_diff: std distributions differ between standard libraries,
// this gives the same values everywhere.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace pagedattn::conformance {

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Zero mean, unit variance (Irwin-Hall of four uniforms): finite, within
  // +-2 sqrt(3).
  float normal() {
    double sum = 0.0;
    for (int i = 0; i < 4; ++i) sum += uniform();
    return static_cast<float>((sum - 2.0) * std::sqrt(3.0));
  }
  std::size_t below(std::size_t n) { return static_cast<std::size_t>(next() % n); }

 private:
  std::uint64_t state_;
};

}  // namespace pagedattn::conformance
