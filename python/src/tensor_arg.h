// Tensors crossing from Python: any DLPack or buffer-protocol array (PyTorch
// CPU/CUDA tensors, NumPy arrays) viewed zero-copy as a TensorView, and the
// CUDA stream the caller's framework is on.
//
// Frameworks that publish DLPack's C exchange API on their tensor type
// (`__dlpack_c_exchange_api__`, PyTorch >= 2.10) are read through its C
// functions: a view and the current stream without a Python call, which is
// most of a decode call's host time otherwise (docs/python.md, "Host
// overhead"). Everything else goes through nanobind's ndarray import.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <pagedattn/attention_types.h>
#include <pagedattn/forward_context.h>
#include <pagedattn/tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pagedattn::python {

namespace nb = nanobind;

// A view of `obj` (same memory, shape and element strides); undefined for
// None. 16-bit unsigned arrays are read as bfloat16 (NumPy's
// ml_dtypes.bfloat16 crosses as its bits); a 0-d array is viewed as [1].
// Throws InvalidArgument naming `name` for objects that are not arrays and
// for dtypes and devices the library has no use for.
TensorView view_of(nb::handle obj, std::string_view where, std::string_view name);

// The same view with its element type replaced by one of equal size (u8
// cache bytes read as fp8).
TensorView reinterpret(const TensorView& t, DType dtype, std::string_view where, std::string_view name);

// The stream a call on `device` runs on (null off CUDA): `stream` when the
// caller passed one, else `like`'s framework's current stream on the device
// (C exchange API), else null, the legacy default stream.
void* resolve_stream(Device device, std::optional<std::uintptr_t> stream, nb::handle like);

// Names from Python read with the library's parsers; InvalidArgument
// naming `argument` and the accepted names otherwise.
DType dtype_arg(const std::string& name, std::string_view where);
Device device_arg(const std::string& name, std::string_view where);
CacheDType cache_dtype_arg(const std::string& name, std::string_view where, std::string_view argument);

// Installs the stream a CUDA call runs on for its duration: `stream` when
// the caller passed one (a cudaStream_t as an integer), else the current
// stream of `like`'s framework on its device when the framework exposes it
// through the C exchange API, else the legacy default stream.
class StreamScope {
 public:
  StreamScope(Device device, std::optional<std::uintptr_t> stream, nb::handle like);

 private:
  std::optional<ForwardContextScope> scope_;
};

}  // namespace pagedattn::python
