// CPU_ATTN's impl (the run): validates a forward call, fills the kernel's POD
// params and runs the step's work list on the thread pool.
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/backend/impl_checks.h>

#include <string_view>

namespace pagedattn {

// Environment variable forcing the kernels' ISA: avx512bf16, avx512, avx2 or scalar.
inline constexpr const char* kCpuIsaEnv = "PAGEDATTN_CPU_ISA";

// Applies PAGEDATTN_CPU_ISA once per process. Every call throws
// InvalidArgument for an unknown name and Unsupported for an ISA this build or
// CPU cannot run.
void apply_cpu_isa_from_env();

class CpuAttnImpl final : public AttentionImpl {
 public:
  explicit CpuAttnImpl(AttentionImplParams params);

  void check_forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const override;
  void forward(const LayerQuantState& layer, const TensorView& query, const TensorView& key, const TensorView& value,
               const KVCacheView& kv_cache, const BackendMetadata& metadata, const TensorView& output,
               const TensorView& lse) override;
  void do_kv_cache_update(const LayerQuantState& layer, const TensorView& key, const TensorView& value,
                          const KVCacheView& kv_cache, const TensorView& slot_mapping) override;
  std::string_view class_name() const override { return "CpuAttnImpl"; }

 private:
  ForwardShape check(const LayerQuantState& layer, const TensorView& query, const TensorView& key,
                     const TensorView& value, const KVCacheView& kv_cache, const BackendMetadata& metadata,
                     const TensorView& output, const TensorView& lse) const;

  DType kv_storage_dtype_;
  bool dense_keys_;  // encoder / encoder-only: keys are the layer's own key/value rows
};

}  // namespace pagedattn
