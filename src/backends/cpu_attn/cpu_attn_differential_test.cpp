// Differential check: many small random problems through every ISA of
// CPU_ATTN against REFERENCE, under the conformance tolerance table. Each
// problem comes from its own fixed seed; a failure names the seed and the
// problem, so it can be rerun alone.
#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"

namespace pagedattn {
namespace {

using cpu_attn_test::for_each_isa;
using cpu_attn_test::LayerSpec;
using cpu_attn_test::PagedProblem;

const CpuAttnBackend kBackend;

constexpr std::uint32_t kProblems = 400;
// Query-key pairs x query heads x head size per problem: small enough for
// REFERENCE's double loops, large enough for several key tiles.
constexpr double kMaxWork = 3e6;

// Query heads per KV head, large groups and MQA included, and KV heads.
constexpr std::array kGroups{1, 2, 4, 5, 8, 16, 17, 32, 48, 64};
constexpr std::array kKvHeads{1, 1, 2, 4};
constexpr int kMaxHeads = 64;
// Multiples of 8 (CPU_ATTN's rule): lane-count remainders on every target,
// the grid's sizes and the sizes of real models.
constexpr std::array kHeadSizes{8, 16, 24, 40, 48, 64, 72, 80, 88, 96, 112, 128, 192, 256};
constexpr std::array kBlockSizes{1, 8, 16, 32, 48, 128};
constexpr std::array kDTypes{DType::F32, DType::F16, DType::BF16};
constexpr std::array kCaches{CacheDType::Auto, CacheDType::Auto, CacheDType::Fp8E4M3, CacheDType::Fp8E5M2,
                             CacheDType::Fp8};
constexpr int kMaxRequests = 4;
constexpr int kMaxKeys = 300;
constexpr int kMaxPrefillTokens = 40;
// Windows up to this many keys; soft caps in [kMinSoftCap, + kSoftCapSpan),
// under a scale that makes them bite (scores of standard deviation sqrt(D)).
constexpr int kMaxWindow = 100;
constexpr float kMinSoftCap = 5.0f;
constexpr int kSoftCapSpan = 40;
constexpr float kSoftCapScale = 1.0f;

class Draw {
 public:
  explicit Draw(std::uint32_t seed) : rng_(seed) {}
  // Uniform in [0, n) from the generator's raw output (portable, unlike the
  // standard distributions).
  int below(int n) { return static_cast<int>(rng_() % static_cast<std::uint32_t>(n)); }
  int in(int lo, int hi) { return lo + below(hi - lo + 1); }
  bool chance(int percent) { return below(100) < percent; }
  template <class T, std::size_t N>
  T pick(const std::array<T, N>& values) {
    return values[static_cast<std::size_t>(below(static_cast<int>(N)))];
  }

 private:
  std::mt19937 rng_;
};

LayerSpec random_layer(Draw& draw) {
  LayerSpec spec;
  const int group = draw.pick(kGroups);
  spec.kv_heads = draw.pick(kKvHeads);
  if (group * spec.kv_heads > kMaxHeads) spec.kv_heads = 1;
  spec.heads = group * spec.kv_heads;
  spec.head_size = draw.pick(kHeadSizes);
  spec.block_size = draw.pick(kBlockSizes);
  spec.dtype = draw.pick(kDTypes);
  spec.cache = draw.pick(kCaches);
  spec.per_head_scales = is_quantized_kv_cache(spec.cache) && draw.chance(50);
  spec.layout = draw.chance(50) ? KVCacheLayout::NHD : KVCacheLayout::HND;
  spec.causal = !draw.chance(10);
  if (draw.chance(25)) spec.window = draw.in(1, kMaxWindow);
  if (draw.chance(20)) {
    spec.soft_cap = kMinSoftCap + static_cast<float>(draw.below(kSoftCapSpan));
    spec.scale = kSoftCapScale;
  }
  spec.alibi = draw.chance(20);
  spec.sinks = draw.chance(25);
  return spec;
}

// A decode, a speculative step, a prefill after a context, or a fresh prompt;
// now and then a decode-like request long enough to be split.
std::pair<int, int> random_request(Draw& draw) {
  switch (draw.below(5)) {
    case 0:
      return {1, draw.in(1, kMaxKeys)};
    case 1: {
      const int q = draw.in(2, cpu_attn::kSplitMaxQueryTokens);
      return {q, q + draw.in(0, kMaxKeys)};
    }
    case 2: {
      const int q = draw.in(cpu_attn::kSplitMaxQueryTokens + 1, kMaxPrefillTokens);
      return {q, q + draw.in(0, kMaxKeys)};
    }
    case 3: {
      const int q = draw.in(1, kMaxPrefillTokens);
      return {q, q};
    }
    default:
      return {draw.in(1, cpu_attn::kSplitMaxQueryTokens),
              draw.in(cpu_attn::kSplitKeys + 1, 2 * cpu_attn::kSplitKeys)};
  }
}

// Requests within kMaxWork for the layer (at least one).
std::vector<std::pair<int, int>> random_batch(Draw& draw, const LayerSpec& spec) {
  const double per_pair = static_cast<double>(spec.heads) * spec.head_size;
  std::vector<std::pair<int, int>> requests;
  double work = 0.0;
  const int wanted = draw.in(1, kMaxRequests);
  for (int attempt = 0; static_cast<int>(requests.size()) < wanted && attempt < 4 * kMaxRequests; ++attempt) {
    const auto request = random_request(draw);
    const double w = static_cast<double>(request.first) * request.second * per_pair;
    if (work + w > kMaxWork) continue;
    requests.push_back(request);
    work += w;
  }
  if (requests.empty())
    requests.emplace_back(1, std::clamp(static_cast<int>(kMaxWork / per_pair), 1, kMaxKeys));
  return requests;
}

TEST(CpuAttnDifferential, RandomProblemsMatchReferenceOnEveryIsa) {
  for (std::uint32_t seed = 0; seed < kProblems; ++seed) {
    Draw draw(seed);
    const LayerSpec spec = random_layer(draw);
    const PagedProblem problem(spec, random_batch(draw, spec), seed);
    try {
      const cpu_attn_test::ForwardResult want = problem.run(cpu_attn_test::reference_backend());
      for_each_isa([&](cpu_attn::Isa isa) {
        const auto failure = compare_with_reference(want, problem.run(kBackend), problem);
        EXPECT_FALSE(failure.has_value()) << "seed " << seed << " " << cpu_attn::isa_name(isa) << " "
                                          << problem.describe() << ": " << failure.value_or("");
      });
    } catch (const Error& e) {
      ADD_FAILURE() << "seed " << seed << " " << problem.describe() << ": " << e.what();
    }
  }
}

}  // namespace
}  // namespace pagedattn
