// Uniform random fill of a contiguous device buffer (benchmarks and tests:
// gigabyte caches filled on the device instead of the host).
#pragma once

#include <pagedattn/backend/scalar.h>

#include <cstdint>

namespace pagedattn::cuda_kernels {

// Fills n elements of `dtype` at `data` with values uniform in [lo, hi),
// converted to the dtype. Returns a cudaError_t value.
int launch_fill_uniform(void* data, DType dtype, std::int64_t n, std::uint64_t seed, float lo, float hi, void* stream);

}  // namespace pagedattn::cuda_kernels
