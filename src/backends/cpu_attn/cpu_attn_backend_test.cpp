#include "backends/cpu_attn/cpu_attn_backend.h"

#include <gtest/gtest.h>
#include <pagedattn/conformance.h>
#include <pagedattn/metadata.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/backend/scalar.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <utility>
#include <vector>

#include "backends/cpu_attn/cpu_attn_plan.h"
#include "backends/cpu_attn/cpu_attn_test_problem.h"
#include "backends/cpu_attn/kernels/cpu_attn_dispatch.h"
#include "backends/cpu_attn/kernels/cpu_attn_isa.h"
#include "backends/cpu_attn/thread_pool.h"
#include "testing/normal_tensors.h"
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

namespace pagedattn {
namespace {

const CpuAttnBackend kBackend;

using cpu_attn_test::bf16_layer;
using cpu_attn_test::for_each_isa;


TEST(CpuAttnBackendTest, CapabilitiesAndReasons) {
  SelectorConfig cfg;
  cfg.head_size = 128;
  cfg.dtype = DType::BF16;
  cfg.kv_cache_dtype = CacheDType::Fp8E5M2;
  cfg.block_size = 48;
  cfg.has_sink = true;
  cfg.use_per_head_quant_scales = true;
  cfg.use_non_causal = true;
  cfg.use_batch_invariant = true;
  cfg.attn_type = AttentionType::EncoderDecoder;
  EXPECT_TRUE(kBackend.validate_configuration(cfg).empty());
  cfg.head_size = 12;
  const auto reasons = kBackend.validate_configuration(cfg);
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_EQ(reasons[0], "head_size not supported");
  EXPECT_EQ(*kBackend.head_size_rule(12), "head_size must be a positive multiple of 8, got 12");
  EXPECT_FALSE(kBackend.head_size_rule(40).has_value());
}

TEST(CpuAttnBackendTest, AutoSelectedFirstOnTheCpu) {
  BackendRegistry registry;
  register_cpu_attn_backend(registry);
  const auto list = registry.priority_list(DeviceType::CPU);
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.front()->name(), "CPU_ATTN");
}

TEST(CpuAttnBackendTest, PlanKernelNamesTheKernelOrGivesReasons) {
  AttentionProblem problem;
  problem.num_heads = 32;
  problem.num_kv_heads = 8;
  problem.head_size = 128;
  problem.kv_storage_dtype = DType::FP8_E4M3;
  const ProblemSupport plan = kBackend.problem_support(problem);
  EXPECT_TRUE(plan.supported());
  problem.head_size = 20;
  problem.num_kv_heads = 3;
  problem.dtype = DType::I32;
  EXPECT_EQ(kBackend.problem_support(problem).reasons.size(), 3u);
}

// Every compiled ISA this CPU runs passes a slice of the conformance grid (the
// whole grid runs per ISA in CTest: conformance.CPU_ATTN.<isa>).
TEST(CpuAttnBackendTest, ConformanceSliceOnEveryIsa) {
  constexpr std::size_t kEvery = 28;  // a spread-out slice keeps the unit test quick
  const auto grid = conformance_grid();
  for_each_isa([&](cpu_attn::Isa isa) {
    for (std::size_t i = 0; i < grid.size(); i += kEvery) {
      const CaseResult r = run_conformance_case(kBackend, grid[i]);
      EXPECT_EQ(r.status, CaseStatus::Passed) << cpu_attn::isa_name(isa) << " " << grid[i].id() << ": " << r.message;
    }
  });
}

TEST(CpuAttnBackendTest, IsaNamesRoundTrip) {
  for (const cpu_attn::Isa isa : cpu_attn::compiled_isas()) {
    EXPECT_EQ(cpu_attn::parse_isa(cpu_attn::isa_name(isa)), isa);
  }
  EXPECT_FALSE(cpu_attn::parse_isa("sse9").has_value());
  EXPECT_EQ(cpu_attn::available_isas().back(), cpu_attn::Isa::Scalar);
}

// A paged decoder problem with random contents, run through the backend's
// builder and impl.
struct Problem {
  static constexpr int kHeads = 8;
  static constexpr int kKvHeads = 2;
  static constexpr int kHeadSize = 64;
  static constexpr int kBlockSize = 16;
  // Each request gets its own blocks, room for two KV splits.
  static constexpr int kBlocksPerRequest = 2 * cpu_attn::kSplitKeys / kBlockSize;
  static constexpr int kBlocks = 4 * kBlocksPerRequest;
  // A decode long enough to be split in two.
  static constexpr int kLongDecodeKeys = cpu_attn::kSplitKeys * 3 / 2;

  AttentionImplParams params;
  Tensor cache;
  KVCacheView kv;
  std::mt19937 rng{7};

