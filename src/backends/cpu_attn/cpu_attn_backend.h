// The CPU_ATTN backend: the production CPU backend (tiled online softmax,
// Highway SIMD with run-time dispatch, a persistent thread pool). Auto-selected
// on the CPU. Design: docs/cpu_attn.md.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/backend/registry.h>

#include <memory>
#include <string_view>

namespace pagedattn {

inline constexpr std::string_view kCpuAttnBackendName = "CPU_ATTN";

class CpuAttnBackend : public AttentionBackend {
 public:
  std::string_view name() const override { return kCpuAttnBackendName; }
  DeviceType device_type() const override { return DeviceType::CPU; }
  std::string_view description() const override;

  std::vector<DType> supported_dtypes() const override;
  std::vector<CacheDType> supported_kv_cache_dtypes() const override;
  std::optional<std::string> head_size_rule(int head_size) const override;
  bool supports_sink() const override { return true; }
  bool supports_mm_prefix() const override { return true; }
  bool supports_per_head_quant_scales() const override { return true; }
  bool supports_non_causal() const override { return true; }
  // The work list splits each request by its own shape only (cpu_attn_plan.h).
  bool supports_batch_invariance() const override { return true; }
  bool supports_attn_type(AttentionType) const override { return true; }
  bool supports_sliding_window() const override { return true; }
  bool supports_soft_cap() const override { return true; }
  bool supports_alibi() const override { return true; }
  bool can_return_lse() const override { return true; }
  // Fixed split points, split partials merged in split order.
  bool is_deterministic() const override { return true; }

  // Keys16 for caches the active ISA's decode reads faster packed
  // (cpu_attn::preferred_key_packing) and that can hold it (can_hold_key_packing:
  // HND rows, a block size that is a multiple of kPackedKeyGroup).
  KeyPacking key_packing(const TensorView& key_cache) const override;
  ProblemSupport problem_support(const AttentionProblem& problem) const override;
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override;
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams& params) const override;
};

// Adds CPU_ATTN to `registry` with priority 0 on the CPU (auto-selected first).
void register_cpu_attn_backend(BackendRegistry& registry);

}  // namespace pagedattn
