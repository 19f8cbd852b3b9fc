#include "serving/serving_loop.h"

#include <pagedattn/conformance.h>
#include <pagedattn/backend/scalar.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>

namespace pagedattn::serving {
namespace {

constexpr std::uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ULL;
constexpr int kMantissaBits = 24;

// splitmix64: the layers draw millions of q/k/v values per step, and
// std::mt19937 + uniform_real_distribution would dominate the step time.
std::uint64_t next_u64(std::uint64_t& state) {
  std::uint64_t z = (state += kSplitMixGamma);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1).
float next_unit(std::uint64_t& state) {
  constexpr float kScale = 2.0f / static_cast<float>(1 << kMantissaBits);
  return static_cast<float>(next_u64(state) >> (64 - kMantissaBits)) * kScale - 1.0f;
}

// The value attention reads back after an fp8 cache stored the (already
// model-dtype) value `x` with scale 1.
float through_cache(float x, DType storage) {
  if (!is_fp8(storage)) return x;
  std::array<std::uint8_t, sizeof(std::uint64_t)> cell{};
  store_from_float(cell.data(), storage, x);
  return load_as_float(cell.data(), storage);
}

// The KV caches and their float shadows, every layer: refused with its size
// when beyond the machine's memory, rather than granted by the kernel and
// killed for later. The factors are validated ints: the product is formed in
// double, which cannot overflow.
void check_fits_in_memory(const ServingOptions& o) {
  constexpr double kKeyAndValue = 2.0;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double rows = static_cast<double>(o.layers) * o.num_kv_blocks * o.block_size * o.kv_heads * o.head_size;
  const auto storage = static_cast<double>(dtype_size(kv_cache_storage_dtype(o.cache_dtype, o.dtype)));
  const double bytes = rows * kKeyAndValue * (storage + sizeof(float));
  const double memory =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (memory > 0 && bytes > memory) {
    throw Error(ErrorKind::OutOfMemory,
                fmt::format("ServingLoop: {} layers of {} KV blocks need about {:.1f} GiB (caches and their "
                            "oracle shadows), more than this machine's {:.1f} GiB of memory",
                            o.layers, o.num_kv_blocks, bytes / kGiB, memory / kGiB));
  }
}

// Products of the counts below size the q/k/v rows and the K/V shadows: each
// count is checked, and the products are formed in 64 bits against a bound.
const ServingOptions& validated(const ServingOptions& o) {
  constexpr const char* kWhere = "ServingLoop";
  check_arg(o.layers >= 1, kWhere, "layers", ">= 1", o.layers);
  check_arg(o.heads >= 1, kWhere, "heads", ">= 1", o.heads);
  check_arg(o.kv_heads >= 1, kWhere, "kv_heads", ">= 1", o.kv_heads);
  check_arg(o.head_size >= 1, kWhere, "head_size", ">= 1", o.head_size);
  check_arg(o.block_size >= 1, kWhere, "block_size", ">= 1", o.block_size);
  check_arg(o.num_kv_blocks >= 2, kWhere, "num_kv_blocks", ">= 2 (the null block and one more)",
            o.num_kv_blocks);
  check_arg(o.token_budget >= 1, kWhere, "token_budget", ">= 1", o.token_budget);
  check_arg(o.max_num_seqs >= 1, kWhere, "max_num_seqs", ">= 1", o.max_num_seqs);
  check_arg(o.check_every >= 0, kWhere, "check_every", ">= 0", o.check_every);
  constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();
  const std::int64_t qkv_width = (std::int64_t{o.heads} + 2 * std::int64_t{o.kv_heads}) * o.head_size;
  check_arg(qkv_width <= kMaxInt, kWhere, "(heads + 2 * kv_heads) * head_size", fmt::format("<= {}", kMaxInt),
            qkv_width);
  const std::int64_t slots = std::int64_t{o.num_kv_blocks} * o.block_size;
  check_arg(slots <= kMaxInt, kWhere, "num_kv_blocks * block_size", fmt::format("<= {}", kMaxInt), slots);
  check_fits_in_memory(o);
  return o;
}

}  // namespace

ServingLoop::ServingLoop(const ServingOptions& o, const AttentionBackend& backend,
                         std::vector<TraceRequest> trace)
    : options_(validated(o)),
      model_(ModelOptions{o.dtype, Device::cpu(), 1, std::string(backend.name())}),
      kv_(KVCacheManagerOptions{o.num_kv_blocks, o.block_size, o.prefix_caching, std::nullopt}),
      trace_(std::move(trace)),
      rng_state_(o.seed) {
  CacheConfig cache;
  cache.block_size = o.block_size;
  cache.cache_dtype = o.cache_dtype;
  const float scale = 1.0f / std::sqrt(static_cast<float>(o.head_size));
  for (int l = 0; l < o.layers; ++l) {
    AttentionOptions opts;
    opts.num_kv_heads = o.kv_heads;
    opts.cache_config = cache;
    opts.prefix = fmt::format("model.layers.{}.self_attn.attn", l);
    layers_.push_back(std::make_unique<Attention>(model_, o.heads, o.head_size, scale, opts));
  }
  KVCacheAllocationOptions alloc;
  alloc.num_blocks = o.num_kv_blocks;
  alloc.reserve_null_block = true;
  allocation_ = allocate_kv_caches(model_, alloc);
  builder_ = std::make_unique<ModelMetadataBuilder>(model_);
  const std::size_t shadow_size = static_cast<std::size_t>(o.num_kv_blocks) *
                                  static_cast<std::size_t>(o.block_size) *
                                  static_cast<std::size_t>(o.kv_heads) * static_cast<std::size_t>(o.head_size);
  key_shadow_.assign(static_cast<std::size_t>(o.layers), std::vector<float>(shadow_size));
  value_shadow_.assign(static_cast<std::size_t>(o.layers), std::vector<float>(shadow_size));
  stats_.requests = static_cast<int>(trace_.size());
}

ServingLoop::~ServingLoop() = default;

void ServingLoop::admit_arrivals() {
  // Idle: jump to the next arrival rather than spinning empty steps.
  if (running_.empty() && waiting_.empty() && next_arrival_ < trace_.size()) {
    clock_ = std::max(clock_, trace_[next_arrival_].arrival_step);
  }
  while (next_arrival_ < trace_.size() && trace_[next_arrival_].arrival_step <= clock_) {
    TraceRequest& r = trace_[next_arrival_++];
    const int total = static_cast<int>(r.prompt.size()) + r.output_len;
    if (!kv_.can_fit(total)) {
      ++stats_.rejected;
      stats_.messages.push_back(
          fmt::format("request {} rejected: {} tokens need more than the {} usable KV blocks", r.id, total,
                      kv_.pool().num_usable_blocks()));
      continue;
    }
    stats_.prompt_tokens += static_cast<std::int64_t>(r.prompt.size());
    progress_[r.id] = Progress{r.output_len, 0};
    kv_.add_request(r.id, std::move(r.prompt));
    waiting_.push_back(r.id);
  }
}

std::vector<ServingLoop::Scheduled> ServingLoop::schedule() {
  std::vector<Scheduled> batch;
  int budget = options_.token_budget;
  bool preempted = false;
  // Running requests first, in admission order; under memory pressure the
  // newest running request is preempted (possibly the one being scheduled).
  for (std::size_t i = 0; i < running_.size() && budget > 0; ++i) {
    const RequestId id = running_[i];
    const int n = std::min(kv_.num_tokens(id) - kv_.num_computed_tokens(id), budget);
    bool self_preempted = false;
    while (!kv_.allocate_slots(id, n)) {
      const RequestId victim = running_.back();
      running_.pop_back();
      kv_.preempt(victim);
      waiting_.push_front(victim);
      ++stats_.preemptions;
      preempted = true;
      if (victim == id) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    batch.push_back({id, n});
    budget -= n;
  }
  // Waiting requests (new, or preempted and recomputed) only when nothing
  // was preempted this step, as vLLM does.
  while (!preempted && budget > 0 && !waiting_.empty() &&
         static_cast<int>(running_.size()) < options_.max_num_seqs) {
    const RequestId id = waiting_.front();
    const ComputedBlocks hit = kv_.get_computed_blocks(id);
    const int n = std::min(kv_.num_tokens(id) - hit.num_tokens, budget);
    if (!kv_.allocate_slots(id, n, hit)) break;
    waiting_.pop_front();
    running_.push_back(id);
    batch.push_back({id, n});
    budget -= n;
  }
  return batch;
}

void ServingLoop::run_layers(const std::vector<Scheduled>& batch, bool check) {
  std::vector<RequestSpec> specs;
  int num_tokens = 0;
  for (const Scheduled& s : batch) {
    specs.push_back(kv_.request_spec(s.id, s.num_tokens));
    num_tokens += s.num_tokens;
  }
  MetadataOptions md_opts;
  md_opts.block_size = options_.block_size;
  const CommonAttentionMetadata common = make_common_metadata(specs, md_opts);
  const auto* slots = common.slot_mapping.data_as<std::int64_t>();
  ForwardContext ctx;
  ctx.layer_metadata = builder_->build(common);
  if (builder_->last_step_used_cascade()) ++stats_.cascade_steps;
  ForwardContextScope scope(std::move(ctx));

  const int q_width = options_.heads * options_.head_size;
  const int kv_width = options_.kv_heads * options_.head_size;
  const int qkv_width = q_width + 2 * kv_width;
  const DType storage = kv_cache_storage_dtype(options_.cache_dtype, options_.dtype);
  std::vector<float> qkv(static_cast<std::size_t>(num_tokens) * static_cast<std::size_t>(qkv_width));
  for (int l = 0; l < options_.layers; ++l) {
    for (float& x : qkv) x = next_unit(rng_state_);
    // One fused qkv projection output; q, k and v are strided views into it.
    const Tensor fused = Tensor::from_floats(qkv, Dims{num_tokens, qkv_width}, options_.dtype);
    const auto start = std::chrono::steady_clock::now();
    const Tensor out = layers_[static_cast<std::size_t>(l)]->forward(
        fused.slice(1, 0, q_width), fused.slice(1, q_width, q_width + kv_width),
        fused.slice(1, q_width + kv_width, qkv_width));
    stats_.forward_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    // Every step updates the shadow (later checks read it); rows as stored.
    const std::vector<float> rounded = to_float_vector(fused);
    auto& keys = key_shadow_[static_cast<std::size_t>(l)];
    auto& values = value_shadow_[static_cast<std::size_t>(l)];
    for (int t = 0; t < num_tokens; ++t) {
      const float* src = rounded.data() + static_cast<std::size_t>(t) * qkv_width;
      const auto dst = static_cast<std::size_t>(slots[t]) * static_cast<std::size_t>(kv_width);
      for (int c = 0; c < kv_width; ++c) {
        keys[dst + static_cast<std::size_t>(c)] = through_cache(src[q_width + c], storage);
        values[dst + static_cast<std::size_t>(c)] = through_cache(src[q_width + kv_width + c], storage);
      }
    }
    if (!check) continue;

    OracleProblem problem;
    problem.num_heads = options_.heads;
    problem.num_kv_heads = options_.kv_heads;
    problem.head_size = options_.head_size;
    problem.scale = 1.0 / std::sqrt(static_cast<double>(options_.head_size));
    int row = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      const RequestSpec& spec = specs[i];
      OracleRequest req;
      req.query_len = spec.query_len;
      req.kv_len = spec.seq_len;
      for (int t = row; t < row + spec.query_len; ++t) {
        const float* src = rounded.data() + static_cast<std::size_t>(t) * qkv_width;
        req.query.insert(req.query.end(), src, src + q_width);
      }
      // The whole history, read through the block table from the shadow.
      for (const std::int64_t slot : slots_for_positions(spec.blocks, options_.block_size, 0, spec.seq_len)) {
        const auto at = static_cast<std::size_t>(slot) * static_cast<std::size_t>(kv_width);
        req.key.insert(req.key.end(), keys.begin() + static_cast<std::ptrdiff_t>(at),
                       keys.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(kv_width)));
        req.value.insert(
            req.value.end(), values.begin() + static_cast<std::ptrdiff_t>(at),
            values.begin() + static_cast<std::ptrdiff_t>(at + static_cast<std::size_t>(kv_width)));
      }
      problem.requests.push_back(std::move(req));
      row += spec.query_len;
    }
    const OracleOutput expected = dense_attention(problem);
    if (auto failure = compare_with_oracle(expected, to_float_vector(out), {}, options_.dtype)) {
      ++stats_.checks_failed;
      stats_.messages.push_back(
          fmt::format("step {} layer {}: check FAILED: {}", stats_.steps + 1, l, *failure));
    } else {
      ++stats_.checks_passed;
    }
  }
  stats_.computed_tokens += num_tokens;
}