  Problem() {
    params.num_heads = kHeads;
    params.num_kv_heads = kKvHeads;
    params.head_size = kHeadSize;
    params.scale = 0.125f;
    params.dtype = DType::BF16;
    params.sinks.assign(kHeads, 0.5f);
    cache = random_tensor(kBackend.kv_cache_shape(kBlocks, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto));
    kv = kBackend.unbind_kv_cache(cache);
  }

  Tensor random_tensor(const Dims& shape) {
    std::int64_t n = 1;
    for (std::int64_t s : shape) n *= s;
    std::normal_distribution<float> dist;
    std::vector<float> values(static_cast<std::size_t>(n));
    for (float& v : values) v = dist(rng);
    return Tensor::from_floats(values, shape, DType::BF16);
  }

  // (query_len, seq_len) per request; request r uses blocks
  // [r * kBlocksPerRequest, (r + 1) * kBlocksPerRequest).
  CommonAttentionMetadata metadata(const std::vector<std::pair<int, int>>& requests, int first_block_set = 0) {
    std::vector<RequestSpec> specs;
    for (std::size_t r = 0; r < requests.size(); ++r) {
      RequestSpec spec{requests[r].first, requests[r].second, {}};
      const int base = (first_block_set + static_cast<int>(r)) * kBlocksPerRequest;
      for (int b = 0; b < kBlocksPerRequest; ++b) spec.blocks.push_back(base + b);
      specs.push_back(spec);
    }
    MetadataOptions options;
    options.block_size = kBlockSize;
    return make_common_metadata(specs, options);
  }

  static BuilderParams builder_params() {
    return cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads);
  }

  // Output [T, H, D] of `query` ([T, H, D]) attended under `common` over
  // `cache` (this problem's bf16 cache by default).
  Tensor forward(const CommonAttentionMetadata& common, const Tensor& query,
                 const KVCacheView* cache = nullptr, const LayerQuantState& layer = {}) const {
    const auto md = kBackend.make_builder(builder_params())->build(common);
    Tensor out = Tensor::zeros({query.size(0), kHeads, kHeadSize}, DType::BF16);
    kBackend.make_impl(params)->forward(layer, query, {}, {}, cache != nullptr ? *cache : kv, *md, out, {});
    return out;
  }

  std::vector<std::uint8_t> run(const CommonAttentionMetadata& common, const Tensor& query) const {
    return to_byte_vector(forward(common, query));
  }
};

// An fp8 e4m3 cache for Problem, K and V zero, unit scales.
struct E4m3Cache {
  Tensor cache;
  KVCacheView kv;
  LayerQuantState layer;

  E4m3Cache() {
    cache = Tensor::zeros(kBackend.kv_cache_shape(Problem::kBlocks, Problem::kBlockSize, Problem::kKvHeads,
                                                  Problem::kHeadSize, CacheDType::Fp8E4M3),
                          DType::FP8_E4M3);
    kv = kBackend.unbind_kv_cache(cache);
    layer.k_scale = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
    layer.v_scale = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
  }

  // The element of `part` (key or value) at token t (request 0: blocks 0, 1, ...).
  static std::uint8_t& at(const TensorView& part, int t, int kv_head, int dim) {  // [NB, BS, Hkv, D]
    auto* base = static_cast<std::uint8_t*>(part.data());
    return base[t / Problem::kBlockSize * part.stride(0) + t % Problem::kBlockSize * part.stride(1) +
                kv_head * part.stride(2) + dim * part.stride(3)];
  }

  // Output of `query` ([T, H, D]) under `common` over this cache, as floats.
  std::vector<float> forward(const Problem& pr, const CommonAttentionMetadata& common,
                             const Tensor& query) const {
    return to_float_vector(pr.forward(common, query, &kv, layer));
  }
};

// Split-KV decodes and tiled prefills give the same bits for any thread count,
// on every ISA. One thread leaves few enough decode items that each covers
// both KV heads (the plan's minimum is 4 per thread: 4 key pieces x 1 head
// group); three threads keep one KV head per item.
TEST(CpuAttnBackendTest, BitwiseIdenticalForAnyThreadCount) {
  Problem pr;
  const auto common = pr.metadata({{1, Problem::kLongDecodeKeys}, {37, 500}, {1, 90}, {1, 300}});
  const Tensor query = pr.random_tensor({40, Problem::kHeads, Problem::kHeadSize});
  for_each_isa([&](cpu_attn::Isa isa) {
    cpu_attn::ThreadPool::reset_instance(1);
    const auto one = pr.run(common, query);
    cpu_attn::ThreadPool::reset_instance(3);
    const auto three = pr.run(common, query);
    EXPECT_EQ(one, three) << cpu_attn::isa_name(isa);
  });
  cpu_attn::ThreadPool::reset_instance(2);
}

