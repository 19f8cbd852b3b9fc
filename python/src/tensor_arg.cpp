#include "tensor_arg.h"

#include <pagedattn/error.h>

namespace pagedattn::python {
namespace {

namespace dl = nb::dlpack;

std::optional<DType> dtype_of(dl::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  const auto code = static_cast<dl::dtype_code>(t.code);
  switch (code) {
    case dl::dtype_code::Float:
      if (t.bits == 32) return DType::F32;
      if (t.bits == 16) return DType::F16;
      return std::nullopt;
    case dl::dtype_code::Bfloat:
      return t.bits == 16 ? std::optional(DType::BF16) : std::nullopt;
    case dl::dtype_code::Int:
      if (t.bits == 32) return DType::I32;
      if (t.bits == 64) return DType::I64;
      return std::nullopt;
    case dl::dtype_code::UInt:
      if (t.bits == 8) return DType::U8;
      if (t.bits == 16) return DType::BF16;
      return std::nullopt;
    case dl::dtype_code::Float8_E4M3FN:
      return DType::FP8_E4M3;
    case dl::dtype_code::Float8_E5M2:
      return DType::FP8_E5M2;
    default:
      return std::nullopt;
  }
}

std::optional<Device> device_of(const Array& a) {
  switch (a.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory
      return Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return Device::cuda(a.device_id());
    default:
      return std::nullopt;
  }
}

}  // namespace

TensorView view_of(const Array& a, std::string_view where, std::string_view name) {
  const std::optional<DType> dtype = dtype_of(a.dtype());
  if (!dtype) {
    throw_invalid(where, fmt::format("{} dtype", name), "f32, f16, bf16, fp8 (e4m3fn, e5m2), i32, i64 or u8",
                  fmt::format("DLPack code {} with {} bits", static_cast<int>(a.dtype().code),
                              static_cast<int>(a.dtype().bits)));
  }
  const std::optional<Device> device = device_of(a);
  if (!device) {
    throw_invalid(where, fmt::format("{} device", name), "cpu or cuda",
                  fmt::format("DLPack device type {}", a.device_type()));
  }
  if (a.ndim() == 0) return TensorView(a.data(), *dtype, *device, Dims{1}, Dims{1});
  check_arg(a.ndim() <= static_cast<std::size_t>(kMaxTensorDims), where, fmt::format("{} rank", name),
            fmt::format("<= {}", kMaxTensorDims), a.ndim());
  Dims shape;
  Dims strides;
  for (std::size_t d = 0; d < a.ndim(); ++d) {
    shape.push_back(static_cast<std::int64_t>(a.shape(d)));
    strides.push_back(a.stride(d));
  }
  return TensorView(a.data(), *dtype, *device, shape, strides);
}

TensorView view_of(const OptArray& a, std::string_view where, std::string_view name) {
  return a ? view_of(*a, where, name) : TensorView{};
}

TensorView reinterpret(const TensorView& t, DType dtype, std::string_view where, std::string_view name) {
  if (!t.defined() || t.dtype() == dtype) return t;
  check_arg(dtype_size(t.dtype()) == dtype_size(dtype), where, fmt::format("{} dtype", name),
            fmt::format("{} or a {}-byte type to read as it", dtype, dtype_size(dtype)), t.dtype());
  return TensorView(t.data(), dtype, t.device(), t.shape(), t.strides());
}

StreamScope::StreamScope(Device device, std::uintptr_t stream) {
  if (device.is_cuda() && stream != 0) {
    ForwardContext context;
    context.stream = reinterpret_cast<void*>(stream);
    scope_.emplace(std::move(context));
  }
}

}  // namespace pagedattn::python
