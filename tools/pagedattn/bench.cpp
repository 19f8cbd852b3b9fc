// `pagedattn bench`: batch-spec workloads timed on one backend, each checked
// against REFERENCE first, with the machine's roofline measured in the same run.
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <pagedattn/backend/backend.h>
#include <pagedattn/error.h>

#include "bench/attention_bench.h"
#include "bench/median.h"
#include "bench/roofline.h"
#include "commands.h"

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <thread>

namespace pagedattn::cli {
namespace {

struct BenchOptions {
  bench::BenchConfig config;
  std::vector<std::string> specs;
  std::string dtype = "bf16";
  // One KV-cache dtype, or several timed side by side (interleaved repeats).
  std::vector<std::string> kv_cache_dtypes{"auto"};
  std::string layout = "NHD";
  bool json = false;
  int roofline_threads = 0;  // 0: PAGEDATTN_NUM_THREADS or the hardware's
};

// Far above any useful run, so a typo is caught before it runs for days.
constexpr int kMaxRepeats = 1'000'000;
// REFERENCE checks each row as a decode of its own prefix: beyond a few
// thousand rows the check alone would take hours.
constexpr int kMaxCheckRows = 4096;

int default_threads() {
  if (const char* env = std::getenv("PAGEDATTN_NUM_THREADS"); env != nullptr) {
    // strtol saturates where atoi's overflow is undefined.
    const long n = std::strtol(env, nullptr, 10);
    if (n > 0) return static_cast<int>(std::min<long>(n, kMaxThreads));
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// `read_gb_per_s`: the read probes run between this spec's repeats (median).
nlohmann::json to_json(const bench::BenchResult& r, const std::string& kv_cache_dtype, const bench::Roofline& roof,
                       double read_gb_per_s) {
  nlohmann::json j = {{"spec", r.spec},
                      {"kv_cache_dtype", kv_cache_dtype},
                      {"num_reqs", r.num_reqs},
                      {"num_tokens", r.num_tokens},
                      {"check_passed", r.check_passed},
                      {"checked_rows", r.checked_rows}};
  if (!r.check_passed) {
    j["check_message"] = r.check_message;
    return j;
  }
  j.update({{"median_ms", r.median_ms},
            {"min_ms", r.min_ms},
            {"plan_median_ms", r.plan_median_ms},
            {"flops", r.flops},
            {"bytes", r.bytes},
            {"tflop_per_s", r.tflop_per_s},
            {"gb_per_s", r.gb_per_s},
            {"read_probe_gb_per_s", read_gb_per_s},
            {"fraction_of_read_bw", r.gb_per_s / read_gb_per_s},
            {"fraction_of_fma_peak", r.tflop_per_s * 1e3 / roof.fma_gflop_per_s}});
  return j;
}

int run_bench(BenchOptions& o) {
  const auto dtype = parse_dtype(o.dtype);
  if (!dtype) throw_invalid("bench", "--dtype", "f32, f16 or bf16", o.dtype);
  std::vector<CacheDType> kvs;
  for (const std::string& name : o.kv_cache_dtypes) {
    const auto kv = parse_cache_dtype(name);
    if (!kv)
      throw_invalid("bench", "--kv-cache-dtype", "a vLLM cache dtype (pagedattn info lists them)", name);
    kvs.push_back(*kv);
  }
  const bool side_by_side = kvs.size() > 1;
  const auto layout = parse_kv_cache_layout(o.layout);
  if (!layout) throw_invalid("bench", "--kv-layout", "NHD or HND", o.layout);
  o.config.layout = *layout;
  o.config.dtype = *dtype;
  // Every spec is checked before the roofline and the first run take their time.
  for (const std::string& spec : o.specs) {
    for (const CacheDType kv : kvs) {
      bench::BenchConfig c = o.config;
      c.spec = spec;
      c.kv_cache_dtype = kv;
      bench::check_bench_config(c);
    }
  }
  bench::ReadProbe probe(o.roofline_threads > 0 ? o.roofline_threads : default_threads());
  const bench::Roofline roof = bench::measure_roofline(probe);
  nlohmann::json runs = nlohmann::json::array();
  bool all_passed = true;
  if (!o.json) {
    fmt::print(
        "roofline ({} threads): read {:.1f} GB/s before the runs, fp32 FMA {:.1f} GFLOP/s; each row's BW fraction "
        "is of its own read probes, run between its repeats\n",
        roof.threads, roof.read_gb_per_s, roof.fma_gflop_per_s);
    fmt::print("backend {}  H={}/{} D={} block={} dtype={} kv={} layout={}  warmup {} repeats {}\n",
               o.config.backend, o.config.num_heads, o.config.num_kv_heads, o.config.head_size, o.config.block_size,
               o.dtype, fmt::join(o.kv_cache_dtypes, ","), o.layout, o.config.warmup, o.config.repeats);
    fmt::print("{:<20} {:>10} {:>10} {:>9} {:>10} {:>8} {:>9} {:>8} {:>9}\n", "spec", "median ms", "plan ms", "GB/s",
               "probe GB/s", "of BW", "GFLOP/s", "of FMA", "check");
  }
  for (const std::string& spec : o.specs) {
    std::vector<bench::BenchConfig> configs(kvs.size(), o.config);
    for (std::size_t i = 0; i < kvs.size(); ++i) {
      configs[i].spec = spec;
      configs[i].kv_cache_dtype = kvs[i];
    }
    std::vector<double> reads;
    const std::vector<bench::BenchResult> results =
        bench::run_attention_benches(configs, [&] { reads.push_back(probe.gb_per_s()); });
    const double read_gb_per_s = bench::median_of(reads);
    // Side by side: each time over the first config's (both checked), from the same interleaved repeats.
    const auto ratio_to_first = [&](std::size_t i) -> std::optional<double> {
      if (!side_by_side || i == 0 || !results[i].check_passed || !results.front().check_passed) return std::nullopt;
      return results[i].median_ms / results.front().median_ms;
    };
    for (std::size_t i = 0; i < results.size(); ++i) {
      const bench::BenchResult& r = results[i];
      all_passed = all_passed && r.check_passed;
      runs.push_back(to_json(r, o.kv_cache_dtypes[i], roof, read_gb_per_s));
      if (const auto ratio = ratio_to_first(i)) runs.back()["time_ratio_to_first"] = *ratio;
      if (o.json) continue;
      // Side by side, each row names its KV dtype.
      const std::string label = side_by_side ? fmt::format("{} ({})", r.spec, o.kv_cache_dtypes[i]) : r.spec;
      if (!r.check_passed) {
        fmt::print("{:<20} CHECK FAILED (no figures): {}\n", label, r.check_message);
        continue;
      }
      fmt::print("{:<20} {:>10.3f} {:>10.4f} {:>9.1f} {:>10.1f} {:>7.0f}% {:>9.1f} {:>7.0f}% {:>6} ok\n", label,
                 r.median_ms, r.plan_median_ms, r.gb_per_s, read_gb_per_s, 100.0 * r.gb_per_s / read_gb_per_s,
                 r.tflop_per_s * 1e3, 100.0 * r.tflop_per_s * 1e3 / roof.fma_gflop_per_s, r.checked_rows);
    }
    if (o.json) continue;
    for (std::size_t i = 1; i < results.size(); ++i) {
      if (const auto ratio = ratio_to_first(i)) {
        fmt::print("{:<20} {} / {} time: {:.3f} (medians of interleaved repeats)\n", "", o.kv_cache_dtypes[i],
                   o.kv_cache_dtypes.front(), *ratio);
      }
    }
  }
  if (o.json) {
    const nlohmann::json report = {
        {"backend", o.config.backend},
        {"num_heads", o.config.num_heads},
        {"num_kv_heads", o.config.num_kv_heads},
        {"head_size", o.config.head_size},
        {"block_size", o.config.block_size},
        {"dtype", o.dtype},
        {"kv_cache_dtypes", o.kv_cache_dtypes},
        {"kv_layout", o.layout},
        {"roofline", {{"threads", roof.threads}, {"read_gb_per_s", roof.read_gb_per_s}, {"fma_gflop_per_s", roof.fma_gflop_per_s}}},
        {"runs", runs}};
    fmt::print("{}\n", report.dump(2));
  }
  return all_passed ? kExitOk : kExitFailed;
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "Time a backend on vLLM batch specs (checked against REFERENCE first)");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("specs", o->specs, "Batch specs, e.g. 8q1s8k q2k q1k_16q1s4k")->required();
  cmd->add_option("--backend", o->config.backend, "Backend to time")->capture_default_str();
  cmd->add_option("--heads", o->config.num_heads, "Query heads")
      ->capture_default_str()
      ->check(in_range(1, kMaxHeads));
  cmd->add_option("--kv-heads", o->config.num_kv_heads, "KV heads")
      ->capture_default_str()
      ->check(in_range(1, kMaxHeads));
  cmd->add_option("--head-size", o->config.head_size, "Head size")
      ->capture_default_str()
      ->check(in_range(1, kMaxHeadSize));
  cmd->add_option("--block-size", o->config.block_size, "KV-cache block size")
      ->capture_default_str()
      ->check(in_range(1, kMaxBlockSize));
  cmd->add_option("--dtype", o->dtype, "Model dtype: f32, f16, bf16")->capture_default_str();
  cmd->add_option(
         "--kv-cache-dtype", o->kv_cache_dtypes,
         "auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head, fp8_per_token_head; "
         "several (auto,fp8) are timed side by side, "
         "their repeats interleaved, with the time ratio to the first")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--kv-layout", o->layout, "Physical KV layout: NHD or HND")->capture_default_str();
  cmd->add_option("--warmup", o->config.warmup, "Untimed runs first")
      ->capture_default_str()
      ->check(in_range(0, kMaxRepeats));
  cmd->add_option("--repeats", o->config.repeats, "Timed runs (the median is reported)")
      ->capture_default_str()
      ->check(in_range(1, kMaxRepeats));
  cmd->add_option("--check-rows", o->config.check_rows, "Query tokens checked against REFERENCE")
      ->capture_default_str()
      ->check(in_range(1, kMaxCheckRows));
  cmd->add_option("--roofline-threads", o->roofline_threads,
                  "Threads of the roofline (default: PAGEDATTN_NUM_THREADS or all)")
      ->check(in_range(0, kMaxThreads));
  cmd->add_flag("--batch-invariant", o->config.batch_invariant,
                "Plan every request from itself alone (the batch-invariant mode; its cost)");
  cmd->add_flag("--json", o->json, "Print one JSON report instead of the table");
  cmd->callback([o, &exit_code] { exit_code = run_bench(*o); });
}

}  // namespace pagedattn::cli