// A request's output does not depend on the other requests of the batch.
TEST(CpuAttnBackendTest, BatchInvariant) {
  Problem pr;
  const Tensor query = pr.random_tensor({30, Problem::kHeads, Problem::kHeadSize});
  const Tensor last_row = Tensor(query, query.TensorView::slice(0, 29, 30)).clone();
  // The decode alone (its blocks are set 1, as in the batch).
  const auto alone = pr.run(pr.metadata({{1, Problem::kLongDecodeKeys}}, 1), last_row);
  const auto batched = pr.run(pr.metadata({{29, 300}, {1, Problem::kLongDecodeKeys}}), query);
  const std::size_t row_bytes = Problem::kHeads * Problem::kHeadSize * sizeof(std::uint16_t);
  ASSERT_EQ(alone.size(), row_bytes);
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), batched.end() - static_cast<std::ptrdiff_t>(row_bytes)));
}

// The e4m3 NaN code in one cached V element makes that output element NaN for
// the rows that see it, on every ISA (the AVX2 decode path converts tiles
// without the code the cheap way and must notice it); the rest stays finite.
TEST(CpuAttnBackendTest, E4m3NanCodeInTheCacheGivesNaN) {
  constexpr std::uint8_t kE4m3Nan = 0x7F;
  constexpr int kNanBlock = 3;  // a block of request 0
  constexpr int kNanSlot = 5;
  constexpr int kNanDim = 17;
  constexpr int kTokens = 21;
  Problem pr;
  pr.params.kv_cache_dtype = CacheDType::Fp8E4M3;
  E4m3Cache c;
  E4m3Cache::at(c.kv.value, kNanBlock * Problem::kBlockSize + kNanSlot, 0, kNanDim) = kE4m3Nan;
  const Tensor query = pr.random_tensor({kTokens, Problem::kHeads, Problem::kHeadSize});
  const auto common = pr.metadata({{1, Problem::kLongDecodeKeys}, {kTokens - 1, 300}});
  for_each_isa([&](cpu_attn::Isa isa) {
    const std::vector<float> o = c.forward(pr, common, query);
    for (std::size_t i = 0; i < o.size(); ++i) {
      const auto head = static_cast<int>(i / Problem::kHeadSize % Problem::kHeads);
      const bool sees_nan = i < Problem::kHeads * Problem::kHeadSize &&  // token 0, the decode of request 0
                            head < Problem::kHeads / Problem::kKvHeads && i % Problem::kHeadSize == kNanDim;
      ASSERT_EQ(std::isnan(o[i]), sees_nan) << cpu_attn::isa_name(isa) << " element " << i;
    }
  });
}

float e4m3_value(std::uint8_t code) { return load_as_float(&code, DType::FP8_E4M3); }

