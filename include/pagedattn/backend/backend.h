// The backend interface (vLLM's AttentionBackend / AttentionImpl /
// AttentionMetadataBuilder): capability queries, KV-cache shape, the support
// check for a concrete problem, and factories for the impl and the metadata
// builder, whose output is the step plan.
#pragma once

#include <pagedattn/attention_types.h>
#include <pagedattn/backend/attention_variant.h>
#include <pagedattn/backend/kv_packing.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace pagedattn {

// A kernel block-size constraint "any multiple of base" (vs an exact size).
struct MultipleOf {
  int base = 1;
};
using KernelBlockSize = std::variant<int, MultipleOf>;

// What a backend needs to know to say whether it can run one layer's forward
// for a batch (problem_support).
struct AttentionProblem {
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_size = 0;
  DType dtype = DType::BF16;
  DType kv_storage_dtype = DType::BF16;
  CacheDType kv_cache_dtype = CacheDType::Auto;  // says how the storage is scaled
  int block_size = 16;
  AttentionType attn_type = AttentionType::Decoder;
  bool causal = true;
  bool has_sliding_window = false;
  bool has_soft_cap = false;
  bool has_alibi = false;
  bool has_sinks = false;
  bool per_head_kv_scales = false;
  bool wants_lse = false;
  // Batch shape (0 when unknown, e.g. at construction time).
  int num_reqs = 0;
  int num_tokens = 0;
  int max_query_len = 0;
  int max_seq_len = 0;
};

// Whether a backend can run a concrete layer and batch. Which kernel runs and
// the workspace it uses are the step plan's (the builder's metadata).
struct ProblemSupport {
  std::vector<std::string> reasons;  // empty = supported
  bool supported() const { return reasons.empty(); }
};

// A backend's per-step metadata (its "plan"); built once per step, read by
// every layer's forward. Builders fill `common` and `facts` through
// adopt_step, which validates the step once: forward then checks only what
// is O(1) (its tensors against the plan, and the cache against `facts`).
struct BackendMetadata {
  virtual ~BackendMetadata() = default;
  CommonAttentionMetadata common;  // the plan's own host arrays (with_own_host_arrays)
  std::optional<StepFacts> facts;  // set by adopt_step; unset: no builder validated it
};

// Validates `common` (CommonAttentionMetadata::validate) and stores in
// `metadata` a copy with its own host arrays and the facts forward checks.
void adopt_step(std::string_view where, const CommonAttentionMetadata& common, BackendMetadata& metadata);

struct BuilderParams {
  int block_size = 16;
  int num_kv_heads = 0;
  int head_size = 0;
  Device device = Device::cpu();
  std::vector<std::string> layer_names;
  int num_heads = 0;  // the largest query-head count of the layers; 0 = unknown
  // Plan every request's work from that request alone (splits, kernels), so
  // its output does not depend on the rest of the batch; set only for
  // backends whose supports_batch_invariance() holds.
  bool batch_invariant = false;
};

class AttentionMetadataBuilder {
 public:
  virtual ~AttentionMetadataBuilder() = default;
  // Validates `common` and produces this backend's metadata for the step.
  virtual std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) = 0;
  // The step as a cascade over its first `prefix_blocks` shared blocks
  // (cascade.h) in one plan of this backend's, which its impl's forward runs
  // whole (both passes and their merge), or null where the backend has none
  // for the step: CascadeBuilder then plans the generic passes and merge.
  virtual std::shared_ptr<const BackendMetadata> build_cascade(const CommonAttentionMetadata& /*common*/,
                                                               int /*prefix_blocks*/) {
    return nullptr;
  }
};

class AttentionImpl {
 public:
  explicit AttentionImpl(AttentionImplParams params) : params_(std::move(params)) {}
  virtual ~AttentionImpl() = default;
  AttentionImpl(const AttentionImpl&) = delete;
  AttentionImpl& operator=(const AttentionImpl&) = delete;

