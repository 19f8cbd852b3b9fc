// The wgmma prefill kernel of head-size class 64 (f16 and bf16, 16-bit K/V),
// compiled for sm_90a only; see instantiations.h.
#include "flash_wgmma_prefill.cuh"
#include "instantiations.h"

namespace pagedattn::cuda_flash {

template <>
int launch_wgmma_prefill<64>(const FlashParams& params, DType dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (dtype == DType::F16) return detail::launch_wgmma_kernel<64, half>(params, s);
  if (dtype == DType::BF16) return detail::launch_wgmma_kernel<64, __nv_bfloat16>(params, s);
  return kLaunchUnsupportedDType;
}

}  // namespace pagedattn::cuda_flash
