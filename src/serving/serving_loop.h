// The continuous-batching serving loop of `pagedattn run`: a vLLM-v1-style
// scheduler (running requests first, then waiting ones, under a token budget
// with chunked prefill; preemption of the newest running request when the KV
// cache manager refuses) driving a model-shaped stack of Attention layers
// with random q/k/v, checked every N-th step against the dense fp64 oracle.
#pragma once

#include <pagedattn/attention.h>
#include <pagedattn/kv_cache_manager.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "serving/serving_trace.h"

namespace pagedattn::serving {

struct ServingOptions {
  int layers = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_size = 0;
  DType dtype = DType::BF16;
  CacheDType cache_dtype = CacheDType::Auto;
  int block_size = 0;
  int num_kv_blocks = 0;  // including the null block
  int token_budget = 0;   // tokens per step
  int max_num_seqs = 0;   // running requests at most
  int check_every = 0;    // check every N-th step against the oracle; 0 = never
  bool prefix_caching = true;
  std::uint32_t seed = 0;
};

struct ServingStats {
  int requests = 0;
  int finished = 0;
  int rejected = 0;  // could never fit in the pool
  int preemptions = 0;
  int steps = 0;
  int cascade_steps = 0;  // steps planned as cascades (requests sharing a long cached prefix)
  std::int64_t prompt_tokens = 0;
  std::int64_t generated_tokens = 0;
  std::int64_t computed_tokens = 0;  // every token the layers ran (prefill, recompute, decode)
  double seconds = 0.0;              // wall time of the steps, checks included
  double forward_seconds = 0.0;      // inside Attention::forward
  double peak_kv_usage = 0.0;
  std::int64_t allocated_slots = 0;  // summed over steps
  std::int64_t empty_slots = 0;      // allocated slots holding no token, summed over steps
  double prefix_hit_rate = 0.0;
  int checks_passed = 0;
  int checks_failed = 0;
  std::vector<std::string> messages;  // check failures and rejections, in order

  double kv_waste() const {
    return allocated_slots == 0 ? 0.0
                                : static_cast<double>(empty_slots) / static_cast<double>(allocated_slots);
  }
};

class ServingLoop {
 public:
  ServingLoop(const ServingOptions& options, const AttentionBackend& backend,
              std::vector<TraceRequest> trace);
  ~ServingLoop();
  ServingLoop(const ServingLoop&) = delete;
  ServingLoop& operator=(const ServingLoop&) = delete;
  ServingLoop(ServingLoop&&) = delete;
  ServingLoop& operator=(ServingLoop&&) = delete;

  // Runs one step; false once every request has finished or been rejected.
  bool step();

  const ServingStats& stats() const { return stats_; }
  double kv_usage() const { return kv_.pool().usage(); }
  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  const KVCacheAllocation& allocation() const { return allocation_; }
  const Attention& first_layer() const { return *layers_.front(); }

 private:
  struct Scheduled {
    RequestId id = 0;
    int num_tokens = 0;
  };
  struct Progress {
    int output_len = 0;
    int generated = 0;
  };
  void admit_arrivals();
  std::vector<Scheduled> schedule();
  void run_layers(const std::vector<Scheduled>& batch, bool check);
  void record_kv_usage();
  void finish_step(const std::vector<Scheduled>& batch);

  ServingOptions options_;
  ModelContext model_;
  std::vector<std::unique_ptr<Attention>> layers_;
  KVCacheAllocation allocation_;
  std::unique_ptr<ModelMetadataBuilder> builder_;
  KVCacheManager kv_;
  std::vector<TraceRequest> trace_;
  std::size_t next_arrival_ = 0;
  int clock_ = 0;        // step index arrivals are compared with
  int empty_steps_ = 0;  // consecutive steps that scheduled nothing
  std::deque<RequestId> waiting_;
  std::vector<RequestId> running_;  // admission order: the last is preempted first
  std::unordered_map<RequestId, Progress> progress_;
  // Per layer, per slot: the K and V rows as attention reads them back
  // ([num_kv_blocks * block_size, Hkv * D] each), so the oracle sees what a
  // prefix-cache hit really reuses.
  std::vector<std::vector<float>> key_shadow_;
  std::vector<std::vector<float>> value_shadow_;
  std::uint64_t rng_state_;
  ServingStats stats_;
};

}  // namespace pagedattn::serving
