// The built-in CPU implementation of the ops (OpsImpl). It is not a backend:
// ops_impl(DeviceType::CPU) falls back to it when nothing else is registered.
#pragma once

#include <pagedattn/ops.h>

namespace pagedattn {

// The process-wide CPU OpsImpl (a function-local static).
OpsImpl& cpu_ops_impl();

}  // namespace pagedattn
