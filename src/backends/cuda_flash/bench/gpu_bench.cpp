// pagedattn_gpu_bench: times a CUDA backend's forward on vLLM batch-spec
// workloads (the grammar of src/bench/batch_spec.h). Each workload is first
// checked against REFERENCE on sampled rows; a failed check prints no
// figures. Times are CUDA-event medians of graph replays (launch gaps out)
// and of eager calls; the host plan (builder) is timed separately. The
// device-to-device copy bandwidth is measured in the same run.
#include <cuda_runtime_api.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/conformance.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/kv_cache.h>
#include <pagedattn/metadata.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "bench/batch_spec.h"
#include "bench/median.h"
#include "cuda/cuda_runtime.h"
#include "cuda/kernels/fill_random.h"

namespace pagedattn {
namespace {

constexpr std::string_view kWhere = "gpu_bench";
constexpr int kCheckRows = 8;
constexpr int kGraphForwards = 20;  // forwards per captured graph
constexpr std::size_t kCopyBytes = std::size_t{2} << 30;
constexpr int kCopyRepeats = 10;

struct Options {
  std::string backend = "CUDA_FLASH";
  std::vector<std::string> specs;
  int num_heads = 32;
  int num_kv_heads = 8;
  int head_size = 128;
  int block_size = 16;
  std::string dtype = "bf16";
  std::vector<std::string> kv_cache_dtypes{"auto"};
  std::string kv_cache_layout = "NHD";  // the cache's physical order (docs/kv_layouts.md)
  int warmup = 5;
  int repeats = 30;
  std::string json;
  std::string label;
  bool batch_invariant = false;  // plan with BuilderParams::batch_invariant (its cost)
  // Capture the graph on the batch's first step (every context cut to its
  // query: the short plan a serving loop captures on) and replay the spec's
  // plan through it, as a captured decode replays later, longer steps.
  bool capture_short = false;
};

void check(int status, std::string_view what) { cuda::check_cuda(status, what); }

// Milliseconds of `fn` on the default stream, by CUDA events.
template <typename F>
double event_ms(F&& fn) {
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  check(cudaEventRecord(start, nullptr), "event");
  fn();
  check(cudaEventRecord(stop, nullptr), "event");
  check(cudaEventSynchronize(stop), "event");
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, start, stop), "event");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

// Random cache contents: int8 over its whole range (kInt8Max), other dtypes in [-1, 1).
// Per-token-head scales: uniform in [0.5, 1.5) / qmax, so values read back lie
// within about [-1.5, 1.5] as the other dtypes' do.
constexpr float kScaleLo = 0.5f;
constexpr float kScaleHi = 1.5f;

void fill(const Tensor& t, std::uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  check(cuda_kernels::launch_fill_uniform(t.data(), t.dtype(), t.numel(), seed, lo, hi, nullptr), "fill");
}

double copy_bandwidth_gb_s() {
  void* a = nullptr;
  void* b = nullptr;
  check(cudaMalloc(&a, kCopyBytes), "copy buffer");
  check(cudaMalloc(&b, kCopyBytes), "copy buffer");
  check(cudaMemset(a, 1, kCopyBytes), "copy buffer");
  std::vector<double> ms;
  for (int i = 0; i < kCopyRepeats; ++i) {
    ms.push_back(event_ms([&] { check(cudaMemcpyAsync(b, a, kCopyBytes, cudaMemcpyDeviceToDevice, nullptr), "copy"); }));
  }
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(kCopyBytes) / (bench::median_of(ms) * 1e-3) / 1e9;  // read + write
}

nlohmann::json run_spec(const Options& o, const std::string& spec, const std::string& kv_name,
                        const AttentionBackend& backend) {
  const auto dtype = parse_dtype(o.dtype);
  const auto kv = parse_cache_dtype(kv_name);
  if (!dtype) throw_invalid(kWhere, "--dtype", "f16 or bf16", o.dtype);
  if (!kv) throw_invalid(kWhere, "--kv-cache-dtype", "a vLLM cache dtype", kv_name);
  const auto layout = parse_kv_cache_layout(o.kv_cache_layout);
  if (!layout) throw_invalid(kWhere, "--kv-cache-layout", "NHD or HND", o.kv_cache_layout);
  const std::vector<bench::BatchRequest> requests = bench::parse_batch_spec(spec);
  std::mt19937 rng(1);
  std::int64_t blocks = 0;
  for (const auto& r : requests) blocks += (r.seq_len + o.block_size - 1) / o.block_size;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(blocks));
  std::iota(ids.begin(), ids.end(), 1);  // block 0 is the null block
  std::shuffle(ids.begin(), ids.end(), rng);
  std::vector<RequestSpec> specs;
  std::size_t next = 0;
  for (const auto& r : requests) {
    RequestSpec s{r.query_len, r.seq_len, {}};
    for (int b = 0; b < (r.seq_len + o.block_size - 1) / o.block_size; ++b) s.blocks.push_back(ids[next++]);
    specs.push_back(std::move(s));
  }
  const Device gpu = Device::cuda();
  const CommonAttentionMetadata common = make_common_metadata(specs, {o.block_size, true, gpu, 0});
  const int tokens = common.num_actual_tokens;

