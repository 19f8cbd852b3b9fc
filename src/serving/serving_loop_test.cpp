// The serving loop end to end on a small shape: every step checked against
// the oracle, under a pool small enough to preempt and to reject.
#include "serving/serving_loop.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>
#include <pagedattn/selector.h>

#include "serving/serving_trace.h"
#include "serving/small_trace_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::serving {
namespace {

using test::expect_invalid;

constexpr int kBlockSize = 16;
using test::small_trace;

ServingOptions small_model(int num_kv_blocks) {
  ServingOptions o;
  o.layers = 2;
  o.heads = 4;
  o.kv_heads = 2;
  o.head_size = 32;
  o.dtype = DType::BF16;
  o.block_size = kBlockSize;
  o.num_kv_blocks = num_kv_blocks;
  o.token_budget = 64;
  o.max_num_seqs = 8;
  o.check_every = 1;
  o.seed = 5;
  return o;
}

const AttentionBackend& reference_backend(const ServingOptions& o) {
  SelectorConfig cfg;
  cfg.head_size = o.head_size;
  cfg.dtype = o.dtype;
  cfg.block_size = o.block_size;
  return select_backend(cfg, "REFERENCE");
}

ServingStats run_to_end(ServingLoop& loop) {
  while (loop.step()) {
  }
  return loop.stats();
}

TEST(ServingLoop, PreemptsUnderMemoryPressureAndStaysCorrect) {
  const ServingOptions o = small_model(20);  // 19 usable blocks = 304 slots
  ServingLoop loop(o, reference_backend(o), make_trace(small_trace(16)));
  const ServingStats s = run_to_end(loop);
  EXPECT_EQ(s.finished, 16);
  EXPECT_EQ(s.rejected, 0);
  EXPECT_GT(s.preemptions, 0);
  EXPECT_GT(s.prefix_hit_rate, 0.0);
  EXPECT_GT(s.checks_passed, 0);
  EXPECT_EQ(s.checks_failed, 0) << (s.messages.empty() ? "" : s.messages.front());
  EXPECT_LE(s.peak_kv_usage, 1.0);
  EXPECT_EQ(loop.kv_usage(), 0.0);  // everything freed at the end
}

TEST(ServingLoop, RejectsRequestsLargerThanThePool) {
  const ServingOptions o = small_model(6);  // 5 usable blocks = 80 tokens
  ServingLoop loop(o, reference_backend(o), make_trace(small_trace(12)));
  const ServingStats s = run_to_end(loop);
  EXPECT_GT(s.rejected, 0);
  EXPECT_EQ(s.finished + s.rejected, 12);
  EXPECT_EQ(s.checks_failed, 0) << (s.messages.empty() ? "" : s.messages.front());
  ASSERT_FALSE(s.messages.empty());
  EXPECT_NE(s.messages.front().find("rejected"), std::string::npos);
}

TEST(ServingLoop, RejectsBadOptionsBeforeSizingAnything) {
  ServingOptions o = small_model(8);
  const AttentionBackend& backend = reference_backend(o);
  o.block_size = 0;
  expect_invalid([&] { ServingLoop loop(o, backend, make_trace(small_trace(1))); },
                 "block_size must be >= 1");
  o = small_model(8);
  o.heads = 1 << 20;
  o.head_size = 1 << 12;  // (H + 2 Hkv) * D overflows an int
  expect_invalid([&] { ServingLoop loop(o, backend, make_trace(small_trace(1))); },
                 "(heads + 2 * kv_heads) * head_size must be <=");
  o = small_model(1 << 20);
  o.block_size = 1 << 12;  // num_kv_blocks * block_size overflows an int
  expect_invalid([&] { ServingLoop loop(o, backend, make_trace(small_trace(1))); },
                 "num_kv_blocks * block_size must be <=");
  o.block_size = 1 << 10;  // 2^30 slots of 2 x 32 values, two layers: terabytes
  test::expect_error(
      ErrorKind::OutOfMemory, [&] { ServingLoop loop(o, backend, make_trace(small_trace(1))); },
      "GiB of memory");
}

TEST(ServingLoop, PrefixCachingOffStillCorrect) {
  ServingOptions o = small_model(64);
  o.prefix_caching = false;
  ServingLoop loop(o, reference_backend(o), make_trace(small_trace(8)));
  const ServingStats s = run_to_end(loop);
  EXPECT_EQ(s.finished, 8);
  EXPECT_EQ(s.prefix_hit_rate, 0.0);
  EXPECT_EQ(s.checks_failed, 0);
  EXPECT_LT(s.kv_waste(), 1.0);
}

}  // namespace
}  // namespace pagedattn::serving
