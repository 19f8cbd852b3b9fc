// CUDA_FLASH's per-step metadata (the uploaded plan) and its builder.
#pragma once

#include <pagedattn/backend/backend.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "kernels/flash_params.h"

namespace pagedattn::cuda_flash {

// Query heads per KV head the builder sizes the partial-output region for
// when BuilderParams::num_heads is unknown (0); forward rejects a layer with
// more query heads than the region holds.
inline constexpr int kPartialGroupHint = 8;

// One cudaMalloc'd region, freed when the last metadata that points into it
// is gone (a graph captured against it must be replayed while it lives).
class DeviceBuffer {
 public:
  DeviceBuffer(std::size_t bytes, int device);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  char* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = 0;
};

struct FlashMetadata final : BackendMetadata {
  std::shared_ptr<DeviceBuffer> workspace;
  const PlanHeader* header = nullptr;  // device pointers into `workspace`
  const WorkItem* items = nullptr;
  const CombineItem* combine = nullptr;
  const std::int32_t* block_table = nullptr;
  MmPrefixRanges mm_prefix;  // the step's ranges; offsets all 0 without any
  float* partial_out = nullptr;
  float* partial_lse = nullptr;
  int num_items = 0;
  int num_combine = 0;
  std::int64_t partial_token_rows = 0;
  int partial_heads = 0;  // query heads the partial region was sized for
  int device = 0;
  int head_size = 0;
  bool decode_only = false;   // the plan has decode items only
  bool prefill_only = false;  // the plan has prefill items only
  int sm_version = 0;         // the device's compute capability, major * 10 + minor
  int num_sms = 0;            // the device's multiprocessors (persistent kernels' grid)
  bool batch_invariant = false;  // planned from each request alone (choose_kernel: the mixed kernel)
  bool cascade = false;  // a cascade plan (make_cascade_work_list): forward refuses layers it does not apply to
};

std::unique_ptr<AttentionMetadataBuilder> make_flash_builder(const BuilderParams& params);

}  // namespace pagedattn::cuda_flash
