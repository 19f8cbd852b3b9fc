// `pagedattn run`, the main job: a model-shaped stack of Attention layers run
// over a few steps of a mixed prefill+decode batch, every layer of every step
// checked against the dense fp64 oracle (which never sees the page table).
#include <nlohmann/json.hpp>
#include <pagedattn/attention.h>
#include <pagedattn/conformance.h>
#include <pagedattn/selector.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <fstream>
#include <random>

#include "commands.h"

namespace pagedattn::cli {
namespace {

struct RunOptions {
  int layers = 4;  // default shape: Llama-3-8B attention
  int heads = 32;
  int kv_heads = 8;
  int head_size = 128;
  std::string dtype = "bf16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  int steps = 12;  // enough for every synthetic request to finish
  int token_budget = 192;  // tokens per step (chunked prefill fills what decodes leave)
  std::string backend = "auto";
  std::uint32_t seed = 0;
  std::string json;
};

// Prompt and output lengths of the synthetic requests: odd sizes, one prompt
// longer than the step budget so it is prefilled in chunks.
constexpr std::array<std::pair<int, int>, 6> kRequests = {
    {{96, 6}, {37, 4}, {250, 3}, {17, 8}, {64, 5}, {131, 2}}};
constexpr float kInputRange = 1.0f;  // q/k/v drawn uniformly from [-1, 1]

struct Request {
  int prompt_len = 0;
  int output_len = 0;
  int computed = 0;  // tokens already in the KV cache
  std::vector<std::int32_t> blocks;
  // Per layer: every K/V row written so far, as attention reads it back.
  std::vector<std::vector<float>> keys;
  std::vector<std::vector<float>> values;
  bool finished() const { return computed >= prompt_len + output_len - 1; }
};

// A fixed pool of blocks with block 0 reserved as the null block.
class BlockPool {
 public:
  explicit BlockPool(int num_blocks) {
    for (int b = num_blocks - 1; b >= 1; --b) free_.push_back(b);
    capacity_ = num_blocks - 1;
  }
  void grow(Request& r, int tokens, int block_size) {
    const int needed = (tokens + block_size - 1) / block_size;
    while (static_cast<int>(r.blocks.size()) < needed) {
      if (free_.empty()) throw Error(ErrorKind::OutOfMemory, "run: the KV block pool is exhausted");
      r.blocks.push_back(free_.back());
      free_.pop_back();
    }
    peak_used_ = std::max(peak_used_, capacity_ - static_cast<int>(free_.size()));
  }
  void release(Request& r) {
    free_.insert(free_.end(), r.blocks.begin(), r.blocks.end());
    r.blocks.clear();
  }
  int capacity() const { return capacity_; }
  int peak_used() const { return peak_used_; }

 private:
  std::vector<std::int32_t> free_;
  int capacity_ = 0;
  int peak_used_ = 0;
};

// The value attention reads back after the cache stored `x`.
float as_cached(float x, DType model_dtype, CacheDType cache_dtype, float scale) {
  const DType storage = kv_cache_storage_dtype(cache_dtype, model_dtype);
  std::array<std::uint8_t, sizeof(std::uint64_t)> cell{};  // wide enough for any dtype
  store_from_float(cell.data(), model_dtype, x);
  const float input = load_as_float(cell.data(), model_dtype);
  if (!is_fp8(storage)) return input;
  store_from_float(cell.data(), storage, input / scale);
  return load_as_float(cell.data(), storage) * scale;
}

struct StepPlan {
  std::vector<int> request_ids;
  std::vector<int> query_lens;
  int decodes = 0;
  int prefill_tokens = 0;
};

// Decodes first (one token each), then prefill chunks in arrival order until
// the budget is spent, as vLLM's scheduler does with chunked prefill.
StepPlan schedule(const std::vector<Request>& requests, int budget) {
  StepPlan plan;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < static_cast<int>(requests.size()) && budget > 0; ++i) {
      const Request& r = requests[static_cast<std::size_t>(i)];
      if (r.finished()) continue;
      const bool decoding = r.computed >= r.prompt_len;
      if (decoding != (pass == 0)) continue;
      const int q = decoding ? 1 : std::min(budget, r.prompt_len - r.computed);
      plan.request_ids.push_back(i);
      plan.query_lens.push_back(q);
      budget -= q;
      if (decoding) {
        ++plan.decodes;
      } else {
        plan.prefill_tokens += q;
      }
    }
  }
  return plan;
}

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

