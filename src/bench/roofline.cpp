// Highway per-target micro-kernels for the roofline (foreach_target), and the
// timing around them.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/roofline.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
// foreach_target must come first.
#include <hwy/highway.h>

#include "bench/roofline.h"

#include <cstddef>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace pagedattn::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Sums `n` floats (a multiple of 4 vectors) with four independent chains.
float SumStream(const float* HWY_RESTRICT data, std::size_t n) {
  const hn::ScalableTag<float> d;
  const std::size_t lanes = hn::Lanes(d);
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (std::size_t i = 0; i + 4 * lanes <= n; i += 4 * lanes) {
    a0 = hn::Add(a0, hn::Load(d, data + i));
    a1 = hn::Add(a1, hn::Load(d, data + i + lanes));
    a2 = hn::Add(a2, hn::Load(d, data + i + 2 * lanes));
    a3 = hn::Add(a3, hn::Load(d, data + i + 3 * lanes));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
}

// `iterations` x kChains independent FMAs per lane; returns FLOPs done. Enough
// chains to cover two FMA pipes x 4-cycle latency with room to spare.
constexpr int kChains = 12;
double FmaLoop(std::int64_t iterations, float seed, float* sink) {
  const hn::ScalableTag<float> d;
  hn::Vec<decltype(d)> acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(d, seed + static_cast<float>(c));
  const auto mul = hn::Set(d, 0.999999f);
  const auto add = hn::Set(d, 1e-7f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kChains; ++c) acc[c] = hn::MulAdd(acc[c], mul, add);
  }
  auto total = acc[0];
  for (int c = 1; c < kChains; ++c) total = hn::Add(total, acc[c]);
  *sink = hn::GetLane(total);
  return 2.0 * kChains * static_cast<double>(hn::Lanes(d)) * static_cast<double>(iterations);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace pagedattn::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <pagedattn/tensor.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "bench/median.h"

namespace pagedattn::bench {

HWY_EXPORT(SumStream);
HWY_EXPORT(FmaLoop);

namespace {

// 256 MiB: eight times the 32 MiB L3 of the reference machine, so reads come from DRAM.
constexpr std::size_t kStreamBytes = std::size_t{256} << 20;
constexpr int kRepeats = 5;
constexpr std::int64_t kFmaIterations = 20'000'000;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs body(thread) on `threads` threads at once; returns the wall time.
template <typename F>
double timed_parallel(int threads, F&& body) {
  std::vector<std::thread> pool;
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (std::thread& th : pool) th.join();
  return seconds_since(t0);
}

}  // namespace

ReadProbe::ReadProbe(int threads)
    : threads_(std::max(1, threads)),
      slice_(kStreamBytes / sizeof(float) / static_cast<std::size_t>(threads_) / 64 * 64),
      // From the library's CPU allocator, as the KV caches the benchmark reads,
      // so both get the same page size.
      storage_(Tensor::empty({static_cast<std::int64_t>(kStreamBytes / sizeof(float))}, DType::F32)),
      sums_(static_cast<std::size_t>(threads_)) {
  auto* const data = static_cast<float*>(storage_.data());
  // First touch from the reading threads' slices (pages land where they are read).
  timed_parallel(threads_, [&](int t) { std::fill_n(data + slice_ * t, slice_, 1.0f); });
}

double ReadProbe::gb_per_s() {
  const auto* const data = static_cast<const float*>(storage_.data());
  const double s = timed_parallel(threads_, [&](int t) {
    sums_[static_cast<std::size_t>(t)] = HWY_DYNAMIC_DISPATCH(SumStream)(data + slice_ * t, slice_);
  });
  return static_cast<double>(slice_) * static_cast<double>(threads_) * sizeof(float) / s / 1e9;
}

Roofline measure_roofline(ReadProbe& probe) {
  Roofline r;
  r.threads = probe.threads();
  std::vector<double> rates;
  for (int rep = 0; rep < kRepeats; ++rep) rates.push_back(probe.gb_per_s());
  r.read_gb_per_s = median_of(rates);
  std::vector<double> flops(static_cast<std::size_t>(r.threads));
  std::vector<float> sinks(static_cast<std::size_t>(r.threads));
  rates.clear();
  for (int rep = 0; rep < kRepeats; ++rep) {
    const double s = timed_parallel(r.threads, [&](int t) {
      const auto i = static_cast<std::size_t>(t);
      flops[i] = HWY_DYNAMIC_DISPATCH(FmaLoop)(kFmaIterations, static_cast<float>(t), &sinks[i]);
    });
    double total = 0.0;
    for (double f : flops) total += f;
    rates.push_back(total / s / 1e9);
  }
  r.fma_gflop_per_s = median_of(rates);
  return r;
}

}  // namespace pagedattn::bench
#endif  // HWY_ONCE
