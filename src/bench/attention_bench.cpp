#include "bench/attention_bench.h"

#include <pagedattn/backend/registry.h>
#include <pagedattn/conformance.h>
#include <pagedattn/error.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/metadata.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>

#include "bench/batch_spec.h"
#include "bench/median.h"

namespace pagedattn::bench {

namespace {

constexpr std::string_view kWhere = "bench";
constexpr std::string_view kOracleBackend = "REFERENCE";
// Metadata names blocks by int32 id, block 0 the null block.
constexpr std::int64_t kMaxBlocks = std::numeric_limits<std::int32_t>::max() - 1;
constexpr double kKeyAndValue = 2.0;
// The query, the output, and REFERENCE's checked copies of both at most.
constexpr double kActivationCopies = 4.0;
// Block ids, block tables and per-token metadata (slot mapping, positions), generously.
constexpr double kMetadataBytesPerBlock = 16.0;
constexpr double kMetadataBytesPerToken = 64.0;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

const AttentionBackend& find_backend(std::string_view name) {
  const AttentionBackend* b = BackendRegistry::instance().find(name);
  if (b == nullptr) {
    throw_invalid(kWhere, "--backend", fmt::format("one of {}", BackendRegistry::instance().names()), name);
  }
  return *b;
}

// Fills every element of a contiguous-storage tensor with uniform [-1, 1) values.
// Values uniform in [lo, hi) over t's physically contiguous elements.
void fill_random(const Tensor& t, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  auto* p = static_cast<unsigned char*>(t.data());
  const std::size_t size = t.element_size();
  const auto n = static_cast<std::size_t>(t.numel());
  for (std::size_t i = 0; i < n; ++i) store_from_float(p + i * size, t.dtype(), dist(rng));
}

// Per-token-head scales of the random caches, times 1 / qmax.
constexpr float kScaleLo = 0.5f;
constexpr float kScaleHi = 1.5f;

template <typename F>
double time_ms(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

struct Workload {
  std::vector<BatchRequest> requests;
  std::vector<RequestSpec> specs;
  CommonAttentionMetadata common;
  Tensor cache;
  Tensor scales;  // per-token-head caches only
  KVCacheView kv;
  Tensor query;
  LayerQuantState layer;
  AttentionImplParams params;
  BuilderParams builder;
};

// A spec's counts, summed in 64 bits and checked as they grow: its lengths
// are ints, and their sums and block counts overflow one.
struct WorkloadSize {
  std::int64_t tokens = 0;  // query tokens
  std::int64_t blocks = 0;  // KV blocks, the null block excluded
  double bytes = 0.0;       // estimated peak memory
};

WorkloadSize size_workload(const BenchConfig& c, const std::vector<BatchRequest>& requests) {
  WorkloadSize size;
  for (const BatchRequest& r : requests) {
    size.tokens += r.query_len;  // at most INT32_MAX in all: parse_batch_spec checks it
    size.blocks += (static_cast<std::int64_t>(r.seq_len) + c.block_size - 1) / c.block_size;
    if (size.blocks > kMaxBlocks) {
      throw_invalid(kWhere, "spec",
                    fmt::format("at most {} KV blocks of {} tokens in all", kMaxBlocks, c.block_size),
                    c.spec);
    }
  }
  const auto kv_elem = static_cast<double>(dtype_size(kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype)));
  const double scale_bytes = kv_cache_uses_per_token_head_scales(c.kv_cache_dtype) ? sizeof(float) : 0.0;
  const double kv_bytes = static_cast<double>(size.blocks + 1) * c.block_size * c.num_kv_heads *
                          kKeyAndValue * (c.head_size * kv_elem + scale_bytes);
  const double activation_bytes = static_cast<double>(size.tokens) * c.num_heads * c.head_size *
                                  kActivationCopies * static_cast<double>(dtype_size(c.dtype));
  size.bytes = kv_bytes + activation_bytes + static_cast<double>(size.blocks) * kMetadataBytesPerBlock +
               static_cast<double>(size.tokens) * kMetadataBytesPerToken;
  return size;
}

// A workload larger than the machine's memory fails here, with its size,
// rather than in an allocation the kernel may grant and later kill for.
void check_fits_in_memory(const BenchConfig& c, const WorkloadSize& size) {
  const double memory =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (memory > 0 && size.bytes > memory) {
    throw Error(
        ErrorKind::OutOfMemory,
        fmt::format("{}: spec {} needs about {:.1f} GiB (KV cache, activations, metadata), more than this "
                    "machine's {:.1f} GiB of memory",
                    kWhere, c.spec, size.bytes / kGiB, memory / kGiB));
  }
}

void check_shape(const BenchConfig& c) {
  check_arg(c.num_heads >= 1, kWhere, "num_heads", ">= 1", c.num_heads);
  check_arg(c.num_kv_heads >= 1, kWhere, "num_kv_heads", ">= 1", c.num_kv_heads);
  check_arg(c.head_size >= 1, kWhere, "head_size", ">= 1", c.head_size);
  check_arg(c.block_size >= 1, kWhere, "block_size", ">= 1", c.block_size);
}

void check_invariance(const BenchConfig& c, const AttentionBackend& backend) {
  check_arg(!c.batch_invariant || backend.supports_batch_invariance(), kWhere, "batch_invariant",
            "a backend that declares batch invariance", c.backend);
}

Workload make_workload(const BenchConfig& c, const AttentionBackend& backend) {
  check_invariance(c, backend);
  Workload w;
  w.requests = parse_batch_spec(c.spec);
  const WorkloadSize size = size_workload(c, w.requests);
  check_fits_in_memory(c, size);
  const std::int64_t blocks = size.blocks;
  std::mt19937 rng(c.seed);
  // Block 0 stays the null block; the rest are handed out in random order.
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  for (const BatchRequest& r : w.requests) {
    RequestSpec spec{r.query_len, r.seq_len, {}};
    const std::int64_t request_blocks =
        (static_cast<std::int64_t>(r.seq_len) + c.block_size - 1) / c.block_size;
    for (std::int64_t b = 0; b < request_blocks; ++b) spec.blocks.push_back(ids[next++]);
    w.specs.push_back(std::move(spec));
  }
  MetadataOptions options;
  options.block_size = c.block_size;
  w.common = make_common_metadata(w.specs, options);

  const KVCacheLayout layout = backend.required_kv_cache_layout().value_or(c.layout);
  LayerKVCache cache = allocate_layer_kv_cache(backend, blocks + 1, c.block_size, c.num_kv_heads, c.head_size,
                                               c.kv_cache_dtype, c.dtype, layout, Device::cpu());
  w.cache = std::move(cache.cache);
  w.scales = std::move(cache.scales);
  // int8 over its whole range; per-token-head scales bring values read back
  // to about [-1.5, 1.5], as the other dtypes' are.
  const float qmax = w.cache.dtype() == DType::I8 ? kInt8Max : 1.0f;
  fill_random(w.cache, rng, -qmax, qmax);
  if (w.scales.defined()) fill_random(w.scales, rng, kScaleLo / qmax, kScaleHi / qmax);
  w.kv = backend.unbind_kv_cache(w.cache, w.scales);
  w.query = Tensor::empty({w.common.num_actual_tokens, c.num_heads, c.head_size}, c.dtype);
  fill_random(w.query, rng);
  const std::vector<float> one{1.0f};
  w.layer.k_scale = Tensor::from_floats(one, {1}, DType::F32);
  w.layer.v_scale = Tensor::from_floats(one, {1}, DType::F32);
  w.layer.q_scale = Tensor::from_floats(one, {1}, DType::F32);
  w.layer.prob_scale = Tensor::from_floats(one, {1}, DType::F32);

  w.params.num_heads = c.num_heads;
  w.params.num_kv_heads = c.num_kv_heads;
  w.params.head_size = c.head_size;
  w.params.scale = 1.0f / std::sqrt(static_cast<float>(c.head_size));
  w.params.kv_cache_dtype = c.kv_cache_dtype;
  w.params.dtype = c.dtype;
  w.builder.block_size = c.block_size;
  w.builder.num_kv_heads = c.num_kv_heads;
  w.builder.head_size = c.head_size;
  w.builder.num_heads = c.num_heads;
  w.builder.batch_invariant = c.batch_invariant;
  return w;
}

Tensor run_forward(const AttentionBackend& backend, const Workload& w, const CommonAttentionMetadata& common,
                   const Tensor& query) {
  auto md = backend.make_builder(w.builder)->build(common);
  auto impl = backend.make_impl(w.params);
  Tensor out = Tensor::zeros({query.size(0), w.params.num_heads, w.params.head_size}, w.params.dtype);
  impl->forward(w.layer, query, {}, {}, w.kv, *md, out, {});
  return out;
}

// Runs REFERENCE on `rows` query tokens (each as a decode of its own prefix,
// which is what a causal row sees) and compares them with `out`.
std::optional<std::string> check_rows(const Workload& w, const Tensor& out, const BenchConfig& c, int& checked) {
  const AttentionBackend& oracle = find_backend(kOracleBackend);
  const int tokens = w.common.num_actual_tokens;
  const int rows = std::min(c.check_rows, tokens);
  std::vector<RequestSpec> specs;
  std::vector<int> picked;
  for (int k = 0; k < rows; ++k) {
    const int t = rows == 1 ? tokens - 1 : static_cast<int>(static_cast<std::int64_t>(k) * (tokens - 1) / (rows - 1));
    int r = 0;
    while (w.common.query_start_loc_host()[static_cast<std::size_t>(r) + 1] <= t) ++r;
    const int i = t - w.common.query_start_loc_host()[static_cast<std::size_t>(r)];
    const RequestSpec& req = w.specs[static_cast<std::size_t>(r)];
    specs.push_back(RequestSpec{1, req.seq_len - req.query_len + i + 1, req.blocks});
    picked.push_back(t);
  }
  MetadataOptions options;
  options.block_size = c.block_size;
  const CommonAttentionMetadata sub = make_common_metadata(specs, options);
  Tensor q = Tensor::empty({rows, c.num_heads, c.head_size}, c.dtype);
  Tensor got = Tensor::empty({rows, c.num_heads, c.head_size}, c.dtype);
  for (int k = 0; k < rows; ++k) {
    const auto t = picked[static_cast<std::size_t>(k)];
    copy_tensor(q.TensorView::slice(0, k, k + 1), w.query.TensorView::slice(0, t, t + 1));
    copy_tensor(got.TensorView::slice(0, k, k + 1), out.TensorView::slice(0, t, t + 1));
  }
  const Tensor want = run_forward(oracle, w, sub, q);
  OracleOutput expected;
  expected.num_tokens = rows;
  expected.num_heads = c.num_heads;
  expected.head_size = c.head_size;
  for (float v : to_float_vector(want)) expected.output.push_back(v);
  checked = rows;
  return compare_with_oracle(expected, to_float_vector(got), {}, c.dtype);
}

// One configuration's workload, checked, with its plan and impl, and the
// times of its repeats so far.
struct Timed {
  const BenchConfig* config = nullptr;
  Workload w;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  std::unique_ptr<AttentionImpl> impl;
  std::shared_ptr<const BackendMetadata> md;
  Tensor out;
  BenchResult res;
  std::vector<double> times;
  std::vector<double> plan_times;

