// `pagedattn run`, the main job: a continuous-batching serving loop
// (serving_loop.h) over a synthetic ShareGPT-like trace on the default
// backend, with a progress line and a summary; every N-th step is checked
// against the dense fp64 oracle, and a failed check makes the exit non-zero.
#include <pagedattn/selector.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <system_error>

#include "commands.h"
#include "serving/serving_loop.h"
#include "serving/serving_trace.h"

namespace pagedattn::cli {
namespace {

using serving::make_trace;
using serving::ServingLoop;
using serving::ServingOptions;
using serving::ServingStats;
using serving::TraceOptions;

struct RunOptions {
  // Four layers of Llama-3-8B's attention shape (of its 32): a model-shaped
  // stack that still finishes in well under a minute on a 2-core machine.
  int layers = 4;
  int heads = 32;
  int kv_heads = 8;
  int head_size = 128;
  std::string dtype = "bf16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  int requests = 48;
  int kv_blocks = 480;  // tight enough that some seeds preempt
  int token_budget = 256;
  int max_num_seqs = 32;
  int check_every = 8;
  int system_prompt = 64;  // shared system prompt tokens; 0 = none
  bool no_prefix_caching = false;
  double prompt_median = 200;
  double output_median = 150;
  int max_prompt = 1024;
  int max_output = 512;
  double arrival_rate = 0.5;  // requests per step
  std::string backend = "auto";
  std::uint32_t seed = 0;
  std::string json;
};

// Bounds of the options: far beyond a useful run on one machine, low enough
// that the trace and the loop's sizes stay far from overflow.
constexpr int kMaxLayers = 1024;
constexpr int kMaxRequests = 1 << 16;
constexpr int kMaxKvBlocks = 1 << 20;
constexpr int kMaxTokens = 1 << 20;  // any one length option, and the token budget
constexpr double kMinMedian = 1.0;
constexpr double kMinArrivalRate = 1e-3;
constexpr double kMaxArrivalRate = 1e6;

constexpr int kBarWidth = 30;
constexpr double kRedrawSeconds = 0.1;
constexpr int kPlainEverySteps = 100;
constexpr double kPercent = 100.0;

const AttentionBackend& choose_backend(const RunOptions& o, const SelectorConfig& cfg, std::string& how) {
  if (o.backend != "auto") {
    how = "requested";
    return select_backend(cfg, o.backend);
  }
  const SelectionReport report = explain_selection(cfg);
  if (report.chosen != nullptr) {
    how = "selected automatically";
    return *report.chosen;
  }
  // Nothing on the device's priority list fits: say so, and run the oracle
  // backend by name rather than failing the main job.
  how = fmt::format("no auto-selectable backend fits ({}); REFERENCE requested instead",
                    format_verdicts(report.verdicts));
  return select_backend(cfg, "REFERENCE");
}

class ProgressDisplay {
 public:
  explicit ProgressDisplay(int total) : total_(total), tty_(isatty(fileno(stdout)) != 0) {}

  // `final_state` redraws the bar regardless of the redraw interval.
  void update(const ServingLoop& loop, bool final_state = false) {
    const ServingStats& s = loop.stats();
    const auto now = std::chrono::steady_clock::now();
    if (tty_) {
      if (!final_state && std::chrono::duration<double>(now - last_).count() < kRedrawSeconds) return;
      last_ = now;
      const int done = s.finished + s.rejected;
      const int filled = total_ == 0 ? kBarWidth : done * kBarWidth / total_;
      fmt::print(
          "\r[{}{}] step {:5} | {:3}/{} done, {:2} running, {:2} waiting | {:7.0f} tok/s | KV {:5.1f}%  ",
          std::string(static_cast<std::size_t>(filled), '#'),
          std::string(static_cast<std::size_t>(kBarWidth - filled), '.'), s.steps, done, total_,
          loop.num_running(), loop.num_waiting(), tokens_per_second(s), loop.kv_usage() * kPercent);
      std::fflush(stdout);
    } else if (s.steps > 0 && s.steps % kPlainEverySteps == 0 && s.steps != last_step_) {
      last_step_ = s.steps;
      fmt::print("step {}: {}/{} done, {} running, {} waiting, {:.0f} tok/s, KV {:.1f}%\n", s.steps,
                 s.finished + s.rejected, total_, loop.num_running(), loop.num_waiting(),
                 tokens_per_second(s), loop.kv_usage() * kPercent);
    }
  }

  void finish(const ServingLoop& loop) {
    if (!tty_) return;
    update(loop, true);
    fmt::print("\n");
  }

  static double tokens_per_second(const ServingStats& s) {
    return s.seconds > 0 ? static_cast<double>(s.computed_tokens) / s.seconds : 0.0;
  }

