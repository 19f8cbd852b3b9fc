// A plan/run attention wrapper in FlashInfer's style, for callers that keep
// their own paged caches and block tables (the Python package's
// BatchAttention, vLLM-style kernel calls): plan() once per step from host
// lengths and block tables, run() per layer. The backend is picked by the
// selector once, at construction.
//
// For CUDA graphs: with fixed capacities (max_num_reqs, max_num_tokens,
// max_blocks_per_req) every device array plan() writes stays at one address,
// so a run() captured once replays any later plan of the same token count.
#pragma once

#include <pagedattn/attention_types.h>
#include <pagedattn/backend/backend.h>
#include <pagedattn/cascade.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace pagedattn {

struct BatchAttentionOptions {
  int num_heads = 0;
  int num_kv_heads = 0;  // 0 = num_heads
  int head_size = 0;
  std::optional<float> scale{};  // unset = 1 / sqrt(head_size)
  DType dtype = DType::BF16;     // query and output dtype
  CacheDType kv_cache_dtype = CacheDType::Auto;
  int block_size = 16;
  Device device = Device::cpu();
  bool causal = true;
  std::optional<int> sliding_window{};    // keys p - W < j <= p
  std::optional<float> logits_soft_cap{};
  std::vector<float> alibi_slopes{};      // [num_heads] or empty
  std::vector<float> sinks{};             // [num_heads] sink logits or empty
  std::optional<int> attention_chunk_size{};  // chunked local attention; a multiple of block_size
  // PrefixLM (vLLM's use_mm_prefix): plan() takes per-step ranges that widen
  // the causal mask (docs/semantics.md); causal, without attention_chunk_size.
  bool use_mm_prefix = false;
  std::string backend{};                  // empty or "auto" = the selector's choice
  // Only a backend whose result for a request is the same bits whatever else
  // is in the batch (vLLM's VLLM_BATCH_INVARIANT).
  bool batch_invariant = false;
  // Cascade attention (cascade.h) for steps whose requests share a long
  // prefix; never with fixed capacities (its buffers are per step).
  bool cascade = true;
  // Fixed capacities (all three set, or none): plan() never reallocates and
  // rejects a step that exceeds them. Unset = grow as needed.
  int max_num_reqs = 0;
  int max_num_tokens = 0;
  int max_blocks_per_req = 0;
};

class BatchAttention {
 public:
  // Throws InvalidArgument on bad sizes and Unsupported when no backend (or
  // not the named one) fits the options.
  explicit BatchAttention(BatchAttentionOptions options);
  ~BatchAttention();
  BatchAttention(const BatchAttention&) = delete;
  BatchAttention& operator=(const BatchAttention&) = delete;

  // Plans one step from host arrays (vLLM's CommonAttentionMetadata fields):
  //   query_start_loc  [B+1] i32, non-decreasing from 0
  //   seq_lens         [B] i32, context + query tokens of each request
  //   block_table      [B, stride] i32 row-major, row r holding at least
  //                    ceil(seq_lens[r] / block_size) block ids
  // and the slot mapping of the query tokens (run() writes key/value there).
  // PrefixLM ranges (use_mm_prefix only; both empty = none this step), in
  // CSR as set_mm_prefix_ranges takes them:
  //   mm_prefix_range_start_loc  [B+1] i32, request r's ranges are pairs
  //                              [start_loc[r], start_loc[r+1]) of
  //   mm_prefix_ranges           [R * 2] i32 (start, end) half-open pairs,
  //                              sorted, disjoint, within [0, seq_lens[r]]
  // They are host data like the rest of the plan: a captured run() replays
  // any later plan's ranges under the capture rules above.
  void plan(std::span<const std::int32_t> query_start_loc, std::span<const std::int32_t> seq_lens,
            std::span<const std::int32_t> block_table, std::int64_t block_table_stride,
            std::span<const std::int32_t> mm_prefix_range_start_loc = {},
            std::span<const std::int32_t> mm_prefix_ranges = {});

  // Writes key/value (when given) at the plan's slots, then attends.
  //   query   [T, H, D]       T >= the plan's tokens (padding rows are not written)
  //   key     [T, Hkv, D]     or undefined: the step's keys are already cached
  //   value   [T, Hkv, D]     or undefined
  //   cache   K and V halves, [NB, BS, Hkv, D] each (any strides, last dim contiguous)
  //   output  [T, H, D]
  //   lse     [H, T] f32 or undefined
  //   k_scale, v_scale  [1] or [Hkv] f32 on the device (fp8 caches), or undefined = 1.0
  // Never allocates or synchronizes on device backends (capturable).
  void run(const TensorView& query, const TensorView& key, const TensorView& value, const KVCacheView& cache,
           const TensorView& output, const TensorView& lse = {}, const TensorView& k_scale = {},
           const TensorView& v_scale = {});

  const AttentionBackend& backend() const { return *backend_; }
  const AttentionImplParams& impl_params() const { return impl_->params(); }
  int block_size() const { return options_.block_size; }
  // The last plan's token count (query_start_loc[B]); 0 before the first plan.
  int num_tokens() const { return planned_ ? metadata_->common.num_actual_tokens : 0; }
  // Whether the last plan is a cascade.
  bool used_cascade() const;
  // The last plan's slot mapping, [num_tokens] i64 on the device.
  const Tensor& slot_mapping() const;

 private:
  struct Buffers;
  void reserve(int num_reqs, int num_tokens, std::int64_t table_entries, std::int64_t range_values);

  BatchAttentionOptions options_;
  const AttentionBackend* backend_ = nullptr;
  std::unique_ptr<AttentionImpl> impl_;
  std::unique_ptr<CascadeBuilder> builder_;
  std::unique_ptr<Buffers> buffers_;
  LayerQuantState unit_scales_;
  std::shared_ptr<const BackendMetadata> metadata_;
  bool planned_ = false;
};

}  // namespace pagedattn