// Every finite e4m3 code read as V comes out exact, on every ISA: a V column
// holding one code for all keys, under uniform attention (zero query), is
// that code's value, which bf16 holds exactly. (The AVX2 decode reads e4m3 as
// float bits, its subnormals as float subnormals.)
void expect_e4m3_values_exact() {
  constexpr int kKeys = 256;
  constexpr int kCodesPerRun = Problem::kKvHeads * Problem::kHeadSize;
  constexpr std::uint8_t kMagnitude = 0x7F;  // the NaN code's magnitude bits
  Problem pr;
  pr.params.kv_cache_dtype = CacheDType::Fp8E4M3;
  pr.params.sinks.clear();
  E4m3Cache c;
  const Tensor query = Tensor::zeros({1, Problem::kHeads, Problem::kHeadSize}, DType::BF16);
  const auto common = pr.metadata({{1, kKeys}});
  for (int first_code = 0; first_code < 256; first_code += kCodesPerRun) {
    const auto code_of = [&](int kv_head, int dim) {
      const int code = first_code + kv_head * Problem::kHeadSize + dim;
      return static_cast<std::uint8_t>((code & kMagnitude) == kMagnitude ? 0 : code);
    };
    for (int t = 0; t < kKeys; ++t) {
      for (int h = 0; h < Problem::kKvHeads; ++h) {
        for (int e = 0; e < Problem::kHeadSize; ++e) E4m3Cache::at(c.kv.value, t, h, e) = code_of(h, e);
      }
    }
    for_each_isa([&](cpu_attn::Isa isa) {
      const std::vector<float> o = c.forward(pr, common, query);
      for (int head = 0; head < Problem::kHeads; ++head) {
        const int kv_head = head / (Problem::kHeads / Problem::kKvHeads);
        for (int e = 0; e < Problem::kHeadSize; ++e) {
          ASSERT_EQ(o[head * Problem::kHeadSize + e], e4m3_value(code_of(kv_head, e)))
              << cpu_attn::isa_name(isa) << " code " << int{code_of(kv_head, e)};
        }
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CpuAttnBackendTest, E4m3ValuesReadExactly) { expect_e4m3_values_exact(); }

#if defined(__x86_64__)
// The same with flush-to-zero and denormals-are-zero set on the calling
// thread (torch.set_flush_denormal(True)), which runs the items itself with a
// one-thread pool: the kernels run under the IEEE defaults.
TEST(CpuAttnBackendTest, E4m3ValuesReadExactlyUnderFlushToZero) {
  constexpr unsigned kFlushToZeroAndDenormalsAreZero = 0x8040;
  const unsigned saved = _mm_getcsr();
  cpu_attn::ThreadPool::reset_instance(1);
  _mm_setcsr(saved | kFlushToZeroAndDenormalsAreZero);
  expect_e4m3_values_exact();
  const unsigned after = _mm_getcsr();
  _mm_setcsr(saved);
  cpu_attn::ThreadPool::reset_instance(2);
  EXPECT_EQ(after & kFlushToZeroAndDenormalsAreZero, kFlushToZeroAndDenormalsAreZero);
}
#endif

// The e4m3 codes of exponent field 0 and 1 (subnormals, smallest normals),
// both signs, read as K: key t holds code t's value in dimension 0 and V is
// one-hot at dimension t, so output dimension t is key t's attention weight,
// compared with the weights computed in double from the exact values.
TEST(CpuAttnBackendTest, E4m3SmallCodesScoreExactly) {
  constexpr int kSmallCodes = 16;  // 0x00-0x0F, then their negatives 0x80-0x8F
  constexpr int kKeys = 2 * kSmallCodes;
  constexpr std::uint8_t kSign = 0x80;
  constexpr std::uint8_t kOne = 0x38;  // 1.0
  // Scores of up to ~8 (q = 2048 times scale 1/8, keys below 2^-5).
  constexpr float kQuery = 2048.0f;
  constexpr double kRelTol = 1e-2;  // the bf16 output
  Problem pr;
  pr.params.kv_cache_dtype = CacheDType::Fp8E4M3;
  pr.params.sinks.clear();
  E4m3Cache c;
  std::vector<double> score(kKeys);
  for (int t = 0; t < kKeys; ++t) {
    const auto code = static_cast<std::uint8_t>(t < kSmallCodes ? t : kSign | (t - kSmallCodes));
    for (int h = 0; h < Problem::kKvHeads; ++h) {
      E4m3Cache::at(c.kv.key, t, h, 0) = code;
      E4m3Cache::at(c.kv.value, t, h, t) = kOne;
    }
    score[static_cast<std::size_t>(t)] = double{kQuery} * pr.params.scale * e4m3_value(code);
  }
  const double top = *std::max_element(score.begin(), score.end());
  double sum = 0.0;
  for (const double s : score) sum += std::exp(s - top);
  std::vector<float> q(static_cast<std::size_t>(Problem::kHeads) * Problem::kHeadSize, 0.0f);
  for (int head = 0; head < Problem::kHeads; ++head)
    q[static_cast<std::size_t>(head) * Problem::kHeadSize] = kQuery;
  const Tensor query = Tensor::from_floats(q, {1, Problem::kHeads, Problem::kHeadSize}, DType::BF16);
  const auto common = pr.metadata({{1, kKeys}});
  for_each_isa([&](cpu_attn::Isa isa) {
    const std::vector<float> o = c.forward(pr, common, query);
    for (int head = 0; head < Problem::kHeads; ++head) {
      for (int t = 0; t < kKeys; ++t) {
        const double weight = std::exp(score[static_cast<std::size_t>(t)] - top) / sum;
        EXPECT_NEAR(o[head * Problem::kHeadSize + t], weight, weight * kRelTol)
            << cpu_attn::isa_name(isa) << " head " << head << " key " << t;
      }
    }
  });
}

// A NaN in a cached K row makes the whole output row of every query that sees
// that key NaN, as in the oracle (its softmax weight is NaN), and nothing
// else: a decode that sees it through split-KV, and the causal prefill
// queries at or after it (the earlier ones do not see it), on every ISA.
TEST(CpuAttnBackendTest, NanKeyMakesTheRowsThatSeeItNaN) {
  constexpr std::uint16_t kBf16Nan = 0x7FC0;
  constexpr int kDecodeKeys = Problem::kLongDecodeKeys;  // request 0, split in two
  constexpr int kPrefillTokens = 20;
  constexpr int kPrefillKeys = 300;  // request 1
  constexpr int kPrefillNanKey = 290;
  constexpr int kGroup = Problem::kHeads / Problem::kKvHeads;
  Problem pr;
  pr.params.sinks.clear();
  auto* key = static_cast<std::uint16_t*>(pr.kv.key.data());  // [NB, BS, Hkv, D]
  const auto set_nan = [&](int block, int slot, int kv_head) {
    key[block * pr.kv.key.stride(0) + slot * pr.kv.key.stride(1) + kv_head * pr.kv.key.stride(2) +
        17 * pr.kv.key.stride(3)] = kBf16Nan;
  };
  set_nan(3, 5, 0);
  set_nan(Problem::kBlocksPerRequest + kPrefillNanKey / Problem::kBlockSize,
          kPrefillNanKey % Problem::kBlockSize, 1);
  const int tokens = 1 + kPrefillTokens;
  const Tensor query = pr.random_tensor({tokens, Problem::kHeads, Problem::kHeadSize});
  const auto common = pr.metadata({{1, kDecodeKeys}, {kPrefillTokens, kPrefillKeys}});
  const int first_seeing = 1 + kPrefillNanKey - (kPrefillKeys - kPrefillTokens);  // token index
  for_each_isa([&](cpu_attn::Isa isa) {
    const std::vector<float> o = to_float_vector(pr.forward(common, query));
    for (int t = 0; t < tokens; ++t) {
      for (int head = 0; head < Problem::kHeads; ++head) {
        const int kv_head = head / kGroup;
        const bool sees_nan = (t == 0 && kv_head == 0) || (t >= first_seeing && kv_head == 1);
        for (int e = 0; e < Problem::kHeadSize; ++e) {
          ASSERT_EQ(std::isnan(o[(t * Problem::kHeads + head) * Problem::kHeadSize + e]), sees_nan)
              << cpu_attn::isa_name(isa) << " token " << t << " head " << head << " element " << e;
        }
      }
    }
  });
}

// The NaN rule where tiles need masks (a partial last tile, a causal step, a
// sliding window's first tile, every tile under a soft cap): a NaN key makes
// the rows that see it NaN wherever it sits in the tile, and changes nothing
// for rows the mask hides it from. One speculative step of kQueries tokens
// (the decode tiles) over kKeys keys, the NaN in KV head 0, on every ISA.
TEST(CpuAttnBackendTest, NanKeyInAMaskedTileFollowsTheMask) {
  constexpr std::uint16_t kBf16Nan = 0x7FC0;
  constexpr int kQueries = 8;
  constexpr int kKeys = 72;    // tiles of 32: two whole, one of 8
  constexpr int kWindow = 50;  // the tokens' windows start at keys 15-22
  constexpr int kNanDim = 17;
  constexpr int kGroup = Problem::kHeads / Problem::kKvHeads;
  Problem pr;
  auto* key = static_cast<std::uint16_t*>(pr.kv.key.data());  // [NB, BS, Hkv, D]
  const auto element = [&](int k) -> std::uint16_t& {
    return key[k / Problem::kBlockSize * pr.kv.key.stride(0) + k % Problem::kBlockSize * pr.kv.key.stride(1) +
               kNanDim * pr.kv.key.stride(3)];
  };
  const Tensor query = pr.random_tensor({kQueries, Problem::kHeads, Problem::kHeadSize});
  const auto common = pr.metadata({{kQueries, kKeys}});
  const auto sees = [&](int t, int k) {
    const int position = kKeys - kQueries + t;
    return k <= position && (!pr.params.sliding_window || k > position - *pr.params.sliding_window);
  };
  // With a NaN at key k: the rows of KV head 0 NaN for the tokens that see
  // it, every other row finite.
  const auto check = [&](cpu_attn::Isa isa, const char* what, int k) {
    std::uint16_t& x = element(k);
    const std::uint16_t saved = x;
    x = kBf16Nan;
    const std::vector<float> o = to_float_vector(pr.forward(common, query));
    x = saved;
    for (int t = 0; t < kQueries; ++t) {
      for (int head = 0; head < Problem::kHeads; ++head) {
        const bool want_nan = head < kGroup && sees(t, k);
        for (int e = 0; e < Problem::kHeadSize; ++e) {
          ASSERT_EQ(std::isnan(o[(t * Problem::kHeads + head) * Problem::kHeadSize + e]), want_nan)
              << cpu_attn::isa_name(isa) << " " << what << ": NaN key " << k << " token " << t << " head "
              << head << " element " << e;
        }
      }
    }
  };
  for_each_isa([&](cpu_attn::Isa isa) {
    pr.params.logits_soft_cap.reset();
    pr.params.sliding_window.reset();
    for (int k = 2 * cpu_attn::kTileKeys; k < kKeys; ++k) check(isa, "causal partial tile", k);
    pr.params.logits_soft_cap = 30.0f;
    for (int k = cpu_attn::kTileKeys; k < kKeys; ++k) check(isa, "soft cap", k);
    pr.params.logits_soft_cap.reset();
    pr.params.sliding_window = kWindow;
    for (int k = 0; k < cpu_attn::kTileKeys; ++k) check(isa, "sliding window", k);
  });
}

#if defined(__linux__)
// NHD caches are staged a tile at a time (the rows of one KV head are 2 KiB
// apart there): the copy reads no byte past a row, also when rows are not a
// whole number of vectors (e5m2, head size 48). The V cache ends where an
// inaccessible page starts and the decode reads its last row; the output is
// bitwise the output of the same values in an HND cache, which is not staged.
TEST(CpuAttnBackendTest, StagedNhdRowsReadNothingPastTheCache) {
  constexpr int kHeads = 4;
  constexpr int kKvHeads = 2;
  constexpr int kHeadSize = 48;
  constexpr int kBlockSize = 16;
  constexpr int kBlocks = 4;
  constexpr int kKeys = kBlocks * kBlockSize;
  constexpr std::size_t kHalfBytes = std::size_t{kBlocks} * kBlockSize * kKvHeads * kHeadSize;  // one e5m2 byte each
  const auto page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t mapped = (2 * kHalfBytes + page - 1) / page * page + page;
  void* base = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(base, MAP_FAILED);
  auto* guard = static_cast<unsigned char*>(base) + mapped - page;
  ASSERT_EQ(mprotect(guard, page, PROT_NONE), 0);
  unsigned char* nhd_key = guard - 2 * kHalfBytes;  // [NB, BS, Hkv, D] each, V ending at the guard
  unsigned char* nhd_value = guard - kHalfBytes;
  std::vector<unsigned char> hnd_key(kHalfBytes);  // [NB, Hkv, BS, D]
  std::vector<unsigned char> hnd_value(kHalfBytes);
  std::mt19937 rng{11};
  constexpr int kSmallCodes = 0x40;  // e5m2 magnitudes up to 1.75 (exponent fields 0-15), both signs
  std::uniform_int_distribution<int> code(0, kSmallCodes - 1);
  std::bernoulli_distribution negative;
  for (int b = 0; b < kBlocks; ++b) {
    for (int s = 0; s < kBlockSize; ++s) {
      for (int h = 0; h < kKvHeads; ++h) {
        for (int e = 0; e < kHeadSize; ++e) {
          const std::size_t nhd = ((std::size_t{1} * b * kBlockSize + s) * kKvHeads + h) * kHeadSize + e;
          const std::size_t hnd = ((std::size_t{1} * b * kKvHeads + h) * kBlockSize + s) * kHeadSize + e;
          constexpr int kSignBit = 0x80;
          nhd_key[nhd] = hnd_key[hnd] = static_cast<unsigned char>(code(rng) | (negative(rng) ? kSignBit : 0));
          nhd_value[nhd] = hnd_value[hnd] = static_cast<unsigned char>(code(rng) | (negative(rng) ? kSignBit : 0));
        }
      }
    }
  }
  const Dims shape{kBlocks, kBlockSize, kKvHeads, kHeadSize};
  const Dims nhd_strides{kBlockSize * kKvHeads * kHeadSize, kKvHeads * kHeadSize, kHeadSize, 1};
  const Dims hnd_strides{kKvHeads * kBlockSize * kHeadSize, kHeadSize, kBlockSize * kHeadSize, 1};
  const auto view = [&](unsigned char* data, const Dims& strides) {
    return TensorView(data, DType::FP8_E5M2, Device::cpu(), shape, strides);
  };
  const KVCacheView nhd{view(nhd_key, nhd_strides), view(nhd_value, nhd_strides)};
  const KVCacheView hnd{view(hnd_key.data(), hnd_strides), view(hnd_value.data(), hnd_strides)};

  const AttentionImplParams params = bf16_layer(kHeads, kKvHeads, kHeadSize, CacheDType::Fp8E5M2);
  const BuilderParams bp = cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads);
  MetadataOptions options;
  options.block_size = kBlockSize;
  const std::vector<RequestSpec> decode{RequestSpec{1, kKeys, {0, 1, 2, 3}}};
  const auto md = kBackend.make_builder(bp)->build(make_common_metadata(decode, options));
  LayerQuantState layer;
  layer.k_scale = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
  layer.v_scale = Tensor::from_floats(std::vector<float>{1.0f}, {1}, DType::F32);
  std::normal_distribution<float> normal;
  std::vector<float> q(kHeads * kHeadSize);
  for (float& x : q) x = normal(rng);
  const Tensor query = Tensor::from_floats(q, {1, kHeads, kHeadSize}, DType::BF16);
  const auto run = [&](const KVCacheView& kv) {
    Tensor out = Tensor::zeros({1, kHeads, kHeadSize}, DType::BF16);
    kBackend.make_impl(params)->forward(layer, query, {}, {}, kv, *md, out, {});
    return to_byte_vector(out);
  };
  for_each_isa([&](cpu_attn::Isa isa) { EXPECT_EQ(run(nhd), run(hnd)) << cpu_attn::isa_name(isa); });
  munmap(base, mapped);
}
#endif

TEST(CpuAttnBackendTest, RejectsBadArgumentsBeforeWriting) {
  Problem pr;
  const auto common = pr.metadata({{2, 20}});
  auto md = kBackend.make_builder(Problem::builder_params())->build(common);
  auto impl = kBackend.make_impl(pr.params);
  Tensor out = Tensor::zeros({2, Problem::kHeads, Problem::kHeadSize}, DType::BF16);
  const Tensor wrong_dtype = Tensor::zeros({2, Problem::kHeads, Problem::kHeadSize}, DType::F32);
  try {
    impl->forward(LayerQuantState{}, wrong_dtype, {}, {}, pr.kv, *md, out, {});
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("query"), std::string::npos) << e.what();
  }
  const Tensor short_lse = Tensor::zeros({Problem::kHeads, 1}, DType::F32);
  const Tensor query = pr.random_tensor({2, Problem::kHeads, Problem::kHeadSize});
  EXPECT_THROW(impl->forward(LayerQuantState{}, query, {}, {}, pr.kv, *md, out, short_lse), Error);
  const auto zeros = to_byte_vector(out);
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](std::uint8_t b) { return b == 0; }));

  AttentionImplParams bad = pr.params;
  bad.head_size = 36;
  EXPECT_THROW(kBackend.make_impl(bad), Error);
}

