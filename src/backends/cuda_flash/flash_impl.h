// The CUDA_FLASH impl: validates a forward call, fills the kernel params from
// the layer, the tensors and the uploaded plan, and launches on the forward
// context's stream. It never allocates (except the documented fallback for
// an oversized partial region) and never synchronizes.
#pragma once

#include <pagedattn/backend/backend.h>

#include <memory>

namespace pagedattn::cuda_flash {

std::unique_ptr<AttentionImpl> make_flash_impl(const AttentionImplParams& params, const AttentionBackend& backend);

}  // namespace pagedattn::cuda_flash
