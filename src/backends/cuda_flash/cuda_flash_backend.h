// The CUDA_FLASH backend: tensor-core paged attention for mixed
// prefill + decode batches on sm_80 and newer, with split-KV decode planned
// by its metadata builder. docs/cuda_flash.md describes the design.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/backend/registry.h>

#include <memory>
#include <string_view>

namespace pagedattn {

inline constexpr std::string_view kCudaFlashBackendName = "CUDA_FLASH";
inline constexpr int kCudaFlashMinCapability = 80;

class CudaFlashBackend : public AttentionBackend {
 public:
  std::string_view name() const override { return kCudaFlashBackendName; }
  DeviceType device_type() const override { return DeviceType::CUDA; }
  std::string_view description() const override {
    return "tensor-core paged attention (mma.sync m16n8k16), mixed batches in one launch, split-KV decode; "
           "warp-specialized wgmma prefill on Hopper";
  }

  std::vector<DType> supported_dtypes() const override { return {DType::F16, DType::BF16}; }
  std::vector<CacheDType> supported_kv_cache_dtypes() const override;
  std::optional<std::string> head_size_rule(int head_size) const override;
  std::vector<KernelBlockSize> supported_kernel_block_sizes() const override { return {MultipleOf{1}}; }
  bool supports_sink() const override { return true; }
  bool supports_mm_prefix() const override { return true; }
  bool supports_per_head_quant_scales() const override { return true; }
  bool supports_non_causal() const override { return true; }
  bool supports_batch_invariance() const override { return true; }
  bool supports_attn_type(AttentionType) const override { return true; }
  bool supports_compute_capability(DeviceCapability cap) const override {
    return cap.as_int() >= kCudaFlashMinCapability;
  }
  bool supports_sliding_window() const override { return true; }
  bool supports_soft_cap() const override { return true; }
  bool supports_alibi() const override { return true; }
  bool can_return_lse() const override { return true; }
  // The decode kernel's query count: the generic cascade's prefix pass runs as
  // split decodes (CUDA_FLASH's own cascade plans size their prefix items themselves).
  int cascade_prefix_queries() const override;
  bool is_deterministic() const override { return true; }

  ProblemSupport problem_support(const AttentionProblem& problem) const override;
  std::unique_ptr<AttentionImpl> make_impl(const AttentionImplParams& params) const override;
  std::unique_ptr<AttentionMetadataBuilder> make_builder(const BuilderParams& params) const override;
};

// Adds CUDA_FLASH to `registry` with priority 0 for DeviceType::CUDA.
void register_cuda_flash_backend(BackendRegistry& registry);

}  // namespace pagedattn
