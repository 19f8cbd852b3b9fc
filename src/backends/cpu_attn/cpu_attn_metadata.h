// CPU_ATTN's per-step metadata (the plan) and its builder.
#pragma once

#include <pagedattn/backend/backend.h>

#include "backends/cpu_attn/cpu_attn_plan.h"

#include <memory>

namespace pagedattn {

struct CpuAttnMetadata final : BackendMetadata {
  cpu_attn::WorkPlan plan;
  int num_kv_heads = 0;  // the plan's KV-head count (from the builder params)
};

class CpuAttnMetadataBuilder final : public AttentionMetadataBuilder {
 public:
  explicit CpuAttnMetadataBuilder(const BuilderParams& params);
  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& common) override;

 private:
  BuilderParams params_;
};

}  // namespace pagedattn
