// The instantiation matrix of the attention kernel, in one place: head-size
// classes x {f16, bf16} x {16-bit KV, fp8 e4m3 KV (per tensor or per token
// head), fp8 e5m2 KV, int8 per-token-head KV} x {mixed,
// decode-only (classes up to kDecodeOnlyMaxClass)} (the fp8 kernels stage K/V
// through registers that would make the 16-bit ones spill; the fp8 format
// chosen at run time cost both conversions; launch_class picks by the cache
// dtype and the plan). A head size runs in the smallest class that holds it
// (the kernel zero-pads the rest), so any multiple of 8 up to 256 is served by
// three classes. Each class is compiled in its own translation unit
// (flash_hd<N>.cu) so the CUDA build parallelizes and stays small. Plus the
// sm_90a wgmma prefill kernels of every class x {f16, bf16} x {16-bit K/V,
// fp8 e4m3 and e5m2 K/V with per-tensor scales} (flash_wgmma_hd<N>.cu).
#pragma once

#include <pagedattn/backend/scalar.h>

#include "flash_params.h"

// X(head_class) for every class, smallest first.
#define PAGEDATTN_FLASH_HEAD_CLASSES(X) X(64) X(128) X(256)

namespace pagedattn::cuda_flash {

#define PAGEDATTN_FLASH_DECLARE_CLASS(hc) \
  int launch_hd##hc(const FlashParams& params, DType dtype, bool launch_combine, void* stream);
PAGEDATTN_FLASH_HEAD_CLASSES(PAGEDATTN_FLASH_DECLARE_CLASS)
#undef PAGEDATTN_FLASH_DECLARE_CLASS

// The wgmma prefill kernels (f16 and bf16; 16-bit or per-tensor fp8 K/V), compiled for sm_90a
// only (flash_wgmma_hd<N>.cu); launched by launch_class when choose_kernel
// picks KernelKind::WgmmaPrefill.
template <int kHeadClass>
int launch_wgmma_prefill(const FlashParams& params, DType dtype, void* stream);
#define PAGEDATTN_FLASH_DECLARE_WGMMA(hc) \
  template <>                             \
  int launch_wgmma_prefill<hc>(const FlashParams& params, DType dtype, void* stream);
PAGEDATTN_FLASH_HEAD_CLASSES(PAGEDATTN_FLASH_DECLARE_WGMMA)
#undef PAGEDATTN_FLASH_DECLARE_WGMMA

}  // namespace pagedattn::cuda_flash
