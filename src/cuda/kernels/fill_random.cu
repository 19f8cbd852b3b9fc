#include <cuda_runtime.h>

#include "fill_random.h"

namespace pagedattn::cuda_kernels {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxGrid = 65535u;

// splitmix64: a counter-based generator, so every element is independent of
// the launch shape.
__device__ __forceinline__ std::uint64_t mix(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_uniform_kernel(void* data, DType dtype, std::int64_t n, std::uint64_t seed, float lo, float hi) {
  const std::size_t es = dtype_size(dtype);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix(seed ^ mix(static_cast<std::uint64_t>(i)));
    const float u = static_cast<float>(r >> 40) * (1.0f / 16777216.0f);  // [0, 1), 24 bits
    store_from_float(static_cast<unsigned char*>(data) + i * static_cast<std::int64_t>(es), dtype, lo + (hi - lo) * u);
  }
}

}  // namespace

int launch_fill_uniform(void* data, DType dtype, std::int64_t n, std::uint64_t seed, float lo, float hi, void* stream) {
  if (n == 0) return 0;
  const std::int64_t blocks = (n + kThreads - 1) / kThreads;
  const auto grid = static_cast<unsigned>(blocks > kMaxGrid ? kMaxGrid : blocks);
  fill_uniform_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(data, dtype, n, seed, lo, hi);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace pagedattn::cuda_kernels
