// Registers every backend compiled into the library. This file is the only
// place that knows the list; core reaches backends through the registry.
#include <pagedattn/backend/registry.h>

#include "backends/cpu_attn/cpu_attn_backend.h"
#include "backends/reference/reference_backend.h"

#if PAGEDATTN_HAVE_CUDA
#include "backends/cuda_flash/cuda_flash_backend.h"
#include "cuda/cuda_runtime.h"
#endif

namespace pagedattn {

void register_builtin_backends(BackendRegistry& registry) {
  register_reference_backend(registry);
  register_cpu_attn_backend(registry);
#if PAGEDATTN_HAVE_CUDA
  cuda::register_cuda_runtime();
  register_cuda_flash_backend(registry);
#endif
}

}  // namespace pagedattn
