// The wgmma prefill kernel of head-size class 128 (f16 and bf16, 16-bit K/V),
// compiled for sm_90a only; see instantiations.h.
#include "flash_wgmma_prefill.cuh"
#include "instantiations.h"

namespace pagedattn::cuda_flash {

template <>
int launch_wgmma_prefill<128>(const FlashParams& params, DType dtype, void* stream) {
  return detail::launch_wgmma_dtype<128>(params, dtype, static_cast<cudaStream_t>(stream));
}

}  // namespace pagedattn::cuda_flash
