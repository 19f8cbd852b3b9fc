// The serving loop end to end on a small shape: every step checked against
// the oracle, under a pool small enough to preempt and to reject.
#include "serving/serving_loop.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>
#include <pagedattn/selector.h>

#include <algorithm>

#include "serving/serving_trace.h"

namespace pagedattn::serving {
namespace {

constexpr int kBlockSize = 16;
constexpr int kSystemPrompt = 32;

TraceOptions small_trace(int num_requests) {
  TraceOptions t;
  t.num_requests = num_requests;
  t.seed = 3;
  t.system_prompt_len = kSystemPrompt;
  t.prompt_median = 40;
  t.output_median = 12;
  t.max_prompt_len = 120;
  t.max_output_len = 40;
  t.arrivals_per_step = 2.0;
  return t;
}

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

TEST(ServingTrace, SeededWithSharedSystemPromptAndClippedLengths) {
  const TraceOptions t = small_trace(20);
  const auto a = make_trace(t);
  const auto b = make_trace(t);
  ASSERT_EQ(a.size(), 20U);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].prompt, b[i].prompt);
    EXPECT_LE(static_cast<int>(a[i].prompt.size()), kSystemPrompt + t.max_prompt_len);
    EXPECT_LE(a[i].output_len, t.max_output_len);
    EXPECT_TRUE(std::equal(a[0].prompt.begin(), a[0].prompt.begin() + kSystemPrompt, a[i].prompt.begin()));
    if (i > 0) {
      EXPECT_GE(a[i].arrival_step, a[i - 1].arrival_step);
    }
  }
  TraceOptions bad = t;
  bad.num_requests = 0;
  EXPECT_THROW(make_trace(bad), Error);
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