 private:
  int total_;
  bool tty_;
  int last_step_ = -1;
  std::chrono::steady_clock::time_point last_{};
};

nlohmann::json summary_json(const ServingStats& s, const std::string& backend, const RunOptions& o) {
  return {{"backend", backend},
          {"layers", o.layers},
          {"requests", s.requests},
          {"finished", s.finished},
          {"rejected", s.rejected},
          {"prompt_tokens", s.prompt_tokens},
          {"generated_tokens", s.generated_tokens},
          {"computed_tokens", s.computed_tokens},
          {"steps", s.steps},
          {"seconds", s.seconds},
          {"steps_per_second", s.steps / std::max(s.seconds, 1e-12)},
          {"tokens_per_second", ProgressDisplay::tokens_per_second(s)},
          {"peak_kv_usage", s.peak_kv_usage},
          {"kv_blocks", o.kv_blocks},
          {"kv_waste", s.kv_waste()},
          {"prefix_cache_hit_rate", s.prefix_hit_rate},
          {"preemptions", s.preemptions},
          {"cascade_steps", s.cascade_steps},
          {"check_passed", s.checks_passed},
          {"check_failed", s.checks_failed},
          {"messages", s.messages}};
}

// The medians' bounds depend on another option, which a validator cannot see.
void check_median(std::string_view name, double median, std::string_view clip_name, int clip) {
  if (median > clip)
    throw_invalid("run", name, fmt::format("at most {} ({})", clip_name, clip), fmt::format("{}", median));
}

// Opened before the run, so a path that cannot be written fails in a second,
// not after the whole run.
std::ofstream open_json(const std::string& path) {
  std::ofstream out(path);
  if (!out)
    throw_invalid("run", "--json", "a file that can be written",
                  fmt::format("{} ({})", path, std::strerror(errno)));
  return out;
}

int run_main_job(const RunOptions& o) {
  check_median("--prompt-median", o.prompt_median, "--max-prompt", o.max_prompt);
  check_median("--output-median", o.output_median, "--max-output", o.max_output);
  std::ofstream json;
  if (!o.json.empty()) json = open_json(o.json);
  const auto dtype = parse_dtype(o.dtype);
  if (!dtype) throw_invalid("run", "--dtype", "f32, f16 or bf16", o.dtype);
  const auto cache_dtype = parse_cache_dtype(o.kv_cache_dtype);
  if (!cache_dtype)
    throw_invalid("run", "--kv-cache-dtype", "a vLLM cache dtype (pagedattn info lists them)",
                  o.kv_cache_dtype);

  SelectorConfig cfg;
  cfg.head_size = o.head_size;
  cfg.dtype = *dtype;
  cfg.kv_cache_dtype = *cache_dtype;
  cfg.block_size = o.block_size;
  std::string how;
  const AttentionBackend& backend = choose_backend(o, cfg, how);

  TraceOptions trace_opts;
  trace_opts.num_requests = o.requests;
  trace_opts.seed = o.seed;
  trace_opts.system_prompt_len = o.system_prompt;
  trace_opts.prompt_median = o.prompt_median;
  trace_opts.output_median = o.output_median;
  trace_opts.max_prompt_len = o.max_prompt;
  trace_opts.max_output_len = o.max_output;
  trace_opts.arrivals_per_step = o.arrival_rate;

  ServingOptions serving;
  serving.layers = o.layers;
  serving.heads = o.heads;
  serving.kv_heads = o.kv_heads;
  serving.head_size = o.head_size;
  serving.dtype = *dtype;
  serving.cache_dtype = *cache_dtype;
  serving.block_size = o.block_size;
  serving.num_kv_blocks = o.kv_blocks;
  serving.token_budget = o.token_budget;
  serving.max_num_seqs = o.max_num_seqs;
  serving.check_every = o.check_every;
  serving.prefix_caching = !o.no_prefix_caching;
  serving.seed = o.seed;
  ServingLoop loop(serving, backend, make_trace(trace_opts));

  fmt::print("pagedattn run: {} layers of {}/{} heads, head size {}, {}, KV cache {}, block size {}\n",
             o.layers, o.heads, o.kv_heads, o.head_size, *dtype, cache_dtype_name(*cache_dtype),
             o.block_size);
  fmt::print("backend: {} ({})\n", backend.name(), how);
  fmt::print("KV cache: {} blocks ({} usable), {:.1f} MiB over {} layers; {}\n", o.kv_blocks, o.kv_blocks - 1,
             static_cast<double>(loop.allocation().bytes) / (1024.0 * 1024.0),
             loop.allocation().num_cache_layers, loop.first_layer().extra_repr());
  fmt::print(
      "trace: {} requests (seed {}), prompt median {} + {} shared system tokens, output median {}, "
      "{} tokens/step, prefix caching {}, oracle check every {} steps\n",
      o.requests, o.seed, o.prompt_median, o.system_prompt, o.output_median, o.token_budget,
      o.no_prefix_caching ? "off" : "on", o.check_every);

  ProgressDisplay progress(o.requests);
  while (loop.step()) progress.update(loop);
  progress.finish(loop);

  const ServingStats& s = loop.stats();
  for (const std::string& m : s.messages) fmt::print("  {}\n", m);
  fmt::print("summary:\n");
  fmt::print("  requests:          {} ({} finished, {} rejected)\n", s.requests, s.finished, s.rejected);
  fmt::print("  tokens:            {} computed ({} prompt, {} generated)\n", s.computed_tokens,
             s.prompt_tokens, s.generated_tokens);
  fmt::print("  steps:             {} in {:.1f} s, {:.1f} steps/s\n", s.steps, s.seconds,
             s.steps / std::max(s.seconds, 1e-12));
  fmt::print("  throughput:        {:.0f} tokens/s ({:.0f} tokens/s inside attention, {} layers)\n",
             ProgressDisplay::tokens_per_second(s),
             static_cast<double>(s.computed_tokens) / std::max(s.forward_seconds, 1e-12), o.layers);
  fmt::print("  peak KV usage:     {:.1f}% of {} blocks\n", s.peak_kv_usage * kPercent, o.kv_blocks - 1);
  fmt::print("  KV waste:          {:.2f}% of allocated slots hold no token\n", s.kv_waste() * kPercent);
  fmt::print("  prefix-cache hits: {:.1f}% of looked-up tokens\n", s.prefix_hit_rate * kPercent);
  fmt::print("  preemptions:       {}\n", s.preemptions);
  fmt::print("  cascade steps:     {} of {} (requests sharing a cached prefix of >= {} tokens)\n", s.cascade_steps,
             s.steps, kCascadeMinPrefixTokens);
  fmt::print("check: {} passed, {} failed\n", s.checks_passed, s.checks_failed);
  if (json.is_open()) {
    json << summary_json(s, std::string(backend.name()), o).dump(2) << "\n";
    json.close();
    if (!json)
      throw std::system_error(errno, std::generic_category(), fmt::format("run: writing --json {}", o.json));
  }
  if (s.finished == 0) {
    fmt::print(stderr, "error (nothing ran): no request finished: all {} were rejected (see above)\n",
               s.rejected);
    return kExitNothingRan;
  }
  return s.checks_failed == 0 ? kExitOk : kExitFailed;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "run", "The main job: a continuous-batching serving loop, checked against the oracle");
  auto o = std::make_shared<RunOptions>();
  cmd->add_option("--layers", o->layers, "Attention layers")
      ->capture_default_str()
      ->check(in_range(1, kMaxLayers));
  cmd->add_option("--heads", o->heads, "Query heads")->capture_default_str()->check(in_range(1, kMaxHeads));
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads")
      ->capture_default_str()
      ->check(in_range(1, kMaxHeads));
  cmd->add_option("--head-size", o->head_size, "Head size")
      ->capture_default_str()
      ->check(in_range(1, kMaxHeadSize));
  cmd->add_option("--dtype", o->dtype, "Model dtype")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "KV cache dtype")->capture_default_str();
  cmd->add_option("--block-size", o->block_size, "KV block size")
      ->capture_default_str()
      ->check(in_range(1, kMaxBlockSize));
  cmd->add_option("--requests", o->requests, "Requests in the trace")
      ->capture_default_str()
      ->check(in_range(1, kMaxRequests));
  cmd->add_option("--kv-blocks", o->kv_blocks, "KV cache blocks, the null block included")
      ->capture_default_str()
      ->check(in_range(2, kMaxKvBlocks));
  cmd->add_option("--token-budget", o->token_budget, "Tokens per step")
      ->capture_default_str()
      ->check(in_range(1, kMaxTokens));
  cmd->add_option("--max-num-seqs", o->max_num_seqs, "Running requests at most")
      ->capture_default_str()
      ->check(in_range(1, kMaxRequests));
  cmd->add_option("--check-every", o->check_every, "Check every N-th step against the oracle (0 = never)")
      ->capture_default_str()
      ->check(in_range(0, std::numeric_limits<int>::max()));
  cmd->add_option("--system-prompt", o->system_prompt, "Shared system prompt tokens (0 = none)")
      ->capture_default_str()
      ->check(in_range(0, kMaxTokens));
  cmd->add_flag("--no-prefix-caching", o->no_prefix_caching, "Disable prefix caching");
  cmd->add_option("--prompt-median", o->prompt_median,
                  "Median prompt length (log-normal), at most --max-prompt")
      ->capture_default_str()
      ->check(in_range(kMinMedian, static_cast<double>(kMaxTokens)));
  cmd->add_option("--output-median", o->output_median,
                  "Median output length (log-normal), at most --max-output")
      ->capture_default_str()
      ->check(in_range(kMinMedian, static_cast<double>(kMaxTokens)));
  cmd->add_option("--max-prompt", o->max_prompt, "Prompt length clip")
      ->capture_default_str()
      ->check(in_range(serving::kMinLength, kMaxTokens));
  cmd->add_option("--max-output", o->max_output, "Output length clip")
      ->capture_default_str()
      ->check(in_range(serving::kMinLength, kMaxTokens));
  cmd->add_option("--arrival-rate", o->arrival_rate, "Requests arriving per step")
      ->capture_default_str()
      ->check(in_range(kMinArrivalRate, kMaxArrivalRate));
  cmd->add_option("--backend", o->backend, "Backend name, or auto")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Random seed")->capture_default_str();
  cmd->add_option("--json", o->json, "Also write the summary as JSON to this file");
  cmd->callback([o, &exit_code] { exit_code = run_main_job(*o); });
}

}  // namespace pagedattn::cli
