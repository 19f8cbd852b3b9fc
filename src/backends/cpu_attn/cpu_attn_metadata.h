// CPU_ATTN's per-step metadata (the plan and the workspace sized for it) and
// its builder.
#pragma once

#include <pagedattn/backend/backend.h>

#include "backends/cpu_attn/cpu_attn_plan.h"

#include <memory>

namespace pagedattn {

struct CpuAttnMetadata final : BackendMetadata {
  cpu_attn::WorkList work;  // the step's work items and merges
  int num_kv_heads = 0;  // the plan's KV-head count (from the builder params)
  // Sized for the builder's num_heads and head_size on the pool's threads; a
  // forward call works in it and allocates nothing. Not part of the
  // metadata's value: one forward call at a time writes it.
  std::unique_ptr<cpu_attn::Workspace> workspace;
};

class CpuAttnMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  explicit CpuAttnMetadataBuilder(const BuilderParams& params);
  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override;

 private:
  BuilderParams params_;
};

}  // namespace pagedattn
