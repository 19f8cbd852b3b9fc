// pagedattn_dcp_bench: scaling of long-context decode under decode context
// parallelism (issue 6, docs/parallel.md). The same step (default 8q1s128k:
// 8 decodes at 128k context) runs on one GPU without DCP, then on N GPUs
// (one thread per rank on device `rank`, NCCL, CUDA_FLASH, a preallocated
// DcpWorkspace), each rank's KV cache holding 1/N of the tokens. Every DCP
// result is checked against the one-GPU result (bf16 tolerances, and all
// ranks bitwise equal) before any time is taken: a failed check prints no
// figures. Times are CUDA-event medians after warm-up, per rank, split into
// attention (gather, forward, scatter) and merge (all-gather + merges; it
// includes waiting for the slowest rank).
#include <cuda_runtime_api.h>
#include <pagedattn/attention.h>
#include <pagedattn/conformance.h>
#include <pagedattn/ops.h>
#include <pagedattn/parallel.h>
#include <pagedattn/backend/registry.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>

#include "bench/batch_spec.h"
#include "bench/median.h"
#include "cuda/cuda_runtime.h"
#include "cuda/kernels/fill_random.h"
#include "testing/rank_threads.h"

namespace pagedattn {
namespace {

constexpr std::string_view kWhere = "dcp_bench";
constexpr DType kDType = DType::BF16;
constexpr std::uint64_t kQuerySeed = 11;
constexpr std::uint64_t kStepKeySeed = 13;
constexpr std::uint64_t kStepValueSeed = 17;
constexpr std::uint64_t kContextSeed = 1000;  // + 2 * request (keys), + 1 (values)
constexpr double kBytesPerGB = 1e9;

struct Options {
  std::string spec = "8q1s128k";
  std::vector<int> sizes = {1, 2, 4, 8};
  int num_heads = 32;
  int num_kv_heads = 8;
  int head_size = 128;
  int block_size = 16;
  int interleave = 1;
  int warmup = 5;
  int repeats = 30;
  std::string json;
  std::string markdown;
};

void check(int status, std::string_view what) { cuda::check_cuda(status, what); }

void fill(const TensorView& t, std::uint64_t seed, void* stream) {
  check(cuda_kernels::launch_fill_uniform(t.data(), t.dtype(), t.numel(), seed, -1.0f, 1.0f, stream), "fill");
}

struct Timings {
  std::vector<double> attention_ms;
  std::vector<double> merge_ms;  // empty for the run without DCP
  std::vector<double> step_ms;
};

// One rank (or the one GPU without DCP when comm is null): its model, layer,
// KV cache holding its share of every request's context, the step's inputs
// and everything a step needs, so that a step allocates nothing.
class Rank {
 public:
  Rank(const Options& o, std::span<const bench::BatchRequest> requests, const DcpConfig& dcp, bool use_dcp,
       const AttentionBackend& backend, const std::optional<NcclUniqueId>& id)
      : dcp_(dcp), device_(Device::cuda(dcp.rank)) {
    check(cudaSetDevice(device_.index), "cudaSetDevice");
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    check(cudaEventCreate(&start_), "event");
    check(cudaEventCreate(&attended_), "event");
    check(cudaEventCreate(&merged_), "event");
    if (id) comm_ = make_nccl_communicator(*id, dcp.size, dcp.rank, device_.index, stream_);

    // Block-table entries cover block_size * size positions (vLLM's DCP
    // layout); each rank's cache has a block of every id.
    const int positions_per_block = o.block_size * dcp.size;
    std::int32_t next_block = 1;  // block 0 is the null block
    for (const bench::BatchRequest& r : requests) {
      RequestSpec spec{.query_len = r.query_len, .seq_len = r.seq_len, .blocks = {}};
      for (int b = 0; b < (r.seq_len + positions_per_block - 1) / positions_per_block; ++b) {
        spec.blocks.push_back(next_block++);
      }
      requests_.push_back(std::move(spec));
    }
    std::mt19937 rng(1);
    std::vector<std::int32_t> permutation(static_cast<std::size_t>(next_block - 1));
    std::iota(permutation.begin(), permutation.end(), 1);
    std::shuffle(permutation.begin(), permutation.end(), rng);
    for (RequestSpec& r : requests_) {
      for (std::int32_t& b : r.blocks) b = permutation[static_cast<std::size_t>(b - 1)];
    }

    ForwardContext stream_only;
    stream_only.stream = stream_;
    ForwardContextScope scope(std::move(stream_only));  // setup ops run on the rank's stream
    model_ = std::make_unique<ModelContext>(ModelOptions{.dtype = kDType, .device = device_});
    AttentionOptions opts;
    opts.num_kv_heads = o.num_kv_heads;
    opts.cache_config = CacheConfig{.block_size = o.block_size};
    opts.prefix = "model.layers.0.self_attn.attn";
    opts.attn_backend = &backend;
    layer_ = std::make_unique<Attention>(*model_, o.num_heads, o.head_size,
                                         1.0f / std::sqrt(static_cast<float>(o.head_size)), opts);
    allocate_kv_caches(*model_, {.num_blocks = next_block, .reserve_null_block = true});
    store_context(o);

    num_tokens_ = 0;
    for (const RequestSpec& r : requests_) num_tokens_ += r.query_len;
    query_ = Tensor::empty({num_tokens_, o.num_heads, o.head_size}, kDType, device_);
    key_ = Tensor::empty({num_tokens_, o.num_kv_heads, o.head_size}, kDType, device_);
    value_ = Tensor::empty({num_tokens_, o.num_kv_heads, o.head_size}, kDType, device_);
    output_ = Tensor::empty({num_tokens_, o.num_heads, o.head_size}, kDType, device_);
    lse_ = Tensor::empty({o.num_heads, num_tokens_}, DType::F32, device_);
    fill(query_, kQuerySeed, stream_);
    fill(key_, kStepKeySeed, stream_);
    fill(value_, kStepValueSeed, stream_);

    const MetadataOptions metadata{.block_size = o.block_size, .device = device_};
    ModelMetadataBuilder builder(*model_);
    if (use_dcp) {
      batch_ = make_dcp_local_batch(requests_, metadata, dcp);
      if (!batch_->empty()) metadata_ = builder.build(batch_->metadata);
      workspace_ = DcpWorkspace::allocate(*layer_, dcp.size, num_tokens_, device_);
    } else {
      metadata_ = builder.build(make_common_metadata(requests_, metadata));
    }
    check(cudaStreamSynchronize(stream_), "setup");
  }