  // Computes attention for the metadata's tokens into `output`.
  //   query  [T, H, D]     (rows may be strided; last dim contiguous)
  //   key    [T, Hkv, D]   or undefined (encoder-only / already cached)
  //   value  [T, Hkv, D]   or undefined
  //   output [T, H, D]     written for rows < num_actual_tokens only
  //   lse    [H, T] f32    or undefined; natural log, including the sink term when the
  //                        layer has sinks; -inf for rows with no visible key
  // Never allocates or synchronizes with the host on device backends.
  // Throws what check_forward throws for the same arguments.
  virtual void forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                       const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                       const TensorView& output, const TensorView& lse) = 0;

  // Throws exactly what forward would throw for these arguments, and touches
  // no memory: Attention::forward calls it before it writes the step's keys
  // and values, so a forward that is rejected leaves the cache unchanged.
  virtual void check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                             const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                             const TensorView& output, const TensorView& lse) const = 0;

  // Writes key/value rows into the cache at slot_mapping ([N] i64, N <= T; -1 = skip).
  virtual void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                                  const KVCacheView& kv_cache, const TensorView& slot_mapping) = 0;

  virtual bool supports_quant_query_input() const { return false; }
  // Whether a layer over this impl hands it queries to quantize
  // (LayerQuantState::quantize_query): the impl takes them, and the cache and
  // attention type are ones they are quantized for (quantizes_query_for).
  bool quantizes_query() const {
    return supports_quant_query_input() && quantizes_query_for(params_.kv_cache_dtype, params_.attn_type);
  }
  virtual void process_weights_after_loading(DType /*act_dtype*/) {}
  // The impl's class name, shown by Attention::extra_repr.
  virtual std::string_view class_name() const = 0;

  const AttentionImplParams& params() const { return params_; }

 protected:
  AttentionImplParams params_;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  virtual std::string_view name() const = 0;
  virtual DeviceType device_type() const = 0;
  // One line for `pagedattn info`.
  virtual std::string_view description() const = 0;

  // ---- capability declarations (vLLM's class attributes and predicates) ----
  virtual std::vector<DType> supported_dtypes() const { return {DType::F16, DType::BF16}; }
  virtual std::vector<CacheDType> supported_kv_cache_dtypes() const {
    return {CacheDType::Auto, CacheDType::Float16, CacheDType::BFloat16};
  }
  // Empty = any head size.
  virtual std::vector<int> supported_head_sizes() const { return {}; }
  // Extra head-size rule beyond the list (e.g. "multiple of 8"); nullopt = none.
  virtual std::optional<std::string> head_size_rule(int /*head_size*/) const { return std::nullopt; }
  virtual std::vector<KernelBlockSize> supported_kernel_block_sizes() const { return {MultipleOf{1}}; }
  virtual bool is_mla() const { return false; }
  virtual bool supports_sink() const { return false; }
  virtual bool is_sparse() const { return false; }
  virtual bool supports_mm_prefix() const { return false; }
  virtual bool supports_per_head_quant_scales() const { return false; }
  virtual bool supports_non_causal() const { return false; }
  virtual bool supports_batch_invariance() const { return false; }
  virtual bool supports_attn_type(AttentionType t) const { return t == AttentionType::Decoder; }
  virtual bool supports_compute_capability(DeviceCapability /*cap*/) const { return true; }
  virtual std::optional<std::string> supports_combination(const SelectorConfig& /*cfg*/) const {
    return std::nullopt;
  }
  // Features beyond vLLM's selector questions (listed in the support matrix).
  virtual bool supports_sliding_window() const { return false; }
  virtual bool supports_soft_cap() const { return false; }
  virtual bool supports_alibi() const { return false; }
  virtual bool can_return_lse() const { return false; }
  // Chunked local attention is a metadata transform in core
  // (make_local_attention_virtual_batches): any backend whose kernels depend
  // only on positions relative to the request's keys runs it as it is.
  virtual bool supports_chunked_local_attention() const { return true; }
  // Cascade attention (cascade.h) runs on a backend's ordinary plans and
  // forwards (a non-causal prefix pass, a suffix pass) and merge_attn_states:
  // any backend with non-causal decoder attention and LSE output has it.
  bool supports_cascade() const { return supports_non_causal() && can_return_lse(); }
  // Query tokens per request of a cascade's prefix pass (cascade.h); 0 = as
  // many as the prefix has keys. A backend whose short-query kernel splits
  // keys across the device asks for that many, so that the pass, one long
  // non-causal read of the prefix, runs as parallel decodes.
  virtual int cascade_prefix_queries() const { return 0; }
  virtual bool is_deterministic() const { return false; }
  virtual bool accept_output_buffer() const { return true; }
  virtual bool forward_includes_kv_cache_update() const { return false; }
  virtual std::optional<KVCacheLayout> required_kv_cache_layout() const { return std::nullopt; }

  // ---- KV cache ----
  // Logical shape; default (2, num_blocks, block_size, num_kv_heads, head_size).
  virtual Dims kv_cache_shape(std::int64_t num_blocks, int block_size, int num_kv_heads, int head_size,
                              CacheDType cache_dtype) const;
  // Permutation from the logical shape to the physical layout; default
  // NHD = identity, HND = (0, 1, 3, 2, 4) -> physical [2, NB, Hkv, BS, D].
  virtual std::vector<int> kv_cache_stride_order(KVCacheLayout layout) const;
  // Splits a cache of kv_cache_shape() into its K and V halves, with K in
  // the order key_packing gives for it; and a per-token-head cache's scales
  // (kv_cache_scale_shape, f32) into its key_scale and value_scale.
  KVCacheView unbind_kv_cache(const TensorView& kv_cache, const TensorView& kv_scales = {}) const;
  // The order this backend keeps a cache's K half [NB, BS, Hkv, D] in; a
  // backend that packs K must also read packed K wherever it reads the cache.
  virtual KeyPacking key_packing(const TensorView& /*key_cache*/) const { return KeyPacking::None; }

  // ---- can this backend run a concrete layer and batch? ----
  virtual ProblemSupport problem_support(const AttentionProblem& problem) const = 0;

  // ---- factories ----
  virtual std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const = 0;
  virtual std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams& params) const = 0;

  // ---- written once, from the queries above ----
  bool supports_head_size(int head_size) const;
  bool supports_dtype(DType dtype) const;
  bool supports_kv_cache_dtype(CacheDType t) const;
  bool supports_block_size(std::optional<int> block_size) const;
  int preferred_block_size(int default_size) const;
  // vLLM's reason strings, in vLLM's order; empty = valid.
  std::vector<std::string> validate_configuration(const SelectorConfig& cfg) const;
};

