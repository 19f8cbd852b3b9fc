#include "serving/serving_trace.h"

#include <pagedattn/error.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pagedattn::serving {
namespace {

// ShareGPT conversations: lengths spread over about a decade around the median.
constexpr double kPromptSigma = 0.8;
constexpr double kOutputSigma = 0.7;
constexpr double kMinMedian = 1.0;
constexpr double kMaxArrivalStep = std::numeric_limits<int>::max();

// Clamped while still a double: a far tail draw converted first overflows.
int draw_length(std::mt19937& rng, double median, double sigma, int max_len) {
  std::lognormal_distribution<double> dist(std::log(median), sigma);
  return static_cast<int>(
      std::lround(std::clamp(dist(rng), static_cast<double>(kMinLength), static_cast<double>(max_len))));
}

void check_median(double median, int max_len, const char* where, std::string_view name) {
  // Negated so NaN fails too.
  if (!(median >= kMinMedian && median <= max_len)) {
    throw_invalid(where, name, fmt::format("a number in [{}, {}] (its clip)", kMinMedian, max_len),
                  fmt::format("{}", median));
  }
}

}  // namespace

std::vector<TraceRequest> make_trace(const TraceOptions& o) {
  constexpr const char* kWhere = "make_trace";
  check_arg(o.num_requests > 0, kWhere, "num_requests", "> 0", o.num_requests);
  check_arg(o.system_prompt_len >= 0, kWhere, "system_prompt_len", ">= 0", o.system_prompt_len);
  check_arg(o.max_prompt_len >= kMinLength, kWhere, "max_prompt_len", fmt::format(">= {}", kMinLength),
            o.max_prompt_len);
  check_arg(o.max_output_len >= kMinLength, kWhere, "max_output_len", fmt::format(">= {}", kMinLength),
            o.max_output_len);
  // A request's tokens (system prompt + user part + output) are counted in int.
  const std::int64_t longest = std::int64_t{o.system_prompt_len} + o.max_prompt_len + o.max_output_len;
  check_arg(longest <= std::numeric_limits<int>::max(), kWhere,
            "system_prompt_len + max_prompt_len + max_output_len",
            fmt::format("<= {}", std::numeric_limits<int>::max()), longest);
  check_median(o.prompt_median, o.max_prompt_len, kWhere, "prompt_median");
  check_median(o.output_median, o.max_output_len, kWhere, "output_median");
  check_arg(std::isfinite(o.arrivals_per_step) && o.arrivals_per_step > 0, kWhere, "arrivals_per_step",
            "finite and > 0", o.arrivals_per_step);
  std::mt19937 rng(o.seed);
  std::uniform_int_distribution<std::int32_t> token(0, kVocabSize - 1);
  std::exponential_distribution<double> gap(o.arrivals_per_step);
  std::vector<std::int32_t> system_prompt(static_cast<std::size_t>(o.system_prompt_len));
  for (auto& t : system_prompt) t = token(rng);

  std::vector<TraceRequest> trace;
  double arrival = 0.0;
  for (int i = 0; i < o.num_requests; ++i) {
    TraceRequest r;
    r.id = static_cast<RequestId>(i);
    if (arrival > kMaxArrivalStep) {
      throw_invalid(kWhere, "arrivals_per_step",
                    fmt::format("large enough that {} requests arrive within {} steps", o.num_requests,
                                kMaxArrivalStep),
                    fmt::format("{}", o.arrivals_per_step));
    }
    r.arrival_step = static_cast<int>(arrival);
    r.prompt = system_prompt;
    const int user_len = draw_length(rng, o.prompt_median, kPromptSigma, o.max_prompt_len);
    for (int t = 0; t < user_len; ++t) r.prompt.push_back(token(rng));
    r.output_len = draw_length(rng, o.output_median, kOutputSigma, o.max_output_len);
    trace.push_back(std::move(r));
    arrival += gap(rng);
  }
  return trace;
}

}  // namespace pagedattn::serving