  const DType storage = kv_cache_storage_dtype(*kv, *dtype);
  // One allocation per layer, per-token-head scales included, as allocate_kv_caches makes it.
  const LayerKVCache layer_cache = allocate_layer_kv_cache(backend, blocks + 1, o.block_size, o.num_kv_heads,
                                                           o.head_size, *kv, *dtype, *layout, gpu);
  const Tensor& cache = layer_cache.cache;
  const Tensor& scales = layer_cache.scales;
  const bool int8 = storage == DType::I8;
  fill(cache, 7, int8 ? -kInt8Max : -1.0f, int8 ? kInt8Max : 1.0f);
  if (scales.defined()) {
    const float qmax = int8 ? kInt8Max : 1.0f;
    fill(scales, 13, kScaleLo / qmax, kScaleHi / qmax);
  }
  const Tensor query = Tensor::empty({tokens, o.num_heads, o.head_size}, *dtype, gpu);
  fill(query, 11);
  const Tensor out = Tensor::zeros({tokens, o.num_heads, o.head_size}, *dtype, gpu);
  const KVCacheView kv_view = backend.unbind_kv_cache(cache, scales);
  LayerQuantState layer;
  const std::vector<float> one{1.0f};
  for (Tensor* t : {&layer.k_scale, &layer.v_scale, &layer.q_scale, &layer.prob_scale}) {
    *t = Tensor::from_floats(one, {1}, DType::F32, gpu);
  }
  AttentionImplParams params;
  params.num_heads = o.num_heads;
  params.num_kv_heads = o.num_kv_heads;
  params.head_size = o.head_size;
  params.scale = 1.0f / std::sqrt(static_cast<float>(o.head_size));
  params.kv_cache_dtype = *kv;
  params.dtype = *dtype;
  params.device = gpu;
  auto impl = backend.make_impl(params);
  auto builder =
      backend.make_builder({o.block_size, o.num_kv_heads, o.head_size, gpu, {}, o.num_heads, o.batch_invariant});
  std::shared_ptr<const BackendMetadata> md = builder->build(common);
  impl->forward(layer, query, {}, {}, kv_view, *md, out, {});
  check(cudaDeviceSynchronize(), "forward");

  nlohmann::json j = {{"spec", bench::format_batch_spec(requests)},
                      {"num_reqs", common.num_reqs},
                      {"num_tokens", tokens},
                      {"backend", backend.name()},
                      {"heads", o.num_heads},
                      {"kv_heads", o.num_kv_heads},
                      {"head_size", o.head_size},
                      {"dtype", o.dtype},
                      {"kv_cache_dtype", kv_name},
                      {"kv_cache_layout", kv_cache_layout_name(*layout)},
                      {"label", o.label}};

