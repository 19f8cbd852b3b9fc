// The metadata builder: plans the step (plain, or as one cascade plan) on the
// host once and uploads the plan
// (header, work list, combine list, PrefixLM ranges, block table) with one
// async copy into a persistent device workspace, so forward only launches.
#include <cuda_runtime_api.h>
#include <pagedattn/cascade.h>
#include <pagedattn/error.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <span>

#include "cuda/cuda_runtime.h"
#include "flash_metadata.h"
#include "flash_planner.h"

namespace pagedattn::cuda_flash {
namespace {

constexpr std::string_view kWhere = "CUDA_FLASH builder";
constexpr int kStagingSlots = 2;  // the host fills one while the other's copy may be in flight
constexpr std::size_t kGrowthFactor = 2;  // pinned staging growth

// Pinned host memory (truly asynchronous uploads) with the event of its last copy.
class StagingSlot {
 public:
  ~StagingSlot() {
    if (event_ != nullptr) {
      cudaEventSynchronize(event_);
      cudaEventDestroy(event_);
    }
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  // Waits for the previous copy out of this slot, then grows it if needed.
  char* acquire(std::size_t bytes) {
    if (event_ == nullptr) cuda::check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), kWhere);
    cuda::check_cuda(cudaEventSynchronize(event_), kWhere);
    if (bytes > bytes_) {
      if (data_ != nullptr) cuda::check_cuda(cudaFreeHost(data_), kWhere);
      data_ = nullptr;
      bytes_ = std::max(bytes, bytes_ * kGrowthFactor);
      void* p = nullptr;
      cuda::check_cuda(cudaMallocHost(&p, bytes_), kWhere);
      data_ = static_cast<char*>(p);
    }
    return data_;
  }
  void record(cudaStream_t stream) { cuda::check_cuda(cudaEventRecord(event_, stream), kWhere); }

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
  cudaEvent_t event_ = nullptr;
};

bool holds(const WorkspaceEntries& have, const WorkspaceEntries& n) {
  return n.items <= have.items && n.combine <= have.combine && n.mm_prefix_offsets <= have.mm_prefix_offsets &&
         n.mm_prefix_elems <= have.mm_prefix_elems && n.block_table <= have.block_table &&
         n.partial_token_rows <= have.partial_token_rows;
}

// At least `n`, and every region that must grow at least doubles.
WorkspaceEntries grown_to(const WorkspaceEntries& have, const WorkspaceEntries& n) {
  const auto grow = [](auto held, auto want) { return want <= held ? held : std::max(want, held * 2); };
  return {grow(have.items, n.items),
          grow(have.combine, n.combine),
          grow(have.mm_prefix_offsets, n.mm_prefix_offsets),
          grow(have.mm_prefix_elems, n.mm_prefix_elems),
          grow(have.block_table, n.block_table),
          grow(have.partial_token_rows, n.partial_token_rows)};
}

// The first workspace already holds a large step, so that graphs captured
// early stay valid while later steps grow (a regrown workspace moves); its
// 1024 partial token-rows hold a cascade plan of 64 decodes over a long
// prefix (576 rows). Its item and combine regions hold more entries than any
// GPU has multiprocessors, so every slot of a grid (a captured one records a
// wave of them, launch_item_slots) lies inside them: the kernels read their
// first entry before the header says whether it exists (for_each_plan_entry).
constexpr WorkspaceEntries kInitialCapacity{4096, 1024, 1025, 512, std::size_t{1} << 16, 1024};

class FlashBuilder final : public AttentionMetadataBuilder {
 public:
  explicit FlashBuilder(BuilderParams params) : params_(std::move(params)) {
    check_arg(params_.block_size > 0, kWhere, "block_size", "> 0", params_.block_size);
    check_arg(params_.device.is_cuda(), kWhere, "device", "a CUDA device", params_.device);
    check_arg(params_.num_kv_heads > 0, kWhere, "num_kv_heads", "> 0", params_.num_kv_heads);
    check_arg(params_.head_size > 0, kWhere, "head_size", "> 0", params_.head_size);
    num_sms_ = cuda::multiprocessor_count(params_.device.index);
    sm_version_ = cuda::compute_capability(params_.device.index);
  }

