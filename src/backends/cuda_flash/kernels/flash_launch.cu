// Dispatch from a head size to its class's launcher (instantiations.h).
#include "flash_attention.cuh"
#include "instantiations.h"

namespace pagedattn::cuda_flash {

int head_size_class(int head_size) {
  if (head_size <= 0 || head_size > kMaxHeadSize || head_size % kHeadSizeAlign != 0) return 0;
#define PAGEDATTN_FLASH_PICK_CLASS(hc) \
  if (head_size <= (hc)) return (hc);
  PAGEDATTN_FLASH_HEAD_CLASSES(PAGEDATTN_FLASH_PICK_CLASS)
#undef PAGEDATTN_FLASH_PICK_CLASS
  return 0;
}

int launch_flash_attention(const FlashParams& params, DType dtype, bool launch_combine, void* stream) {
  const int hc = head_size_class(params.head_size);
#define PAGEDATTN_FLASH_LAUNCH(c) \
  if (hc == (c)) return launch_hd##c(params, dtype, launch_combine, stream);
  PAGEDATTN_FLASH_HEAD_CLASSES(PAGEDATTN_FLASH_LAUNCH)
#undef PAGEDATTN_FLASH_LAUNCH
  return kLaunchUnsupportedHeadSize;
}

}  // namespace pagedattn::cuda_flash