  // ---- check sampled rows against REFERENCE (each as a decode of its prefix) ----
  const AttentionBackend& ref = *BackendRegistry::instance().find("REFERENCE");
  const int rows = std::min(kCheckRows, tokens);
  std::vector<RequestSpec> sub;
  std::vector<int> picked;
  const auto qsl = common.query_start_loc_host();
  for (int k = 0; k < rows; ++k) {
    const int t = rows == 1 ? tokens - 1 : static_cast<int>(static_cast<std::int64_t>(k) * (tokens - 1) / (rows - 1));
    int r = 0;
    while (qsl[static_cast<std::size_t>(r) + 1] <= t) ++r;
    const RequestSpec& req = specs[static_cast<std::size_t>(r)];
    sub.push_back(RequestSpec{1, req.seq_len - req.query_len + (t - qsl[static_cast<std::size_t>(r)]) + 1, req.blocks});
    picked.push_back(t);
  }
  const Tensor cache_cpu = cache.to(Device::cpu());
  const Tensor scales_cpu = scales.to(Device::cpu());
  const Tensor query_cpu = query.to(Device::cpu());
  const Tensor out_cpu = out.to(Device::cpu());
  Tensor q = Tensor::empty({rows, o.num_heads, o.head_size}, *dtype);
  Tensor got = Tensor::empty({rows, o.num_heads, o.head_size}, *dtype);
  for (int k = 0; k < rows; ++k) {
    const int t = picked[static_cast<std::size_t>(k)];
    copy_tensor(q.TensorView::slice(0, k, k + 1), query_cpu.TensorView::slice(0, t, t + 1));
    copy_tensor(got.TensorView::slice(0, k, k + 1), out_cpu.TensorView::slice(0, t, t + 1));
  }
  AttentionImplParams ref_params = params;
  ref_params.device = Device::cpu();
  LayerQuantState ref_layer;
  for (Tensor* t : {&ref_layer.k_scale, &ref_layer.v_scale, &ref_layer.q_scale, &ref_layer.prob_scale}) {
    *t = Tensor::from_floats(one, {1}, DType::F32);
  }
  const auto ref_md = ref.make_builder({o.block_size, o.num_kv_heads, o.head_size, Device::cpu(), {}})
                          ->build(make_common_metadata(sub, {o.block_size, true, Device::cpu(), 0}));
  Tensor want = Tensor::zeros({rows, o.num_heads, o.head_size}, *dtype);
  ref.make_impl(ref_params)
      ->forward(ref_layer, q, {}, {}, ref.unbind_kv_cache(cache_cpu, scales_cpu), *ref_md, want, {});
  OracleOutput expected;
  expected.num_tokens = rows;
  expected.num_heads = o.num_heads;
  expected.head_size = o.head_size;
  for (const float v : to_float_vector(want)) expected.output.push_back(v);
  if (const auto failure = compare_with_oracle(expected, to_float_vector(got), {}, *dtype)) {
    j["check_passed"] = false;
    j["check_message"] = *failure;
    return j;
  }
  j["check_passed"] = true;
  j["checked_rows"] = rows;

