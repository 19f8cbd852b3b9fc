// The REFERENCE backend: the scalar fp64 oracle of docs/semantics.md behind
// the ordinary backend interface. Correct for every feature, slow on purpose,
// never auto-selected.
//
// LSE with sinks: the returned LSE is log(e^{s_h} + sum_j e^{S_j}), the sink
// term included, so merging it with another partial result (merge_attn_states)
// counts the sink once. A row with no visible key returns zeros and LSE -inf,
// sink or not.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/backend/registry.h>

#include <memory>
#include <string_view>

namespace pagedattn {

inline constexpr std::string_view kReferenceBackendName = "REFERENCE";

class ReferenceBackend : public AttentionBackend {
 public:
  std::string_view name() const override { return kReferenceBackendName; }
  DeviceType device_type() const override { return DeviceType::CPU; }
  std::string_view description() const override {
    return "scalar fp64 oracle backend; selected only when asked";
  }

  std::vector<DType> supported_dtypes() const override;
  std::vector<CacheDType> supported_kv_cache_dtypes() const override;
  bool supports_sink() const override { return true; }
  bool supports_mm_prefix() const override { return true; }
  bool supports_per_head_quant_scales() const override { return true; }
  bool supports_non_causal() const override { return true; }
  bool supports_batch_invariance() const override { return true; }
  bool supports_attn_type(AttentionType) const override { return true; }
  bool supports_sliding_window() const override { return true; }
  bool supports_soft_cap() const override { return true; }
  bool supports_alibi() const override { return true; }
  bool can_return_lse() const override { return true; }
  bool is_deterministic() const override { return true; }

  ProblemSupport problem_support(const AttentionProblem& problem) const override;
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override;
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams& params) const override;
};

// Adds REFERENCE to `registry` (priority kOnlyWhenAsked).
void register_reference_backend(BackendRegistry& registry);

}  // namespace pagedattn
