// Cascade (shared-prefix) attention, FlashInfer's cascade and vLLM's
// cascade_attention, for every backend: when every request of a step starts
// with the same blocks, the prefix's keys are read once for all the step's
// queries (one non-causal pass), each request's own keys in a second pass,
// and the two partial results are merged by their LSE (merge_attn_states).
// Exact up to the rounding of the two partial outputs to the model dtype.
// Built here, above the backends, from their ordinary plans and forwards;
// a backend may instead plan the whole cascade as one plan of its own
// (AttentionMetadataBuilder::build_cascade), which its forward runs whole.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/metadata.h>
#include <pagedattn/tensor.h>

#include <memory>
#include <string_view>

namespace pagedattn {

// The heuristic (cascade_pays): the prefix read once must be long and
// shared by enough requests to outweigh the second pass and the merge.
inline constexpr int kCascadeMinPrefixTokens = 256;
inline constexpr int kCascadeMinRequests = 8;

// The shared prefix, in blocks: the leading block-table entries every
// request of the step holds with the same ids, all before each request's
// first query (so every query of the step sees every key in them). 0 with
// fewer than two requests.
int common_prefix_blocks(const CommonAttentionMetadata& common);

// Whether a layer's attention can run as a cascade: decoder attention over
// the cache without a window, ALiBi, sinks, chunking or PrefixLM ranges (each
// depends on the query's position or must be counted once, which the prefix
// pass, one non-causal request for all queries, cannot honour).
bool cascade_applies(const AttentionImplParams& params);

// The heuristic: at least kCascadeMinPrefixTokens shared tokens and
// kCascadeMinRequests requests, in a causal step without PrefixLM ranges.
bool cascade_pays(const CommonAttentionMetadata& common, int prefix_blocks);

// Throws InvalidArgument (from `where`) unless `common` is a valid step that
// can be planned as a cascade over its first prefix_blocks blocks: no
// PrefixLM ranges, and prefix_blocks in [1, common_prefix_blocks(common)].
void check_cascade_step(std::string_view where, const CommonAttentionMetadata& common, int prefix_blocks);

// Throws InvalidArgument (from `where`) for a cascade plan handed to a layer
// it cannot be right for (cascade_applies): refused, not run.
void check_cascade_layer(std::string_view where, const AttentionImplParams& params);

// The step's two parts, each a valid step of its own:
//   prefix  the step's query tokens, in order, as virtual requests of at most
//           prefix_len tokens (and at most max_queries when it is > 0), each
//           over the prefix blocks, non-causal
//   suffix  each request over its keys after the prefix (its block-table
//           row from entry prefix_blocks on), causal
// Both keep the step's slot mapping. Throws InvalidArgument when
// prefix_blocks exceeds common_prefix_blocks(common) or is < 1, and on a
// step with PrefixLM ranges.
struct CascadeSplit {
  CommonAttentionMetadata prefix;
  CommonAttentionMetadata suffix;
};
CascadeSplit split_cascade(const CommonAttentionMetadata& common, int prefix_blocks, int max_queries = 0);

// The generic cascade's plan: `common` and `facts` are the whole step's
// (what the layer checks its tensors against); the parts' plans come from
// builders of the same backend; the buffers hold one layer's partial results for the largest
// layer. They are scratch within one forward (written, then merged), views
// of the builder's storage that its later steps reuse.
struct CascadeMetadata final : BackendMetadata {
  std::shared_ptr<const BackendMetadata> prefix;
  std::shared_ptr<const BackendMetadata> suffix;
  Tensor prefix_out;  // [T, H, D], the model dtype
  Tensor suffix_out;  // [T, H, D]
  Tensor prefix_lse;  // [H, T] f32
  Tensor suffix_lse;  // [H, T] f32
  int prefix_len = 0;
};

// How a CascadeBuilder plans a cascade step: Native takes the backend's own
// cascade plan (AttentionMetadataBuilder::build_cascade) where it gives one
// and the generic passes otherwise; Generic always plans the generic passes
// (a prefix plan, a suffix plan, merge_attn_states).
enum class CascadeMode { Native, Generic };

// A backend's metadata builder that plans a step as a cascade when `allow`
// and the step shares a prefix that pays (cascade_pays), and as the
// backend's plain plan otherwise. The generic passes are planned by builders
// of their own: a backend may keep one plan's device data per builder.
class CascadeBuilder final : public AttentionMetadataBuilder {
 public:
  // `params` as for backend.make_builder; the generic passes' buffers are
  // sized for params.num_heads query heads of `dtype`.
  CascadeBuilder(const AttentionBackend& backend, BuilderParams params, DType dtype, bool allow,
                 CascadeMode mode = CascadeMode::Native);
  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override;
  // Whether the last build planned a cascade.
  bool last_used_cascade() const { return last_used_cascade_; }

 private:
  const AttentionBackend& backend_;
  BuilderParams params_;
  DType dtype_;
  bool allow_;
  CascadeMode mode_;
  std::unique_ptr<AttentionMetadataBuilder> plain_;
  std::unique_ptr<AttentionMetadataBuilder> prefix_;
  std::unique_ptr<AttentionMetadataBuilder> suffix_;
  bool last_used_cascade_ = false;
  // The partial results' storage, grown only: a cascade step allocates (and,
  // on CUDA, frees, which synchronizes the device) nothing once it fits.
  Tensor out_storage_;  // [2 * capacity * num_heads * head_size], the model dtype
  Tensor lse_storage_;  // [2 * num_heads * capacity] f32
  std::int64_t capacity_ = 0;  // token rows
};

// A layer's check and forward over a plan from a CascadeBuilder: the impl's
// own for a plain plan or a backend's native cascade; for the generic
// cascade, both parts into the buffers, then the merge into output (and lse)
// rows [0, num_actual_tokens).
void check_planned_forward(const AttentionImpl& impl, const LayerQuantState& layer, const TensorView& query,
                           const TensorView& key, const TensorView& value, const KVCacheView& kv_cache,
                           const BackendMetadata& metadata, const TensorView& output, const TensorView& lse);
void planned_forward(AttentionImpl& impl, const LayerQuantState& layer, const TensorView& query,
                     const TensorView& key, const TensorView& value, const KVCacheView& kv_cache,
                     const BackendMetadata& metadata, const TensorView& output, const TensorView& lse);

}  // namespace pagedattn
