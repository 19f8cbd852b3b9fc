// Accuracy of the decode softmax's exp (cpu_attn_exp_avx512.h) against the
// double-precision exp: the conformance grid's bf16 tolerances would hide an
// error of 1e-3, so the function is checked alone.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "backends/cpu_attn/kernels/cpu_attn_exp_avx512.h"

#if defined(__x86_64__) || defined(__i386__)
namespace pagedattn::cpu_attn {
namespace {

constexpr int kLanes = 16;

__attribute__((target("avx512f"))) void exp16(const float* x, float* y) {
  _mm512_storeu_ps(y, exp_avx512(_mm512_loadu_ps(x)));
}

std::vector<float> exp_of(const std::vector<float>& x) {
  std::vector<float> padded = x;
  padded.resize((x.size() + kLanes - 1) / kLanes * kLanes, 0.0f);
  std::vector<float> y(padded.size());
  for (std::size_t i = 0; i < padded.size(); i += kLanes) exp16(padded.data() + i, y.data() + i);
  y.resize(x.size());
  return y;
}

// Distance from the exact value in units of the float spacing there (the
// subnormal spacing below the normal range).
double ulps(float got, double exact) {
  const double spacing = exact < std::numeric_limits<float>::min()
                             ? std::numeric_limits<float>::denorm_min()
                             : std::ldexp(1.0, std::ilogb(exact) - std::numeric_limits<float>::digits + 1);
  return std::fabs(static_cast<double>(got) - exact) / spacing;
}

TEST(CpuAttnExp, WithinOneUlpOverTheSoftmaxRange) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "no AVX-512 on this CPU";
  // Every 97th float from the lower bound to 16 (about 23 million values):
  // the softmax's arguments are <= 0; alpha's too.
  constexpr std::uint32_t kStride = 97;
  std::vector<float> x;
  const auto add_range = [&](float from, float to) {  // same sign, |from| >= |to|
    std::uint32_t a = 0;
    std::uint32_t b = 0;
    std::memcpy(&a, &from, sizeof a);
    std::memcpy(&b, &to, sizeof b);
    for (std::uint32_t bits = std::min(a, b); bits <= std::max(a, b); bits += kStride) {
      float v = 0.0f;
      std::memcpy(&v, &bits, sizeof v);
      x.push_back(v);
    }
  };
  add_range(kExpLowerBound, -0.0f);
  add_range(16.0f, 0.0f);
  const std::vector<float> y = exp_of(x);
  double worst = 0.0;
  float worst_x = 0.0f;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = ulps(y[i], std::exp(static_cast<double>(x[i])));
    if (e > worst) {
      worst = e;
      worst_x = x[i];
    }
  }
  EXPECT_LE(worst, 1.0) << "at x = " << worst_x << " (" << x.size() << " values)";
}

TEST(CpuAttnExp, EdgesGiveTheSoftmaxValues) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "no AVX-512 on this CPU";
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {0.0f, -0.0f, -inf, nan, -nan, std::nextafter(kExpLowerBound, -inf), -1000.0f};
  const std::vector<float> want = {1.0f, 1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  const std::vector<float> y = exp_of(x);
  for (std::size_t i = 0; i < x.size(); ++i) EXPECT_EQ(y[i], want[i]) << "x = " << x[i];
}

}  // namespace
}  // namespace pagedattn::cpu_attn
#endif
