// `pagedattn bench`: times one backend's forward on a batch-spec workload
// after checking its output against the REFERENCE backend.
#pragma once

#include <pagedattn/backend/backend.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pagedattn::bench {

struct BenchConfig {
  std::string backend = "CPU_ATTN";
  std::string spec;  // vLLM batch spec, e.g. "8q1s8k"
  int num_heads = 32;
  int num_kv_heads = 8;
  int head_size = 128;
  int block_size = 16;
  DType dtype = DType::BF16;
  CacheDType kv_cache_dtype = CacheDType::Auto;
  // Physical KV layout; a backend's required layout wins.
  KVCacheLayout layout = KVCacheLayout::NHD;
  int warmup = 2;
  int repeats = 10;
  int check_rows = 8;  // query tokens checked against REFERENCE (spread over the batch)
  std::uint32_t seed = 1;
  // Plan with BuilderParams::batch_invariant (its cost is what this measures);
  // the backend must declare batch invariance.
  bool batch_invariant = false;
};

struct BenchResult {
  std::string spec;  // canonical spelling
  int num_reqs = 0;
  int num_tokens = 0;
  // Check against REFERENCE; every figure below is zero when it failed.
  bool check_passed = false;
  std::string check_message;
  int checked_rows = 0;
  double median_ms = 0.0;
  double min_ms = 0.0;
  double plan_median_ms = 0.0;  // the metadata builder (host plan), separately
  double flops = 0.0;           // 4 * sum of visible (q, k) pairs * H * D
  double bytes = 0.0;           // KV bytes of every visible key once + q + out
  double tflop_per_s = 0.0;
  double gb_per_s = 0.0;
};

// Throws what run_attention_bench would for this config's shape, backend and
// spec (a spec too large for the machine's memory included), without
// allocating the workload: a caller checks every config before a long run.
void check_bench_config(const BenchConfig& config);

// Causal decoder attention, K/V already in the cache. Throws for a bad config.
BenchResult run_attention_bench(const BenchConfig& config);

// Several configurations (e.g. one workload with bf16 and fp8 KV), each
// checked first, then timed with their repeats interleaved (0, 1, ..., 0, 1,
// ...) so a slow phase of a shared machine falls on each alike and their
// ratio holds where separate runs stray (docs/perf.md). Every config takes
// the same warmup and repeats. Results in the order of `configs`.
// `between_repeats`, when set, runs after each round of repeats (untimed),
// followed by an untimed forward of the last config: the CLI's read probe, so
// the roofline shares the runs' phase without any repeat following it.
std::vector<BenchResult> run_attention_benches(const std::vector<BenchConfig>& configs,
                                               const std::function<void()>& between_repeats = {});

}  // namespace pagedattn::bench