  ~Rank() {
    cudaSetDevice(device_.index);
    cudaEventDestroy(start_);
    cudaEventDestroy(attended_);
    cudaEventDestroy(merged_);
    cudaStreamDestroy(stream_);
  }
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  // One step, timed by events on the rank's stream: attention, then merge.
  void step(Timings* timings) {
    check(cudaSetDevice(device_.index), "cudaSetDevice");
    ForwardContext ctx;
    ctx.layer_metadata = metadata_;
    ctx.stream = stream_;
    ForwardContextScope scope(std::move(ctx));
    check(cudaEventRecord(start_, stream_), "event");
    if (batch_) {
      const DcpPartial partial = dcp_local_attention(*layer_, *batch_, workspace_, query_, key_, value_);
      check(cudaEventRecord(attended_, stream_), "event");
      dcp_merge(*comm_, partial.output, partial.lse, workspace_.merge_workspace(num_tokens_), output_, lse_);
    } else {
      layer_->forward(query_, key_, value_, output_, lse_);
      check(cudaEventRecord(attended_, stream_), "event");
    }
    check(cudaEventRecord(merged_, stream_), "event");
    check(cudaEventSynchronize(merged_), "step");
    if (timings == nullptr) return;
    float attention = 0.0f;
    float step = 0.0f;
    check(cudaEventElapsedTime(&attention, start_, attended_), "event");
    check(cudaEventElapsedTime(&step, start_, merged_), "event");
    timings->attention_ms.push_back(attention);
    timings->step_ms.push_back(step);
    if (batch_) timings->merge_ms.push_back(step - attention);
  }

  std::int64_t num_tokens() const { return num_tokens_; }
  // Output and LSE of the last step, on the host.
  std::vector<float> output() const { return to_float_vector(output_); }
  std::vector<float> lse() const { return to_float_vector(lse_); }

  // Bytes the rank's attention reads and writes: its share of every request's
  // keys and values (causal decode: all of them), the queries and outputs.
  double bytes(const Options& o) const {
    double kv_tokens = 0.0;
    for (const RequestSpec& r : requests_) kv_tokens += dcp_local_seq_len(r.seq_len, dcp_);
    const double kv =
        kv_tokens * o.num_kv_heads * o.head_size * 2.0 * static_cast<double>(dtype_size(kDType));
    return kv + 2.0 * static_cast<double>(query_.numel()) * static_cast<double>(dtype_size(kDType));
  }

 private:
  // Every request's context keys and values, generated on the device from
  // the position (so every group size sees the same values), stored through
  // the rank's slots: its share only.
  void store_context(const Options& o) {
    for (std::size_t r = 0; r < requests_.size(); ++r) {
      const int context = requests_[r].seq_len - requests_[r].query_len;
      if (context == 0) continue;
      const Tensor k = Tensor::empty({context, o.num_kv_heads, o.head_size}, kDType, device_);
      const Tensor v = Tensor::empty({context, o.num_kv_heads, o.head_size}, kDType, device_);
      fill(k, kContextSeed + 2 * r, stream_);
      fill(v, kContextSeed + 2 * r + 1, stream_);
      const std::vector<std::int64_t> slots =
          dcp_slots_for_positions(requests_[r].blocks, o.block_size, 0, context, dcp_);
      reshape_and_cache(k, v, layer_->kv_cache_view(0).key, layer_->kv_cache_view(0).value,
                        Tensor::from_i64(slots, {context}).to(device_), CacheDType::Auto,
                        layer_->quant_state().k_scale, layer_->quant_state().v_scale);
      check(cudaStreamSynchronize(stream_), "store_context");  // before k and v are freed
    }
  }