  // ---- timing ----
  for (int i = 0; i < o.warmup; ++i) impl->forward(layer, query, {}, {}, kv_view, *md, out, {});
  std::vector<double> eager;
  for (int i = 0; i < o.repeats; ++i) {
    eager.push_back(event_ms([&] { impl->forward(layer, query, {}, {}, kv_view, *md, out, {}); }));
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  // The spec's plan came first, so the workspace it grew holds the short one:
  // the graph's addresses stay valid when the spec's plan is uploaded again.
  std::shared_ptr<const BackendMetadata> captured = md;
  if (o.capture_short) {
    std::vector<RequestSpec> starts = specs;
    for (RequestSpec& s : starts) s.seq_len = s.query_len;
    captured = builder->build(make_common_metadata(starts, {o.block_size, true, gpu, 0}));
  }
  {
    ForwardContext ctx;
    ctx.stream = stream;
    ForwardContextScope scope(std::move(ctx));
    check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    for (int i = 0; i < kGraphForwards; ++i) impl->forward(layer, query, {}, {}, kv_view, *captured, out, {});
    check(cudaStreamEndCapture(stream, &graph), "capture");
  }
  if (o.capture_short) md = builder->build(common);
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  check(cudaGraphLaunch(exec, stream), "replay");
  check(cudaStreamSynchronize(stream), "replay");
  std::vector<double> replay;
  for (int i = 0; i < std::max(3, o.repeats / 3); ++i) {
    cudaEvent_t a = nullptr;
    cudaEvent_t b = nullptr;
    check(cudaEventCreate(&a), "event");
    check(cudaEventCreate(&b), "event");
    check(cudaEventRecord(a, stream), "event");
    check(cudaGraphLaunch(exec, stream), "replay");
    check(cudaEventRecord(b, stream), "event");
    check(cudaEventSynchronize(b), "event");
    float ms = 0.0f;
    check(cudaEventElapsedTime(&ms, a, b), "event");
    replay.push_back(ms / kGraphForwards);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  // The replays wrote `out` again: the checked eager forward's bits.
  if (to_float_vector(out.to(Device::cpu())) != to_float_vector(out_cpu)) {
    j["check_passed"] = false;
    j["check_message"] = "the graph replays' output differs from the checked eager forward's";
    return j;
  }
  std::vector<double> plan;
  for (int i = 0; i < o.repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    md = builder->build(common);
    plan.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  check(cudaDeviceSynchronize(), "plan");

  double pairs = 0.0;
  double kv_tokens = 0.0;
  for (const auto& r : requests) {
    const double ql = r.query_len;
    pairs += ql * (r.seq_len - r.query_len) + ql * (ql + 1) / 2;  // causal
    kv_tokens += r.seq_len;
  }
  const double hd = static_cast<double>(o.num_heads) * o.head_size;
  const double flops = 4.0 * pairs * hd;
  // Per-token-head caches also read one f32 K and V scale per (token, KV head).
  const double scale_bytes = scales.defined() ? static_cast<double>(sizeof(float)) : 0.0;
  const double bytes = kv_tokens * o.num_kv_heads * 2.0 *
                           (o.head_size * static_cast<double>(dtype_size(storage)) + scale_bytes) +
                       2.0 * tokens * hd * static_cast<double>(dtype_size(*dtype));
  const double ms = bench::median_of(replay);
  j.update({{"median_ms", ms}, {"eager_median_ms", bench::median_of(eager)}, {"plan_median_ms", bench::median_of(plan)},
            {"flops", flops}, {"bytes", bytes}, {"tflop_per_s", flops / (ms * 1e-3) / 1e12},
            {"tb_per_s", bytes / (ms * 1e-3) / 1e12}});
  return j;
}

int run(const Options& o) {
  BackendRegistry::instance();
  const AttentionBackend* backend = BackendRegistry::instance().find(o.backend);
  if (backend == nullptr) throw_invalid(kWhere, "--backend", BackendRegistry::instance().names(), o.backend);
  check_arg(!available_devices().empty() && find_device_allocator(DeviceType::CUDA) != nullptr, kWhere, "device",
            "a CUDA device", "none");
  nlohmann::json report = {{"copy_gb_per_s", copy_bandwidth_gb_s()}, {"runs", nlohmann::json::array()}};
  fmt::print("device-to-device copy: {:.0f} GB/s (read + write)\n", report["copy_gb_per_s"].get<double>());
  fmt::print("{:<16} {:>10} {:>10} {:>9} {:>9} {:>9}  {}\n", "spec", "graph ms", "eager ms", "plan ms", "TB/s",
             "TFLOP/s", "check");
  bool ok = true;
  // Several KV dtypes run each spec one after another, labelled with the dtype.
  const bool several = o.kv_cache_dtypes.size() > 1;
  for (const std::string& spec : o.specs) {
    for (const std::string& kv : o.kv_cache_dtypes) {
      nlohmann::json r = run_spec(o, spec, kv, *backend);
      const std::string name = several ? fmt::format("{} ({})", spec, kv) : spec;
      ok = ok && r["check_passed"].get<bool>();
      if (r["check_passed"].get<bool>()) {
        fmt::print("{:<16} {:>10.4f} {:>10.4f} {:>9.3f} {:>9.2f} {:>9.1f}  ok\n", name,
                   r["median_ms"].get<double>(), r["eager_median_ms"].get<double>(),
                   r["plan_median_ms"].get<double>(), r["tb_per_s"].get<double>(),
                   r["tflop_per_s"].get<double>());
      } else {
        fmt::print("{:<16} CHECK FAILED (no figures): {}\n", name, r["check_message"].get<std::string>());
      }
      report["runs"].push_back(std::move(r));
    }
  }
  if (!o.json.empty()) std::ofstream(o.json) << report.dump(2) << "\n";
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
  pagedattn::Options o;
  CLI::App app{"Times a CUDA attention backend on vLLM batch-spec workloads"};
  app.add_option("--backend", o.backend, "backend name");
  app.add_option("specs", o.specs, "batch specs, e.g. 64q1s4k 8q4k q2k_63q1s4k")->required();
  app.add_option("--heads", o.num_heads, "query heads");
  app.add_option("--kv-heads", o.num_kv_heads, "KV heads");
  app.add_option("--head-size", o.head_size, "head size");
  app.add_option("--block-size", o.block_size, "KV-cache block size");
  app.add_option("--dtype", o.dtype, "f16 or bf16");
  app.add_option(
         "--kv-cache-dtype", o.kv_cache_dtypes,
         "auto, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head, fp8_per_token_head; several (comma-separated) "
         "run each spec once per dtype")
      ->delimiter(',');
  app.add_option("--kv-cache-layout", o.kv_cache_layout, "NHD or HND: the cache's physical order");
  app.add_option("--warmup", o.warmup, "warm-up forwards");
  app.add_option("--repeats", o.repeats, "timed forwards");
  app.add_option("--json", o.json, "write the report here");
  app.add_option("--label", o.label, "free text stored with each run");
  app.add_flag("--batch-invariant", o.batch_invariant, "plan every request from itself alone (the cost of that mode)");
  app.add_flag("--capture-short", o.capture_short,
               "capture the graph on the batch with every context cut to its query, replay the spec's plan");
  CLI11_PARSE(app, argc, argv);
  try {
    return pagedattn::run(o);
  } catch (const std::exception& e) {
    fmt::print(stderr, "gpu_bench: {}\n", e.what());
    return 2;
  }
}
