// Attention kernels of head-size class 128 (f16 and bf16); see instantiations.h.
#include "flash_attention.cuh"
#include "instantiations.h"

namespace pagedattn::cuda_flash {

int launch_hd128(const FlashParams& params, DType dtype, bool launch_combine, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::F16) return detail::launch_class<128, half>(params, launch_combine, s);
  if (dtype == DType::BF16) return detail::launch_class<128, __nv_bfloat16>(params, launch_combine, s);
  return kLaunchUnsupportedDType;
}

}  // namespace pagedattn::cuda_flash