// The builder sizes the step's workspace from its num_heads: it needs one, and
// a layer with more query heads than the builder was told is rejected before
// anything is written.
TEST(CpuAttnBackendTest, WorkspaceFollowsTheBuilderParams) {
  BuilderParams unknown_heads = Problem::builder_params();
  unknown_heads.num_heads = 0;
  EXPECT_THROW(kBackend.make_builder(unknown_heads), Error);

  Problem pr;
  BuilderParams fewer_heads = Problem::builder_params();
  fewer_heads.num_heads = Problem::kKvHeads;
  const auto md = kBackend.make_builder(fewer_heads)->build(pr.metadata({{20, 20}, {1, Problem::kLongDecodeKeys}}));
  Tensor out = Tensor::zeros({21, Problem::kHeads, Problem::kHeadSize}, DType::BF16);
  const Tensor query = pr.random_tensor({21, Problem::kHeads, Problem::kHeadSize});
  EXPECT_THROW(kBackend.make_impl(pr.params)->forward(LayerQuantState{}, query, {}, {}, pr.kv, *md, out, {}), Error);
  const auto zeros = to_byte_vector(out);
  EXPECT_TRUE(std::all_of(zeros.begin(), zeros.end(), [](std::uint8_t b) { return b == 0; }));
}

// ---- a Keys16-packed K (kv_packing.h) ------------------------------------------------
// Which caches the backend packs, and the results on every ISA against
// REFERENCE and against the same tokens in a row-major cache (decodes split
// and not, partial groups, tiles not starting a group under a sliding window,
// prefill items).
namespace packed {

constexpr int kHeads = 8;
constexpr int kKvHeads = 2;
constexpr int kHeadSize = 64;
constexpr int kBlockSize = 32;
constexpr int kLongDecodeKeys = cpu_attn::kSplitKeys * 3 / 2;  // split in two
constexpr int kBlocksPerRequest = (kLongDecodeKeys + kBlockSize - 1) / kBlockSize;

Tensor e4m3_cache(int num_blocks, int block_size, KVCacheLayout layout) {
  Tensor t = Tensor::empty_strided_order(
      kBackend.kv_cache_shape(num_blocks, block_size, kKvHeads, kHeadSize, CacheDType::Fp8E4M3),
      kBackend.kv_cache_stride_order(layout), DType::FP8_E4M3, Device::cpu());
  fill_tensor_bits(t, 0);
  return t;
}

TEST(CpuAttnPackedKeys, PackedWhereTheActiveIsaReadsItFaster) {
  for_each_isa([&](cpu_attn::Isa isa) {
    const KeyPacking want = isa == cpu_attn::Isa::Avx512Bf16 ? KeyPacking::Keys16 : KeyPacking::None;
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, kBlockSize, KVCacheLayout::HND)).key_packing, want)
        << cpu_attn::isa_name(isa);
    // NHD rows of two heads, a block size the groups do not divide, bf16 K: never.
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, kBlockSize, KVCacheLayout::NHD)).key_packing,
              KeyPacking::None);
    EXPECT_EQ(kBackend.unbind_kv_cache(e4m3_cache(2, 8, KVCacheLayout::HND)).key_packing, KeyPacking::None);
    const Tensor bf16 =
        Tensor::zeros(kBackend.kv_cache_shape(2, kBlockSize, kKvHeads, kHeadSize, CacheDType::Auto), DType::BF16);
    EXPECT_EQ(kBackend.unbind_kv_cache(bf16).key_packing, KeyPacking::None);
  });
}

