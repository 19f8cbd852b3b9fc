// pagedattn._pagedattn: the library's Python entry. pagedattn::Error becomes
// the Python exception of its kind: ValueError (invalid argument),
// NotImplementedError (unsupported combination), MemoryError, RuntimeError
// (device errors). The pure-Python package (python/pagedattn/) wraps these
// functions with framework conveniences (torch streams and dtypes).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <pagedattn/backend/registry.h>
#include <pagedattn/error.h>
#include <pagedattn/tensor.h>

#include <string>
#include <vector>

#include "bindings.h"

namespace nb = nanobind;

namespace {

void translate_error(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const pagedattn::Error& e) {
    switch (e.kind()) {
      case pagedattn::ErrorKind::InvalidArgument:
        PyErr_SetString(PyExc_ValueError, e.what());
        return;
      case pagedattn::ErrorKind::Unsupported:
        PyErr_SetString(PyExc_NotImplementedError, e.what());
        return;
      case pagedattn::ErrorKind::OutOfMemory:
        PyErr_SetString(PyExc_MemoryError, e.what());
        return;
      case pagedattn::ErrorKind::Device:
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return;
    }
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (const pagedattn::AttentionBackend* b : pagedattn::BackendRegistry::instance().all()) {
    names.emplace_back(b->name());
  }
  return names;
}

int cuda_device_count() {
  const pagedattn::DeviceAllocator* cuda = pagedattn::find_device_allocator(pagedattn::DeviceType::CUDA);
  return cuda != nullptr ? cuda->device_count() : 0;
}

}  // namespace

NB_MODULE(_pagedattn, m) {
  m.doc() = "pagedattn: paged-KV attention backends (REFERENCE, CPU_ATTN, CUDA_FLASH) for CPU and CUDA";
  nb::register_exception_translator(translate_error);
  m.attr("__version__") = PAGEDATTN_VERSION;
#ifdef PAGEDATTN_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif
  m.def("backends", &backend_names, "Names of the backends compiled into the library, in registration order.");
  m.def("cuda_device_count", &cuda_device_count, "CUDA devices the library can use (0 without CUDA or a driver).");
  pagedattn::python::register_ops(m);
  pagedattn::python::register_batch(m);
  pagedattn::python::register_layer(m);
}
