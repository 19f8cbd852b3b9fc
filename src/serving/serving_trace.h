// The synthetic request trace of `pagedattn run`: seeded, with ShareGPT-like
// log-normal prompt and output lengths, Poisson arrivals (in steps), and an
// optional system prompt shared by every request so prefix caching hits.
#pragma once

#include <pagedattn/kv_cache_manager.h>

#include <cstdint>
#include <vector>

namespace pagedattn::serving {

// Token ids are drawn from the Llama-3 vocabulary.
inline constexpr std::int32_t kVocabSize = 128256;
// The shortest user prompt and output a request gets.
inline constexpr int kMinLength = 4;

struct TraceOptions {
  int num_requests = 0;
  std::uint32_t seed = 0;
  int system_prompt_len = 0;  // 0 = no shared system prompt
  double prompt_median = 0;   // of the user part, in tokens, in [1, max_prompt_len]
  double output_median = 0;   // in [1, max_output_len]
  int max_prompt_len = 0;     // clip of the user part, >= kMinLength
  int max_output_len = 0;     // >= kMinLength
  double arrivals_per_step = 0;  // Poisson rate, finite and positive
};

struct TraceRequest {
  RequestId id = 0;
  int arrival_step = 0;
  std::vector<std::int32_t> prompt;  // system prompt + user part
  int output_len = 0;
};

// Throws InvalidArgument on non-positive counts or rates, medians outside
// [1, their clip], and arrivals past the int range of steps.
std::vector<TraceRequest> make_trace(const TraceOptions& options);

}  // namespace pagedattn::serving