// A batch written into a row-major and a packed e4m3 HND cache.
struct PackedBatch {
  std::vector<std::pair<int, int>> requests{{1, kLongDecodeKeys}, {1, 90}, {20, 300}, {1, 16}};
  CommonAttentionMetadata common;
  Tensor query;
  LayerQuantState layer;
  Tensor row_major_storage = e4m3_cache(kBlocksPerRequest * 4, kBlockSize, KVCacheLayout::HND);
  Tensor packed_storage = e4m3_cache(kBlocksPerRequest * 4, kBlockSize, KVCacheLayout::HND);
  KVCacheView row_major;
  KVCacheView packed;

  explicit PackedBatch(const AttentionImplParams& params) {
    test::NormalTensors random(5);
    std::vector<RequestSpec> specs;
    std::vector<std::int64_t> slots;
    int tokens = 0;
    for (std::size_t r = 0; r < requests.size(); ++r) {
      RequestSpec spec{requests[r].first, requests[r].second, {}};
      for (int b = 0; b < kBlocksPerRequest; ++b) spec.blocks.push_back(static_cast<int>(r) * kBlocksPerRequest + b);
      const std::vector<std::int64_t> own = slots_for_positions(spec.blocks, kBlockSize, 0, spec.seq_len);
      slots.insert(slots.end(), own.begin(), own.end());
      tokens += spec.query_len;
      specs.push_back(spec);
    }
    MetadataOptions options;
    options.block_size = kBlockSize;
    common = make_common_metadata(specs, options);
    query = random({tokens, kHeads, kHeadSize});
    const auto positions = static_cast<std::int64_t>(slots.size());
    const Tensor key = random({positions, kKvHeads, kHeadSize});
    const Tensor value = random({positions, kKvHeads, kHeadSize});
    layer.k_scale = Tensor::from_floats(std::vector<float>{0.5f}, {1}, DType::F32);
    layer.v_scale = Tensor::from_floats(std::vector<float>{0.25f}, {1}, DType::F32);
    row_major = kBackend.unbind_kv_cache(row_major_storage);
    row_major.key_packing = KeyPacking::None;
    packed = kBackend.unbind_kv_cache(packed_storage);
    packed.key_packing = KeyPacking::Keys16;
    const auto impl = kBackend.make_impl(params);
    for (const KVCacheView* view : {&row_major, &packed}) {
      impl->do_kv_cache_update(layer, key, value, *view, Tensor::from_i64(slots, {positions}));
    }
  }

