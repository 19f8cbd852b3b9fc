// The registration functions of the module's parts (module.cpp calls each).
#pragma once

#include <nanobind/nanobind.h>

namespace pagedattn::python {

void register_ops(nanobind::module_& m);    // ops_bindings.cpp
void register_batch(nanobind::module_& m);  // batch_bindings.cpp
void register_layer(nanobind::module_& m);  // layer_bindings.cpp

}  // namespace pagedattn::python
