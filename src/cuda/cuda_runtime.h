// CUDA device plumbing shared by every CUDA backend: the DeviceAllocator and
// OpsImpl of DeviceType::CUDA, error checking and the stream of the current
// forward context. Compiled only when PAGEDATTN_HAVE_CUDA.
#pragma once

#include <pagedattn/dtype.h>

#include <string_view>

namespace pagedattn::cuda {

// Registers the CUDA allocator and ops when at least one device exists (with
// no device, available_devices() lists no CUDA device). Idempotent.
void register_cuda_runtime();

// Throws Error(Device) "<where>: <CUDA error name>: <description>" unless
// `status` (a cudaError_t) is cudaSuccess.
void check_cuda(int status, std::string_view where);

// The current forward context's stream (a cudaStream_t), or the default
// stream (null) when no context or no stream is set.
void* current_stream();

// Number of streaming multiprocessors of a device.
int multiprocessor_count(int device);
// Compute capability of `device` as major * 10 + minor (90 for sm_90).
int compute_capability(int device);

// Makes `device` current for the calling thread for its lifetime.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace pagedattn::cuda