// The variant a layer's kernels compute for a step (`step_causal`: the
// metadata's causal flag). `alibi_slopes` and `sinks` point at the layer's
// [num_heads] arrays where the kernel reads them (host or device), or are
// null; `mm_prefix` at the step's PrefixLM ranges likewise, kept only for a
// use_mm_prefix layer's causal decoder mask. Every backend derives its
// kernels' semantics here.
AttentionVariant make_attention_variant(const AttentionImplParams& params, bool step_causal,
                                        const float* alibi_slopes, const float* sinks,
                                        MmPrefixRanges mm_prefix = {});

// The step's PrefixLM ranges in host memory (null pointers without ranges).
MmPrefixRanges host_mm_prefix_ranges(const CommonAttentionMetadata& common);

// Problem description of a layer's impl params for a batch (shape fields zero
// when `common` is null).
AttentionProblem make_attention_problem(const AttentionImplParams& params, int block_size,
                                        const CommonAttentionMetadata* common, bool wants_lse,
                                        bool per_head_kv_scales);

// Whether a cache K half [NB, BS, Hkv, D] can hold `packing`: Keys16 needs
// rows head_size elements apart, a block size that is a multiple of
// kPackedKeyGroup and a head size that is a multiple of kPackedDimGroup.
bool can_hold_key_packing(const TensorView& key_cache, KeyPacking packing);
// Throws InvalidArgument naming the unmet condition unless it can.
void check_key_packing(std::string_view where, const TensorView& key_cache, KeyPacking packing);
// "none", "keys16".
std::string_view key_packing_name(KeyPacking packing);

// A per-token-head scale half (KVCacheView::key_scale, [NB, Hkv, BS] f32) as
// the kernels address it.
ScaleOperand token_scale_operand(const TensorView& half);

// The k_scale / v_scale a layer's cache write passes to reshape_and_cache:
// the cache's own per-token-head scales (written), else the layer's
// per-tensor or per-KV-head ones (read).
struct KVWriteScales {
  TensorView k;
  TensorView v;
};
KVWriteScales kv_write_scales(CacheDType kv_cache_dtype, const LayerQuantState& layer,
                              const KVCacheView& kv_cache);

// Throws Unsupported listing the plan's reasons when it is not supported.
void require_supported(const ProblemSupport& plan, std::string_view backend_name);

}  // namespace pagedattn