  void forward() { impl->forward(w.layer, w.query, {}, {}, w.kv, *md, out, {}); }
};

void prepare(Timed& t, const BenchConfig& c) {
  const AttentionBackend& backend = find_backend(c.backend);
  t.config = &c;
  t.w = make_workload(c, backend);
  t.res.spec = format_batch_spec(t.w.requests);
  t.res.num_reqs = t.w.common.num_reqs;
  t.res.num_tokens = t.w.common.num_actual_tokens;
  t.builder = backend.make_builder(t.w.builder);
  t.impl = backend.make_impl(t.w.params);
  t.md = t.builder->build(t.w.common);
  t.out = Tensor::zeros({t.w.query.size(0), c.num_heads, c.head_size}, c.dtype);
  t.forward();
  if (auto failure = check_rows(t.w, t.out, c, t.res.checked_rows)) {
    t.res.check_message = *failure;
    return;
  }
  t.res.check_passed = true;
}

void fill_figures(Timed& t) {
  const BenchConfig& c = *t.config;
  BenchResult& res = t.res;
  res.median_ms = median_of(t.times);
  res.min_ms = *std::min_element(t.times.begin(), t.times.end());
  res.plan_median_ms = median_of(t.plan_times);
  double pairs = 0.0;
  double kv_tokens = 0.0;
  for (const BatchRequest& r : t.w.requests) {
    const double q = r.query_len;
    pairs += q * (r.seq_len - r.query_len) + q * (q + 1) / 2;  // causal: token i sees context + i + 1 keys
    kv_tokens += r.seq_len;
  }
  const double hd = static_cast<double>(c.num_heads) * c.head_size;
  const auto kv_elem = static_cast<double>(dtype_size(kv_cache_storage_dtype(c.kv_cache_dtype, c.dtype)));
  res.flops = 4.0 * pairs * hd;
  // Per-token-head caches also read one f32 K and V scale per (token, KV head).
  const double scale_bytes = kv_cache_uses_per_token_head_scales(c.kv_cache_dtype) ? sizeof(float) : 0.0;
  res.bytes = kv_tokens * c.num_kv_heads * 2.0 * (c.head_size * kv_elem + scale_bytes) +
              2.0 * res.num_tokens * hd * static_cast<double>(dtype_size(c.dtype));
  res.tflop_per_s = res.flops / (res.median_ms * 1e-3) / 1e12;
  res.gb_per_s = res.bytes / (res.median_ms * 1e-3) / 1e9;
}

}  // namespace

void check_bench_config(const BenchConfig& config) {
  check_shape(config);
  check_invariance(config, find_backend(config.backend));
  check_fits_in_memory(config, size_workload(config, parse_batch_spec(config.spec)));
}

BenchResult run_attention_bench(const BenchConfig& config) { return run_attention_benches({config}).front(); }

std::vector<BenchResult> run_attention_benches(const std::vector<BenchConfig>& configs,
                                               const std::function<void()>& between_repeats) {
  check_arg(!configs.empty(), kWhere, "configs", "at least one", configs.size());
  for (const BenchConfig& c : configs) {
    check_shape(c);
    check_arg(c.repeats >= 1, kWhere, "repeats", ">= 1", c.repeats);
    check_arg(c.warmup >= 0, kWhere, "warmup", ">= 0", c.warmup);
    check_arg(c.check_rows >= 1, kWhere, "check_rows", ">= 1", c.check_rows);
    check_arg(c.repeats == configs.front().repeats, kWhere, "repeats", "the same for every config", c.repeats);
    check_arg(c.warmup == configs.front().warmup, kWhere, "warmup", "the same for every config", c.warmup);
  }
  std::vector<Timed> runs(configs.size());
  for (std::size_t i = 0; i < configs.size(); ++i) prepare(runs[i], configs[i]);
  const BenchConfig& first = configs.front();
  for (int i = 0; i < first.warmup; ++i) {
    for (Timed& t : runs) {
      if (t.res.check_passed) t.forward();
    }
  }
  for (int i = 0; i < first.repeats; ++i) {
    for (Timed& t : runs) {
      if (!t.res.check_passed) continue;
      t.times.push_back(time_ms([&] { t.forward(); }));
      t.plan_times.push_back(time_ms([&] { t.md = t.builder->build(t.w.common); }));
    }
    if (!between_repeats) continue;
    between_repeats();
    // Then an untimed forward of the last config, so the next round's first
    // repeat follows a forward as every other repeat does: right after the
    // hook's stream read it measured 2-8% slower, which would tilt the ratio.
    for (auto t = runs.rbegin(); t != runs.rend(); ++t) {
      if (t->res.check_passed) {
        t->forward();
        break;
      }
    }
  }
  std::vector<BenchResult> results;
  for (Timed& t : runs) {
    if (t.res.check_passed) fill_figures(t);
    results.push_back(std::move(t.res));
  }
  return results;
}

}  // namespace pagedattn::bench