  Tensor forward(const AttentionBackend& backend, const AttentionImplParams& params, const KVCacheView& kv) const {
    const auto md =
        backend.make_builder(cpu_attn_test::builder_params(kBlockSize, kKvHeads, kHeadSize, kHeads))->build(common);
    Tensor out = Tensor::zeros({query.size(0), kHeads, kHeadSize}, DType::BF16);
    backend.make_impl(params)->forward(layer, query, {}, {}, kv, *md, out, {});
    return out;
  }
};

AttentionImplParams packed_params(std::optional<int> sliding_window) {
  AttentionImplParams params = bf16_layer(kHeads, kKvHeads, kHeadSize, CacheDType::Fp8E4M3);
  params.sliding_window = sliding_window;
  return params;
}

// Every ISA matches REFERENCE on the packed cache; off the AVX512-BF16
// decode, which reads packed groups directly, the unpacked rows give the
// row-major cache's bits. A 50-key window starts most decode tiles inside a
// group, so the AVX512-BF16 decode unpacks those.
TEST(CpuAttnPackedKeys, MatchTheOracleAndTheRowMajorCacheOnEveryIsa) {
  const AttentionBackend* oracle = BackendRegistry::instance().find("REFERENCE");
  ASSERT_NE(oracle, nullptr);
  for (const std::optional<int> window : {std::optional<int>{}, std::optional<int>{50}}) {
    const AttentionImplParams params = packed_params(window);
    const PackedBatch batch(params);
    ASSERT_NE(to_byte_vector(batch.packed.key), to_byte_vector(batch.row_major.key));
    const std::vector<float> want = to_float_vector(batch.forward(*oracle, params, batch.row_major));
    OracleOutput expected;
    expected.num_tokens = static_cast<int>(batch.query.size(0));
    expected.num_heads = kHeads;
    expected.head_size = kHeadSize;
    expected.output.assign(want.begin(), want.end());
    EXPECT_EQ(to_float_vector(batch.forward(*oracle, params, batch.packed)), want);
    for_each_isa([&](cpu_attn::Isa isa) {
      const Tensor got = batch.forward(kBackend, params, batch.packed);
      const auto failure = compare_with_oracle(expected, to_float_vector(got), {}, DType::BF16);
      EXPECT_FALSE(failure.has_value()) << cpu_attn::isa_name(isa) << ": " << failure.value_or("");
      if (isa != cpu_attn::Isa::Avx512Bf16) {
        EXPECT_EQ(to_byte_vector(got), to_byte_vector(batch.forward(kBackend, params, batch.row_major)))
            << cpu_attn::isa_name(isa);
      }
    });
  }
}

}  // namespace packed

}  // namespace
}  // namespace pagedattn
