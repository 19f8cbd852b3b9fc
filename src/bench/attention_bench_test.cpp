#include "bench/attention_bench.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include "testing/expect_error.h"

namespace pagedattn::bench {
namespace {

BenchConfig small_config(std::string spec) {
  BenchConfig c;
  c.spec = std::move(spec);
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_size = 64;
  c.warmup = 1;
  c.repeats = 3;
  c.check_rows = 4;
  return c;
}

TEST(AttentionBenchTest, ChecksThenReportsFigures) {
  const BenchResult r = run_attention_bench(small_config("2q1s300_q40"));
  ASSERT_TRUE(r.check_passed) << r.check_message;
  EXPECT_EQ(r.spec, "2q1s300_q40");
  EXPECT_EQ(r.num_reqs, 3);
  EXPECT_EQ(r.num_tokens, 42);
  EXPECT_EQ(r.checked_rows, 4);
  // Visible pairs: two decodes see 300 keys each; the causal prompt 40 * 41 / 2.
  EXPECT_DOUBLE_EQ(r.flops, 4.0 * (2 * 300 + 40 * 41 / 2) * 4 * 64);
  // K and V of every key once (bf16) + q + out.
  EXPECT_DOUBLE_EQ(r.bytes, (2 * 300 + 40) * 2 * 64 * 2.0 * 2 + 2.0 * 42 * 4 * 64 * 2);
  EXPECT_GT(r.median_ms, 0.0);
  EXPECT_GE(r.median_ms, r.min_ms);
  EXPECT_GT(r.tflop_per_s, 0.0);
}

TEST(AttentionBenchTest, Fp8KvIsCheckedToo) {
  BenchConfig c = small_config("q1s200");
  c.kv_cache_dtype = CacheDType::Fp8E4M3;
  const BenchResult r = run_attention_bench(c);
  EXPECT_TRUE(r.check_passed) << r.check_message;
}

// The batch-invariant plan (a split decode and a prefill) is checked and timed too.
TEST(AttentionBenchTest, BatchInvariantPlansAreCheckedToo) {
  BenchConfig c = small_config("q1s5000_q40");
  c.batch_invariant = true;
  check_bench_config(c);
  const BenchResult r = run_attention_bench(c);
  EXPECT_TRUE(r.check_passed) << r.check_message;
  EXPECT_GT(r.median_ms, 0.0);
}

TEST(AttentionBenchTest, TimesSeveralConfigsSideBySide) {
  BenchConfig fp8 = small_config("2q1s300");
  fp8.kv_cache_dtype = CacheDType::Fp8E4M3;
  const std::vector<BenchResult> r = run_attention_benches({small_config("2q1s300"), fp8});
  ASSERT_EQ(r.size(), 2u);
  for (const BenchResult& one : r) {
    ASSERT_TRUE(one.check_passed) << one.check_message;
    EXPECT_GT(one.median_ms, 0.0);
  }
  // The same keys, half the KV bytes; q and out (2 tokens x 4 heads x 64, bf16) alike.
  constexpr double kQueryAndOutputBytes = 2.0 * 2 * 4 * 64 * 2;
  EXPECT_DOUBLE_EQ(r[0].flops, r[1].flops);
  EXPECT_DOUBLE_EQ(r[0].bytes - kQueryAndOutputBytes, 2.0 * (r[1].bytes - kQueryAndOutputBytes));
}

TEST(AttentionBenchTest, RunsTheHookOnceAfterEachRoundOfRepeats) {
  BenchConfig fp8 = small_config("q1s200");
  fp8.kv_cache_dtype = CacheDType::Fp8E4M3;
  int calls = 0;
  const std::vector<BenchResult> r = run_attention_benches({small_config("q1s200"), fp8}, [&] { ++calls; });
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(calls, fp8.repeats);  // after each round of both configs, not per config or per warmup
}

TEST(AttentionBenchTest, SideBySideConfigsShareTheirRepeats) {
  BenchConfig more = small_config("q1s200");
  more.repeats = 4;
  EXPECT_THROW(run_attention_benches({small_config("q1s200"), more}), Error);
  EXPECT_THROW(run_attention_benches({}), Error);
}

TEST(AttentionBenchTest, RejectsABadShapeBeforeDividingByIt) {
  BenchConfig c = small_config("q1");
  c.block_size = 0;
  test::expect_invalid([&] { (void)run_attention_bench(c); }, "block_size must be >= 1, got 0");
  test::expect_invalid([&] { check_bench_config(c); }, "block_size must be >= 1, got 0");
  c = small_config("q1");
  c.num_kv_heads = -1;
  test::expect_invalid([&] { (void)run_attention_bench(c); }, "num_kv_heads must be >= 1, got -1");
}

// Lengths near INT_MAX: the sums and block counts are formed in 64 bits and
// checked, and a workload beyond the machine's memory is an OutOfMemory
// naming its size, before anything of that size is allocated.
TEST(AttentionBenchTest, SizesHugeSpecsWithoutOverflow) {
  const BenchConfig huge = small_config("q2147483647");
  test::expect_error(
      ErrorKind::OutOfMemory, [&] { (void)run_attention_bench(huge); }, "spec q2147483647 needs about");
  test::expect_error(
      ErrorKind::OutOfMemory, [&] { check_bench_config(huge); }, "GiB of memory");
  BenchConfig blocks = small_config("2q1s2147483647");
  blocks.block_size = 1;
  test::expect_invalid([&] { check_bench_config(blocks); }, "at most 2147483646 KV blocks of 1 tokens");
  test::expect_invalid([&] { check_bench_config(small_config("2q2147483647")); },
                       "total query tokens must be <= 2147483647");
}

TEST(AttentionBenchTest, RejectsAnUnknownBackend) {
  BenchConfig c = small_config("q8");
  c.backend = "NO_SUCH_BACKEND";
  EXPECT_THROW(run_attention_bench(c), Error);
  EXPECT_THROW(check_bench_config(c), Error);
}

}  // namespace
}  // namespace pagedattn::bench
