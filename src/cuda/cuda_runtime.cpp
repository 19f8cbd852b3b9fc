#include "cuda/cuda_runtime.h"

#include <cuda_runtime_api.h>
#include <pagedattn/error.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/ops.h>
#include <pagedattn/tensor.h>

#include <mutex>

#include "cuda/cuda_ops.h"

namespace pagedattn::cuda {
namespace {

void require_cuda(Device d, std::string_view where) {
  if (!d.is_cuda()) throw_invalid(where, "device", "a CUDA device", device_name(d));
}

// The CUDA allocator: plain cudaMalloc (no managed memory). Copies and
// memsets run on the current forward context's stream and wait for it, so
// they are ordered after the kernels that produced their sources.
class CudaAllocator final : public DeviceAllocator {
 public:
  void* allocate(std::size_t bytes, Device d) override {
    require_cuda(d, "CudaAllocator::allocate");
    DeviceGuard guard(d.index);
    void* p = nullptr;
    // A zero-byte request still yields a unique, freeable pointer.
    const cudaError_t e = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      throw Error(ErrorKind::OutOfMemory,
                  fmt::format("CudaAllocator::allocate: cannot allocate {} bytes on {}", bytes, d));
    }
    check_cuda(e, "CudaAllocator::allocate");
    return p;
  }

  void deallocate(void* p, Device d) noexcept override {
    if (p == nullptr) return;
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    cudaSetDevice(d.index);
    cudaFree(p);
    cudaSetDevice(previous);
    cudaGetLastError();  // nothing to report from a noexcept release
  }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    if (bytes == 0) return;
    const Device d = dst_dev.is_cuda() ? dst_dev : src_dev;
    require_cuda(d, "CudaAllocator::copy");
    DeviceGuard guard(d.index);
    const auto stream = static_cast<cudaStream_t>(current_stream());
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "CudaAllocator::copy");
    check_cuda(cudaStreamSynchronize(stream), "CudaAllocator::copy");
  }

  void memset(void* dst, Device d, int value, std::size_t bytes) override {
    if (bytes == 0) return;
    require_cuda(d, "CudaAllocator::memset");
    DeviceGuard guard(d.index);
    const auto stream = static_cast<cudaStream_t>(current_stream());
    check_cuda(cudaMemsetAsync(dst, value, bytes, stream), "CudaAllocator::memset");
    check_cuda(cudaStreamSynchronize(stream), "CudaAllocator::memset");
  }

  int device_count() const override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // no driver or no device: report none
      return 0;
    }
    return n;
  }

  DeviceCapability capability(Device d) const override {
    require_cuda(d, "CudaAllocator::capability");
    int major = 0;
    int minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d.index), "capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d.index), "capability");
    return {major, minor};
  }
};

// Registers at load time as well, so available_devices() sees CUDA before the
// backend registry is first used.
[[maybe_unused]] const bool kRegisteredAtLoad = [] {
  register_cuda_runtime();
  return true;
}();

}  // namespace

void register_cuda_runtime() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CudaAllocator allocator;
    if (allocator.device_count() == 0) return;
    register_device_allocator(DeviceType::CUDA, &allocator);
    register_ops_impl(DeviceType::CUDA, &cuda_ops_impl());
  });
}

void check_cuda(int status, std::string_view where) {
  if (status == cudaSuccess) return;
  const auto e = static_cast<cudaError_t>(status);
  throw Error(ErrorKind::Device, fmt::format("{}: {}: {}", where, cudaGetErrorName(e), cudaGetErrorString(e)));
}

void* current_stream() { return has_forward_context() ? get_forward_context().stream : nullptr; }

int multiprocessor_count(int device) {
  int n = 0;
  check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "multiprocessor_count");
  return n;
}

int compute_capability(int device) {
  int major = 0;
  int minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute_capability");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "compute_capability");
  return major * 10 + minor;
}

DeviceGuard::DeviceGuard(int device) {
  check_cuda(cudaGetDevice(&previous_), "DeviceGuard");
  if (previous_ != device) check_cuda(cudaSetDevice(device), "DeviceGuard");
}

DeviceGuard::~DeviceGuard() {
  int current = previous_;
  if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

}  // namespace pagedattn::cuda