  DcpConfig dcp_;
  Device device_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
  cudaEvent_t attended_ = nullptr;
  cudaEvent_t merged_ = nullptr;
  std::unique_ptr<Communicator> comm_;
  std::vector<RequestSpec> requests_;
  std::unique_ptr<ModelContext> model_;
  std::unique_ptr<Attention> layer_;
  std::int64_t num_tokens_ = 0;
  Tensor query_, key_, value_, output_, lse_;
  std::optional<DcpLocalBatch> batch_;
  DcpWorkspace workspace_;
  LayerMetadataMap metadata_;
};

nlohmann::json summarize(const Options& o, int size, bool dcp, const std::vector<Timings>& timings,
                         const std::vector<double>& bytes) {
  nlohmann::json ranks = nlohmann::json::array();
  double step = 0.0, attention = 0.0, merge = 0.0, max_bytes = 0.0, min_gb_s = std::numeric_limits<double>::infinity();
  for (std::size_t r = 0; r < timings.size(); ++r) {
    const double a = bench::median_of(timings[r].attention_ms);
    const double s = bench::median_of(timings[r].step_ms);
    const double m = dcp ? bench::median_of(timings[r].merge_ms) : 0.0;
    const double gb_s = bytes[r] / (a * 1e-3) / kBytesPerGB;
    ranks.push_back({{"rank", r},
                     {"step_ms", s},
                     {"attention_ms", a},
                     {"merge_ms", m},
                     {"bytes", bytes[r]},
                     {"gb_per_s", gb_s}});
    step = std::max(step, s);
    attention = std::max(attention, a);
    merge = std::max(merge, m);
    max_bytes = std::max(max_bytes, bytes[r]);
    min_gb_s = std::min(min_gb_s, gb_s);
  }
  return {{"gpus", size},
          {"dcp", dcp},
          {"interleave", o.interleave},
          {"check_passed", true},
          {"step_ms", step},
          {"attention_ms", attention},
          {"merge_ms", merge},
          {"bytes_per_rank", max_bytes},
          {"gb_per_s_per_rank", min_gb_s},
          {"ranks", ranks}};
}

// Runs `size` ranks (DCP through NCCL, or the one GPU without DCP, which
// fills `want`), checks every rank against `want` within the bf16
// tolerances, and only then times them.
nlohmann::json run_group(const Options& o, std::span<const bench::BatchRequest> requests, int size, bool dcp,
                         const AttentionBackend& flash, OracleOutput* want) {
  const std::optional<NcclUniqueId> id = dcp ? std::optional(make_nccl_unique_id()) : std::nullopt;
  std::vector<std::unique_ptr<Rank>> ranks(static_cast<std::size_t>(size));
  test::run_ranks(size, [&](int rank) {
    const DcpConfig config{.size = size, .rank = rank, .interleave = o.interleave};
    auto& slot = ranks[static_cast<std::size_t>(rank)];
    slot = std::make_unique<Rank>(o, requests, config, dcp, flash, id);
    slot->step(nullptr);
  });
  if (!dcp) {
    want->num_tokens = static_cast<int>(ranks[0]->num_tokens());
    want->num_heads = o.num_heads;
    want->head_size = o.head_size;
    for (const float x : ranks[0]->output()) want->output.push_back(x);
    for (const float x : ranks[0]->lse()) want->lse.push_back(x);
  }
  for (int r = 0; r < size; ++r) {
    const Rank& rank = *ranks[static_cast<std::size_t>(r)];
    std::optional<std::string> failure = compare_with_oracle(*want, rank.output(), rank.lse(), kDType);
    if (!failure && r > 0 && (rank.output() != ranks[0]->output() || rank.lse() != ranks[0]->lse())) {
      failure = "differs from rank 0 (all ranks must be bitwise equal)";
    }
    if (failure) {
      return {{"gpus", size},
              {"dcp", dcp},
              {"check_passed", false},
              {"check_message", fmt::format("rank {}: {}", r, *failure)}};
    }
  }
  std::vector<Timings> timings(static_cast<std::size_t>(size));
  test::run_ranks(size, [&](int rank) {
    Rank& me = *ranks[static_cast<std::size_t>(rank)];
    for (int i = 0; i < o.warmup; ++i) me.step(nullptr);
    for (int i = 0; i < o.repeats; ++i) me.step(&timings[static_cast<std::size_t>(rank)]);
  });
  std::vector<double> bytes;
  for (const auto& r : ranks) bytes.push_back(r->bytes(o));
  return summarize(o, size, dcp, timings, bytes);
}

std::string markdown_table(const Options& o, const nlohmann::json& runs) {
  std::string md = fmt::format(
      "`{}`, {}/{} heads, head size {}, bf16, block {}, interleave {}; medians of {} steps after {} "
      "warm-up.\n\n"
      "| GPUs | DCP | step ms | attention ms | merge ms | speedup | MB per rank | GB/s per rank |\n"
      "|---:|:---:|---:|---:|---:|---:|---:|---:|\n",
      o.spec, o.num_heads, o.num_kv_heads, o.head_size, o.block_size, o.interleave, o.repeats, o.warmup);
  const double base = runs[0].value("step_ms", 0.0);
  for (const nlohmann::json& r : runs) {
    if (!r["check_passed"].get<bool>()) {
      md += fmt::format("| {} | {} | CHECK FAILED (no figures): {} |||||\n", r["gpus"].get<int>(),
                        r["dcp"].get<bool>() ? "yes" : "no", r["check_message"].get<std::string>());
      continue;
    }
    md += fmt::format("| {} | {} | {:.4f} | {:.4f} | {:.4f} | {:.2f}x | {:.0f} | {:.0f} |\n",
                      r["gpus"].get<int>(), r["dcp"].get<bool>() ? "yes" : "no", r["step_ms"].get<double>(),
                      r["attention_ms"].get<double>(), r["merge_ms"].get<double>(),
                      base / r["step_ms"].get<double>(), r["bytes_per_rank"].get<double>() / 1e6,
                      r["gb_per_s_per_rank"].get<double>());
  }
  return md;
}

int run(const Options& o) {
  const AttentionBackend* flash = BackendRegistry::instance().find("CUDA_FLASH");
  if (flash == nullptr) throw_unsupported(kWhere, "this build has no CUDA_FLASH backend");
  if (!nccl_available()) throw_unsupported(kWhere, "this build has no NCCL");
  const DeviceAllocator* cuda = find_device_allocator(DeviceType::CUDA);
  const int devices = cuda == nullptr ? 0 : cuda->device_count();
  check_arg(devices > 0, kWhere, "CUDA devices", ">= 1", devices);
  const std::vector<bench::BatchRequest> requests = bench::parse_batch_spec(o.spec);

  OracleOutput one_gpu;
  nlohmann::json runs = nlohmann::json::array();
  runs.push_back(run_group(o, requests, 1, false, *flash, &one_gpu));
  bool ok = true;
  for (const int size : o.sizes) {
    if (size > devices) {
      fmt::print("{} GPUs: skipped ({} visible)\n", size, devices);
      continue;
    }
    runs.push_back(run_group(o, requests, size, true, *flash, &one_gpu));
    ok = ok && runs.back()["check_passed"].get<bool>();
  }
  const std::string md = markdown_table(o, runs);
  fmt::print("{}", md);
  if (!o.markdown.empty()) std::ofstream(o.markdown) << md;
  if (!o.json.empty()) {
    const nlohmann::json report = {{"spec", o.spec},
                                   {"heads", o.num_heads},
                                   {"kv_heads", o.num_kv_heads},
                                   {"head_size", o.head_size},
                                   {"block_size", o.block_size},
                                   {"dtype", "bf16"},
                                   {"visible_gpus", devices},
                                   {"runs", runs}};
    std::ofstream(o.json) << report.dump(2) << "\n";
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
  pagedattn::Options o;
  CLI::App app{"Long-context decode under decode context parallelism on 1 to 8 GPUs"};
  app.add_option("spec", o.spec, "batch spec (default 8q1s128k)");
  app.add_option("--sizes", o.sizes, "DCP group sizes; those above the visible GPUs are skipped")
      ->delimiter(',');
  app.add_option("--heads", o.num_heads, "query heads");
  app.add_option("--kv-heads", o.num_kv_heads, "KV heads");
  app.add_option("--head-size", o.head_size, "head size");
  app.add_option("--block-size", o.block_size, "KV-cache block size");
  app.add_option("--interleave", o.interleave, "DCP interleave (vLLM's cp_kv_cache_interleave_size)");
  app.add_option("--warmup", o.warmup, "warm-up steps");
  app.add_option("--repeats", o.repeats, "timed steps");
  app.add_option("--json", o.json, "write the report here");
  app.add_option("--markdown", o.markdown, "write the table here");
  CLI11_PARSE(app, argc, argv);
  try {
    return pagedattn::run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}\n", e.what());
    return 2;
  }
}
