#include "serving/serving_trace.h"

#include <pagedattn/error.h>

#include <algorithm>
#include <cmath>
#include <random>

namespace pagedattn::serving {
namespace {

// ShareGPT conversations: lengths spread over about a decade around the median.
constexpr double kPromptSigma = 0.8;
constexpr double kOutputSigma = 0.7;
constexpr int kMinLen = 4;

int draw_length(std::mt19937& rng, double median, double sigma, int max_len) {
  std::lognormal_distribution<double> dist(std::log(median), sigma);
  return std::clamp(static_cast<int>(std::lround(dist(rng))), kMinLen, max_len);
}

}  // namespace

std::vector<TraceRequest> make_trace(const TraceOptions& o) {
  constexpr const char* kWhere = "make_trace";
  check_arg(o.num_requests > 0, kWhere, "num_requests", "> 0", o.num_requests);
  check_arg(o.system_prompt_len >= 0, kWhere, "system_prompt_len", ">= 0", o.system_prompt_len);
  check_arg(o.prompt_median > 0, kWhere, "prompt_median", "> 0", o.prompt_median);
  check_arg(o.output_median > 0, kWhere, "output_median", "> 0", o.output_median);
  check_arg(o.max_prompt_len >= kMinLen, kWhere, "max_prompt_len", fmt::format(">= {}", kMinLen),
            o.max_prompt_len);
  check_arg(o.max_output_len >= kMinLen, kWhere, "max_output_len", fmt::format(">= {}", kMinLen),
            o.max_output_len);
  check_arg(o.arrivals_per_step > 0, kWhere, "arrivals_per_step", "> 0", o.arrivals_per_step);
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