int run_main_job(const RunOptions& o) {
  const auto dtype = parse_dtype(o.dtype);
  if (!dtype) throw_invalid("run", "--dtype", "f32, f16 or bf16", o.dtype);
  const auto cache_dtype = parse_cache_dtype(o.kv_cache_dtype);
  if (!cache_dtype) throw_invalid("run", "--kv-cache-dtype", "auto, fp8, fp8_e4m3 or fp8_e5m2", o.kv_cache_dtype);

  SelectorConfig cfg;
  cfg.head_size = o.head_size;
  cfg.dtype = *dtype;
  cfg.kv_cache_dtype = *cache_dtype;
  cfg.block_size = o.block_size;
  std::string how;
  const AttentionBackend& backend = choose_backend(o, cfg, how);

  ModelContext model(ModelOptions{*dtype, Device::cpu(), 1, std::string(backend.name())});
  CacheConfig cache;
  cache.block_size = o.block_size;
  cache.cache_dtype = *cache_dtype;
  const float scale = 1.0f / std::sqrt(static_cast<float>(o.head_size));
  std::vector<std::unique_ptr<Attention>> layers;
  for (int l = 0; l < o.layers; ++l) {
    AttentionOptions opts;
    opts.num_kv_heads = o.kv_heads;
    opts.cache_config = cache;
    opts.prefix = fmt::format("model.layers.{}.self_attn.attn", l);
    layers.push_back(std::make_unique<Attention>(model, o.heads, o.head_size, scale, opts));
  }

  int total_tokens = 0;
  for (const auto& [prompt, output] : kRequests) total_tokens += prompt + output;
  const int num_blocks = total_tokens / o.block_size + static_cast<int>(kRequests.size()) + 2;
  KVCacheAllocationOptions alloc_opts;
  alloc_opts.num_blocks = num_blocks;
  alloc_opts.reserve_null_block = true;
  const KVCacheAllocation alloc = allocate_kv_caches(model, alloc_opts);

  fmt::print("pagedattn run: {} layers of {}/{} heads, head size {}, {}, KV cache {}, block size {}\n", o.layers,
             o.heads, o.kv_heads, o.head_size, *dtype, cache_dtype_name(*cache_dtype), o.block_size);
  fmt::print("backend: {} ({})\n", backend.name(), how);
  fmt::print("KV cache: {} blocks, {:.1f} MiB over {} layers; {}\n", num_blocks,
             static_cast<double>(alloc.bytes) / (1024.0 * 1024.0), alloc.num_cache_layers, layers[0]->extra_repr());

  std::vector<Request> requests;
  for (const auto& [prompt, output] : kRequests) {
    Request r;
    r.prompt_len = prompt;
    r.output_len = output;
    r.keys.resize(static_cast<std::size_t>(o.layers));
    r.values.resize(static_cast<std::size_t>(o.layers));
    requests.push_back(std::move(r));
  }
  BlockPool pool(num_blocks);
  ModelMetadataBuilder builder(model);
  std::mt19937 rng(o.seed);
  std::uniform_real_distribution<float> uniform(-kInputRange, kInputRange);
  const int q_width = o.heads * o.head_size;
  const int kv_width = o.kv_heads * o.head_size;
  const int qkv_width = q_width + 2 * kv_width;

  int passed = 0;
  int failed = 0;
  int steps_run = 0;
  int tokens_done = 0;
  double forward_seconds = 0.0;
  nlohmann::json step_log = nlohmann::json::array();
  for (int step = 0; step < o.steps; ++step) {
    const StepPlan plan = schedule(requests, o.token_budget);
    if (plan.request_ids.empty()) break;
    std::vector<RequestSpec> specs;
    int num_tokens = 0;
    for (std::size_t i = 0; i < plan.request_ids.size(); ++i) {
      Request& r = requests[static_cast<std::size_t>(plan.request_ids[i])];
      const int seq_len = r.computed + plan.query_lens[i];
      pool.grow(r, seq_len, o.block_size);
      specs.push_back(RequestSpec{plan.query_lens[i], seq_len, r.blocks});
      num_tokens += plan.query_lens[i];
    }
    MetadataOptions md_opts;
    md_opts.block_size = o.block_size;
    const CommonAttentionMetadata common = make_common_metadata(specs, md_opts);
    ForwardContext ctx;
    ctx.layer_metadata = builder.build(common);
    ForwardContextScope scope(std::move(ctx));

    int step_failed = 0;
    double step_seconds = 0.0;
    for (int l = 0; l < o.layers; ++l) {
      // One fused qkv projection output; q, k and v are strided views into it.
      std::vector<float> qkv(static_cast<std::size_t>(num_tokens) * qkv_width);
      for (float& x : qkv) x = uniform(rng);
      const Tensor fused = Tensor::from_floats(qkv, Dims{num_tokens, qkv_width}, *dtype);
      const Tensor q = fused.slice(1, 0, q_width);
      const Tensor k = fused.slice(1, q_width, q_width + kv_width);
      const Tensor v = fused.slice(1, q_width + kv_width, qkv_width);
      const auto start = std::chrono::steady_clock::now();
      const Tensor out = layers[static_cast<std::size_t>(l)]->forward(q, k, v);
      step_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

      OracleProblem problem;
      problem.num_heads = o.heads;
      problem.num_kv_heads = o.kv_heads;
      problem.head_size = o.head_size;
      problem.scale = scale;
      int row = 0;
      for (std::size_t i = 0; i < plan.request_ids.size(); ++i) {
        Request& r = requests[static_cast<std::size_t>(plan.request_ids[i])];
        OracleRequest req;
        req.query_len = plan.query_lens[i];
        req.kv_len = r.computed + req.query_len;
        auto& keys = r.keys[static_cast<std::size_t>(l)];
        auto& values = r.values[static_cast<std::size_t>(l)];
        for (int t = row; t < row + req.query_len; ++t) {
          const float* src = qkv.data() + static_cast<std::size_t>(t) * qkv_width;
          for (int c = 0; c < q_width; ++c) req.query.push_back(as_cached(src[c], *dtype, CacheDType::Auto, 1.0f));
          for (int c = 0; c < kv_width; ++c) {
            keys.push_back(as_cached(src[q_width + c], *dtype, *cache_dtype, 1.0f));
            values.push_back(as_cached(src[q_width + kv_width + c], *dtype, *cache_dtype, 1.0f));
          }
        }
        req.key = keys;
        req.value = values;
        problem.requests.push_back(std::move(req));
        row += plan.query_lens[i];
      }
      const OracleOutput expected = dense_attention(problem);
      const std::vector<float> got = to_float_vector(out);
      if (auto failure = compare_with_oracle(expected, got, {}, *dtype)) {
        fmt::print("  step {} layer {}: check FAILED: {}\n", step + 1, l, *failure);
        ++failed;
        ++step_failed;
      } else {
        ++passed;
      }
    }
    for (std::size_t i = 0; i < plan.request_ids.size(); ++i) {
      Request& r = requests[static_cast<std::size_t>(plan.request_ids[i])];
      r.computed += plan.query_lens[i];
      if (r.finished()) pool.release(r);
    }
    ++steps_run;
    tokens_done += num_tokens;
    forward_seconds += step_seconds;
    fmt::print("step {}: {} requests ({} decodes, {} prefill tokens), {} tokens, {:.2f} ms/layer, check {}\n",
               step + 1, plan.request_ids.size(), plan.decodes, plan.prefill_tokens, num_tokens,
               step_seconds * 1e3 / o.layers, step_failed == 0 ? "ok" : "FAILED");
    step_log.push_back({{"step", step + 1},
                        {"requests", plan.request_ids.size()},
                        {"decodes", plan.decodes},
                        {"prefill_tokens", plan.prefill_tokens},
                        {"tokens", num_tokens},
                        {"ms_per_layer", step_seconds * 1e3 / o.layers},
                        {"check_failed", step_failed}});
  }
  const auto finished = std::count_if(requests.begin(), requests.end(), [](const Request& r) { return r.finished(); });
  fmt::print("summary: {} steps, {} requests ({} finished), {} tokens, {:.2f} ms per layer-step, "
             "{:.0f} tokens/s per layer, peak KV blocks {}/{}\n",
             steps_run, requests.size(), finished, tokens_done, forward_seconds * 1e3 / (steps_run * o.layers),
             tokens_done * o.layers / std::max(forward_seconds, 1e-12), pool.peak_used(), pool.capacity());
  fmt::print("check: {} passed, {} failed\n", passed, failed);
  if (!o.json.empty()) {
    nlohmann::json report = {{"backend", backend.name()},
                             {"layers", o.layers},
                             {"steps", step_log},
                             {"tokens", tokens_done},
                             {"peak_kv_blocks", pool.peak_used()},
                             {"kv_blocks", pool.capacity()},
                             {"check_passed", passed},
                             {"check_failed", failed}};
    std::ofstream(o.json) << report.dump(2) << "\n";
  }
  return failed == 0 ? kExitOk : kExitFailed;
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("run", "The main job: a stack of attention layers over mixed batches, checked");
  auto o = std::make_shared<RunOptions>();
  cmd->add_option("--layers", o->layers, "Attention layers")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--heads", o->heads, "Query heads")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--head-size", o->head_size, "Head size")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--dtype", o->dtype, "Model dtype")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", o->kv_cache_dtype, "KV cache dtype")->capture_default_str();
  cmd->add_option("--block-size", o->block_size, "KV block size")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--steps", o->steps, "Steps to run")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--token-budget", o->token_budget, "Tokens per step")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--backend", o->backend, "Backend name, or auto")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Random seed")->capture_default_str();
  cmd->add_option("--json", o->json, "Also write the report as JSON to this file");
  cmd->callback([o, &exit_code] { exit_code = run_main_job(*o); });
}

}  // namespace pagedattn::cli