  std::shared_ptr<const BackendMetadata> build(const CommonAttentionMetadata& step) override {
    return plan(step, 0);
  }

  // One cascade plan (make_cascade_work_list) for steps of up to
  // kCascadeMaxTokens tokens; a batch-invariant builder plans none (a cascade
  // depends on which requests share a prefix).
  std::shared_ptr<const BackendMetadata> build_cascade(const CommonAttentionMetadata& step,
                                                       int prefix_blocks) override {
    check_cascade_step(kWhere, step, prefix_blocks);
    if (params_.batch_invariant || step.num_actual_tokens > kCascadeMaxTokens) return nullptr;
    return plan(step, prefix_blocks);
  }

 private:
  // The step's plan, a cascade over its first prefix_blocks blocks when > 0,
  // uploaded.
  std::shared_ptr<const BackendMetadata> plan(const CommonAttentionMetadata& step, int prefix_blocks) {
    auto metadata = std::make_shared<FlashMetadata>();
    adopt_step(kWhere, step, *metadata);
    const CommonAttentionMetadata& common = metadata->common;
    check_arg(common.device() == params_.device, kWhere, "metadata device", params_.device, common.device());
    if (common.block_size > 0) {
      check_arg(common.block_size == params_.block_size, kWhere, "metadata block_size",
                fmt::format("the builder's block_size ({})", params_.block_size), common.block_size);
    }
    cuda::DeviceGuard guard(params_.device.index);
    const int group = params_.num_heads > 0 ? params_.num_heads / params_.num_kv_heads : 1;
    const PlanInputs inputs{common.query_start_loc_host(), common.seq_lens_host(), params_.num_kv_heads, num_sms_,
                            group, params_.head_size, params_.batch_invariant, common.causal};
    const WorkList plan = prefix_blocks > 0 ? make_cascade_work_list(inputs, prefix_blocks * params_.block_size)
                                            : make_work_list(inputs);

    const TensorView& bt = common.block_table_cpu;
    const std::int64_t bt_rows = bt.defined() ? bt.size(0) : 0;
    const std::int64_t bt_cols = bt.defined() && bt.dim() == 2 ? bt.size(1) : 0;
    // Sized for the largest layer: forward never allocates.
    const int partial_heads =
        params_.num_heads > 0 ? params_.num_heads : params_.num_kv_heads * kPartialGroupHint;
    // The region offsets depend only on the capacities, never on this step's
    // counts: a captured graph keeps reading the same addresses.
    // PrefixLM range offsets go up for every step, zeros without ranges: a
    // graph captured on a step without ranges reads those of later steps.
    const std::span<const std::int32_t> mm_ranges =
        common.has_mm_prefix_ranges()
            ? std::span<const std::int32_t>(common.mm_prefix_ranges_cpu.data_as<const std::int32_t>(),
                                            static_cast<std::size_t>(common.mm_prefix_ranges_cpu.numel()))
            : std::span<const std::int32_t>{};
    const auto num_offsets = static_cast<std::size_t>(common.num_reqs) + 1;
    const WorkspaceEntries need{plan.items.size(), plan.combine.size(), num_offsets, mm_ranges.size(),
                                static_cast<std::size_t>(bt_rows * bt_cols), plan.partial_token_rows};
    const auto stream = static_cast<cudaStream_t>(cuda::current_stream());
    if (!workspace_ || !holds(cap_, need)) {
      cap_ = grown_to(workspace_ ? cap_ : kInitialCapacity, need);
      layout_ = workspace_layout(cap_, partial_heads, params_.head_size);
      workspace_ = std::make_shared<DeviceBuffer>(layout_.total_bytes, params_.device.index);
      // The kernels read their first work and combine item before the header
      // says whether it exists (for_each_plan_entry): past the plan they read zeros.
      cuda::check_cuda(cudaMemsetAsync(workspace_->data(), 0, layout_.block_table, stream), kWhere);
    }
    const WorkspaceLayout& layout = layout_;
    const std::size_t upload_bytes = layout.block_table + need.block_table * sizeof(std::int32_t);

    StagingSlot& slot = staging_[next_slot_];
    next_slot_ = (next_slot_ + 1) % kStagingSlots;
    char* host = slot.acquire(upload_bytes);
    PlanHeader header;
    header.num_items = static_cast<std::int32_t>(plan.items.size());
    header.num_combine = static_cast<std::int32_t>(plan.combine.size());
    header.block_table_stride = static_cast<std::int32_t>(bt_cols);
    std::memcpy(host, &header, sizeof header);
    std::memcpy(host + layout.items, plan.items.data(), plan.items.size() * sizeof(WorkItem));
    std::memcpy(host + layout.combine, plan.combine.data(), plan.combine.size() * sizeof(CombineItem));
    auto* offsets = reinterpret_cast<std::int32_t*>(host + layout.mm_prefix_offsets);
    if (common.has_mm_prefix_ranges()) {
      std::memcpy(offsets, common.mm_prefix_range_start_loc_cpu.data(), num_offsets * sizeof(std::int32_t));
      std::copy(mm_ranges.begin(), mm_ranges.end(), reinterpret_cast<std::int32_t*>(host + layout.mm_prefix_ranges));
    } else {
      std::fill_n(offsets, num_offsets, 0);
    }
    auto* table = reinterpret_cast<std::int32_t*>(host + layout.block_table);
    for (std::int64_t r = 0; r < bt_rows; ++r) {
      const std::span<const std::int32_t> row = common.block_table_host_row(static_cast<int>(r));
      std::copy_n(row.begin(), bt_cols, table + r * bt_cols);
    }
    char* dev = workspace_->data();
    cuda::check_cuda(cudaMemcpyAsync(dev, host, upload_bytes, cudaMemcpyHostToDevice, stream), kWhere);
    slot.record(stream);

    metadata->workspace = workspace_;
    metadata->header = reinterpret_cast<const PlanHeader*>(dev);
    metadata->items = reinterpret_cast<const WorkItem*>(dev + layout.items);
    metadata->combine = reinterpret_cast<const CombineItem*>(dev + layout.combine);
    metadata->block_table = reinterpret_cast<const std::int32_t*>(dev + layout.block_table);
    metadata->mm_prefix = {reinterpret_cast<const std::int32_t*>(dev + layout.mm_prefix_offsets),
                           reinterpret_cast<const std::int32_t*>(dev + layout.mm_prefix_ranges)};
    metadata->partial_out = reinterpret_cast<float*>(dev + layout.partial_out);
    metadata->partial_lse = reinterpret_cast<float*>(dev + layout.partial_lse);
    metadata->num_items = header.num_items;
    metadata->num_combine = header.num_combine;
    metadata->partial_token_rows = plan.partial_token_rows;
    metadata->partial_heads = partial_heads;
    metadata->device = params_.device.index;
    metadata->head_size = params_.head_size;
    metadata->decode_only = plan.decode_only;
    metadata->prefill_only = plan.prefill_only;
    metadata->sm_version = sm_version_;
    metadata->num_sms = num_sms_;
    metadata->batch_invariant = plan.batch_invariant;
    metadata->cascade = prefix_blocks > 0;
    return metadata;
  }

  BuilderParams params_;
  int num_sms_ = 0;
  int sm_version_ = 0;
  std::shared_ptr<DeviceBuffer> workspace_;
  WorkspaceEntries cap_;
  WorkspaceLayout layout_;
  std::array<StagingSlot, kStagingSlots> staging_;
  int next_slot_ = 0;
};

}  // namespace

DeviceBuffer::DeviceBuffer(std::size_t bytes, int device) : bytes_(bytes), device_(device) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    throw Error(ErrorKind::OutOfMemory, fmt::format("{}: cannot allocate a {}-byte workspace", kWhere, bytes));
  }
  cuda::check_cuda(e, kWhere);
  data_ = static_cast<char*>(p);
}

DeviceBuffer::~DeviceBuffer() {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return;
  cudaSetDevice(device_);
  cudaFree(data_);  // synchronizes the device: in-flight kernels may still read it
  cudaSetDevice(previous);
  cudaGetLastError();
}

std::unique_ptr<AttentionMetadataBuilder> make_flash_builder(const BuilderParams& params) {
  return std::make_unique<FlashBuilder>(params);
}

}  // namespace pagedattn::cuda_flash
