// A small seeded trace with a shared system prompt, for the serving tests.
#pragma once

#include "serving/serving_trace.h"

namespace pagedattn::test {

inline constexpr int kSmallTraceSystemPrompt = 32;

inline serving::TraceOptions small_trace(int num_requests) {
  serving::TraceOptions t;
  t.num_requests = num_requests;
  t.seed = 3;
  t.system_prompt_len = kSmallTraceSystemPrompt;
  t.prompt_median = 40;
  t.output_median = 12;
  t.max_prompt_len = 120;
  t.max_output_len = 40;
  t.arrivals_per_step = 2.0;
  return t;
}

}  // namespace pagedattn::test
