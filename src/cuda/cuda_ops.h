// The OpsImpl of DeviceType::CUDA (registered by register_cuda_runtime).
#pragma once

#include <pagedattn/ops.h>

namespace pagedattn::cuda {

OpsImpl& cuda_ops_impl();

}  // namespace pagedattn::cuda
