#include "backends/cpu_attn/cpu_attn_metadata.h"

#include <pagedattn/error.h>

#include "backends/cpu_attn/thread_pool.h"

namespace pagedattn {

namespace {

// Decode work items per pool thread the plan leaves at least (when the batch
// has that many KV heads x key splits): enough for the dynamic schedule to
// even out items of unequal length.
constexpr int kMinDecodeItemsPerThread = 4;

}  // namespace

CpuAttnMetadataBuilder::CpuAttnMetadataBuilder(const BuilderParams& params) : params_(params) {
  check_arg(params.device.is_cpu(), "CPU_ATTN builder", "device", "cpu", device_name(params.device));
  check_arg(params.num_kv_heads > 0, "CPU_ATTN builder", "num_kv_heads", "> 0", params.num_kv_heads);
  // The step's workspace is sized from the layers' shape.
  check_arg(params.num_heads >= params.num_kv_heads, "CPU_ATTN builder", "num_heads",
            fmt::format(">= num_kv_heads ({}): the largest query-head count of the layers", params.num_kv_heads),
            params.num_heads);
  check_arg(params.head_size > 0, "CPU_ATTN builder", "head_size", "> 0", params.head_size);
}

std::shared_ptr<const BackendMetadata> CpuAttnMetadataBuilder::build(const CommonAttentionMetadata& common) {
  auto md = std::make_shared<CpuAttnMetadata>();
  adopt_step("CPU_ATTN builder", common, *md);
  check_arg(common.device().is_cpu(), "CPU_ATTN builder", "metadata device", "cpu", device_name(common.device()));
  md->num_kv_heads = params_.num_kv_heads;
  const int threads = cpu_attn::ThreadPool::instance().size();
  md->work = cpu_attn::make_work_list(md->common.query_start_loc_host(), md->common.seq_lens_host(),
                                      params_.num_kv_heads, md->common.causal, kMinDecodeItemsPerThread * threads);
  md->workspace = std::make_unique<cpu_attn::Workspace>(cpu_attn::plan_workspace(
      md->work, params_.head_size, params_.num_heads / params_.num_kv_heads, threads));
  return md;
}

}  // namespace pagedattn