void ServingLoop::record_kv_usage() {
  // Slots of referenced blocks that hold (or are being filled with) a token;
  // a shared block counts once.
  const int bs = options_.block_size;
  std::unordered_map<std::int32_t, int> filled;
  for (const RequestId id : running_) {
    const auto table = kv_.block_table(id);
    const int computed = kv_.num_computed_tokens(id);
    for (std::size_t i = 0; i < table.size(); ++i) {
      if (table[i] == kNullBlockId) continue;
      const int in_block = std::min(bs, computed - static_cast<int>(i) * bs);
      int& f = filled[table[i]];
      f = std::max(f, in_block);
    }
  }
  const std::int64_t allocated = static_cast<std::int64_t>(kv_.pool().num_used_blocks()) * bs;
  std::int64_t held = 0;
  for (const auto& [block, f] : filled) held += f;
  stats_.allocated_slots += allocated;
  stats_.empty_slots += allocated - held;
  stats_.peak_kv_usage = std::max(stats_.peak_kv_usage, kv_.pool().usage());
}

void ServingLoop::finish_step(const std::vector<Scheduled>& batch) {
  for (const Scheduled& s : batch) {
    if (kv_.num_computed_tokens(s.id) < kv_.num_tokens(s.id)) continue;  // prefill chunk: nothing sampled
    Progress& p = progress_[s.id];
    ++p.generated;
    ++stats_.generated_tokens;
    if (p.generated >= p.output_len) {
      kv_.free(s.id);
      running_.erase(std::find(running_.begin(), running_.end(), s.id));
      progress_.erase(s.id);
      ++stats_.finished;
      continue;
    }
    const auto sampled = static_cast<std::int32_t>(next_u64(rng_state_) % kVocabSize);
    kv_.append_tokens(s.id, std::span<const std::int32_t>(&sampled, 1));
  }
}

bool ServingLoop::step() {
  const auto start = std::chrono::steady_clock::now();
  admit_arrivals();
  if (running_.empty() && waiting_.empty() && next_arrival_ >= trace_.size()) return false;
  const std::vector<Scheduled> batch = schedule();
  ++clock_;
  empty_steps_ = batch.empty() ? empty_steps_ + 1 : 0;
  if (empty_steps_ > 1) {
    // A step may be empty after preempting everything; the next one admits a
    // request, which fits an idle pool (admission checked it). Two in a row is a bug.
    throw Error(ErrorKind::OutOfMemory, fmt::format("serving loop: no request could be scheduled at step {} "
                                                    "({} waiting, {} free KV blocks)",
                                                    clock_, waiting_.size(), kv_.pool().num_free_blocks()));
  }
  if (!batch.empty()) {
    record_kv_usage();
    const bool check = options_.check_every > 0 && (stats_.steps + 1) % options_.check_every == 0;
    run_layers(batch, check);
    finish_step(batch);
    ++stats_.steps;
  }
  stats_.prefix_hit_rate = kv_.prefix_cache_stats().hit_rate();
  stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return true;
}

}  // namespace pagedattn::serving
