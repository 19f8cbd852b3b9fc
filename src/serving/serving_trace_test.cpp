// The synthetic trace: seeded, clipped, and every option out of range is an
// InvalidArgument naming it rather than a silently different trace.
#include "serving/serving_trace.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "serving/small_trace_test_util.h"
#include "testing/expect_error.h"

namespace pagedattn::serving {
namespace {

using test::expect_invalid;

constexpr int kSystemPrompt = test::kSmallTraceSystemPrompt;
using test::small_trace;

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

// A median at the clip puts the upper tail past INT_MAX when the clip is
// large: those draws are clipped to the clip, not wrapped to the minimum.
TEST(ServingTrace, TailDrawsBeyondIntAreClippedToTheClip) {
  TraceOptions t = small_trace(200);
  t.max_output_len = 1 << 30;
  t.output_median = t.max_output_len;
  int at_clip = 0;
  for (const TraceRequest& r : make_trace(t)) {
    EXPECT_GT(r.output_len, kMinLength);
    EXPECT_LE(r.output_len, t.max_output_len);
    at_clip += r.output_len == t.max_output_len ? 1 : 0;
  }
  EXPECT_GT(at_clip, 0);
}

TEST(ServingTrace, MediansMustBeFiniteAndWithinTheirClip) {
  for (const double median : {1e300, std::numeric_limits<double>::infinity(),
                              std::numeric_limits<double>::quiet_NaN(), 0.0, -3.0, 121.0}) {
    TraceOptions t = small_trace(4);
    t.prompt_median = median;
    expect_invalid([&] { (void)make_trace(t); }, "prompt_median must be a number in [1, 120]");
  }
  TraceOptions t = small_trace(4);
  t.output_median = 1e300;
  expect_invalid([&] { (void)make_trace(t); }, "output_median must be a number in [1, 40]");
}

TEST(ServingTrace, ArrivalsMustStayWithinIntSteps) {
  TraceOptions t = small_trace(4);
  t.arrivals_per_step = std::numeric_limits<double>::infinity();
  expect_invalid([&] { (void)make_trace(t); }, "arrivals_per_step must be finite and > 0");
  t.arrivals_per_step = 1e-12;
  expect_invalid([&] { (void)make_trace(t); }, "requests arrive within");
}

TEST(ServingTrace, RequestLengthsMustFitAnInt) {
  TraceOptions t = small_trace(4);
  t.system_prompt_len = std::numeric_limits<int>::max() - 100;
  expect_invalid([&] { (void)make_trace(t); },
                 "system_prompt_len + max_prompt_len + max_output_len must be <=");
}

}  // namespace
}  // namespace pagedattn::serving
