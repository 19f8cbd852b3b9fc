// Tensors crossing from Python: any DLPack or buffer-protocol array (PyTorch
// CPU/CUDA tensors, NumPy arrays) viewed zero-copy as a TensorView, and the
// CUDA stream the caller's framework is on.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <optional>
#include <string_view>

namespace pagedattn::python {

namespace nb = nanobind;
using Array = nb::ndarray<>;
using OptArray = std::optional<Array>;

// A view of `a` (same memory, shape and element strides). 16-bit unsigned
// arrays are read as bfloat16 (NumPy's ml_dtypes.bfloat16 crosses as its
// bits); a 0-d array is viewed as [1]. Throws InvalidArgument naming `name`
// for dtypes and devices the library has no use for.
TensorView view_of(const Array& a, std::string_view where, std::string_view name);
// Undefined when `a` is empty.
TensorView view_of(const OptArray& a, std::string_view where, std::string_view name);

// The same view with its element type replaced by one of equal size (u8
// cache bytes read as fp8).
TensorView reinterpret(const TensorView& t, DType dtype, std::string_view where, std::string_view name);

// Installs `stream` (a cudaStream_t as an integer; 0 = the legacy default
// stream) as the current stream for one call, when the call runs on CUDA.
class StreamScope {
 public:
  StreamScope(Device device, std::uintptr_t stream);

 private:
  std::optional<ForwardContextScope> scope_;
};

}  // namespace pagedattn::python
