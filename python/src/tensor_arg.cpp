#include "tensor_arg.h"

#include <pagedattn/error.h>

#include <unordered_map>

namespace pagedattn::python {
namespace {

namespace dl = nb::dlpack;

// DLPack's C exchange API (dlpack.h >= 1.2), the members this module calls.
// The table is the framework's and lives for the process.
struct ExchangeVersion {
  std::uint32_t major;
  std::uint32_t minor;
};
struct ExchangeApi {
  ExchangeVersion version;
  const void* prev_api;
  const void* managed_tensor_allocator;
  const void* managed_tensor_from_py_object_no_sync;
  const void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, dl::dltensor* out);
  int (*current_work_stream)(std::int32_t device_type, std::int32_t device_id, void** out_stream);
};
constexpr std::uint32_t kExchangeMajor = 1;
constexpr const char* kExchangeCapsule = "dlpack_exchange_api";

// The exchange API of a Python type, looked up once per type (null: none).
const ExchangeApi* exchange_api(PyTypeObject* type) {
  static std::unordered_map<PyTypeObject*, const ExchangeApi*> by_type;
  const auto it = by_type.find(type);
  if (it != by_type.end()) return it->second;
  const ExchangeApi* api = nullptr;
  PyObject* capsule = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (capsule != nullptr) {
    api = static_cast<const ExchangeApi*>(PyCapsule_GetPointer(capsule, kExchangeCapsule));
    Py_DECREF(capsule);
    if (api != nullptr && (api->version.major != kExchangeMajor || api->dltensor_from_py_object_no_sync == nullptr)) {
      api = nullptr;
    }
  }
  PyErr_Clear();
  by_type.emplace(type, api);
  return api;
}

std::optional<DType> dtype_of(dl::dtype t) {
  if (t.lanes != 1) return std::nullopt;
  switch (static_cast<dl::dtype_code>(t.code)) {
    case dl::dtype_code::Float:
      if (t.bits == 32) return DType::F32;
      if (t.bits == 16) return DType::F16;
      return std::nullopt;
    case dl::dtype_code::Bfloat:
      return t.bits == 16 ? std::optional(DType::BF16) : std::nullopt;
    case dl::dtype_code::Int:
      if (t.bits == 8) return DType::I8;
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

std::optional<Device> device_of(std::int32_t type, std::int32_t id) {
  switch (type) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:  // pinned host memory
      return Device::cpu();
    case nb::device::cuda::value:
    case nb::device::cuda_managed::value:
      return Device::cuda(id);
    default:
      return std::nullopt;
  }
}

// A TensorView of a DLPack tensor description (strides null = row-major).
TensorView from_dltensor(void* data, dl::dtype dtype, std::int32_t device_type, std::int32_t device_id, int ndim,
                         const std::int64_t* shape, const std::int64_t* strides, std::string_view where,
                         std::string_view name) {
  const std::optional<DType> t = dtype_of(dtype);
  if (!t) {
    throw_invalid(where, fmt::format("{} dtype", name), "f32, f16, bf16, fp8 (e4m3fn, e5m2), i32, i64 or u8",
                  fmt::format("DLPack code {} with {} bits", static_cast<int>(dtype.code), static_cast<int>(dtype.bits)));
  }
  const std::optional<Device> device = device_of(device_type, device_id);
  if (!device) {
    throw_invalid(where, fmt::format("{} device", name), "cpu or cuda", fmt::format("DLPack device type {}", device_type));
  }
  if (ndim == 0) return TensorView(data, *t, *device, Dims{1}, Dims{1});
  check_arg(ndim > 0 && ndim <= kMaxTensorDims, where, fmt::format("{} rank", name), fmt::format("<= {}", kMaxTensorDims),
            ndim);
  const Dims dims(std::span<const std::int64_t>(shape, static_cast<std::size_t>(ndim)));
  if (strides == nullptr) return TensorView(data, *t, *device, dims);  // row-major
  return TensorView(data, *t, *device, dims, Dims(std::span<const std::int64_t>(strides, static_cast<std::size_t>(ndim))));
}

}  // namespace

TensorView view_of(nb::handle obj, std::string_view where, std::string_view name) {
  if (obj.is_none()) return {};
  if (const ExchangeApi* api = exchange_api(Py_TYPE(obj.ptr()))) {
    dl::dltensor t;
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) throw nb::python_error();
    return from_dltensor(static_cast<char*>(t.data) + t.byte_offset, t.dtype, t.device.device_type,
                         t.device.device_id, t.ndim, t.shape, t.strides, where, name);
  }
  nb::ndarray<> a;
  if (!nb::try_cast(obj, a)) {
    throw_invalid(where, name, "a tensor or array (DLPack or the buffer protocol)",
                  nb::type_name(obj.type()).c_str());
  }
  std::vector<std::int64_t> shape(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) shape[d] = static_cast<std::int64_t>(a.shape(d));
  std::vector<std::int64_t> strides(a.ndim());
  for (std::size_t d = 0; d < a.ndim(); ++d) strides[d] = a.stride(d);
  // The memory belongs to `obj`, which outlives the call; the import handle may go.
  return from_dltensor(a.data(), a.dtype(), a.device_type(), a.device_id(), static_cast<int>(a.ndim()), shape.data(),
                       strides.data(), where, name);
}

DType dtype_arg(const std::string& name, std::string_view where) {
  const std::optional<DType> t = parse_dtype(name);
  if (!t || !(*t == DType::F32 || *t == DType::F16 || *t == DType::BF16)) {
    throw_invalid(where, "dtype", "f32, f16 or bf16", name);
  }
  return *t;
}

Device device_arg(const std::string& name, std::string_view where) {
  const std::optional<Device> d = parse_device(name);
  if (!d) throw_invalid(where, "device", "cpu, cuda or cuda:N", name);
  return *d;
}

CacheDType cache_dtype_arg(const std::string& name, std::string_view where, std::string_view argument) {
  const std::optional<CacheDType> t = parse_cache_dtype(name);
  if (!t) {
    throw_invalid(
        where, argument,
        "auto, float16, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_head or fp8_per_token_head", name);
  }
  return *t;
}

TensorView reinterpret(const TensorView& t, DType dtype, std::string_view where, std::string_view name) {
  if (!t.defined() || t.dtype() == dtype) return t;
  check_arg(dtype_size(t.dtype()) == dtype_size(dtype), where, fmt::format("{} dtype", name),
            fmt::format("{} or a {}-byte type to read as it", dtype, dtype_size(dtype)), t.dtype());
  return TensorView(t.data(), dtype, t.device(), t.shape(), t.strides());
}

void* resolve_stream(Device device, std::optional<std::uintptr_t> stream, nb::handle like) {
  if (!device.is_cuda()) return nullptr;
  if (stream) return reinterpret_cast<void*>(*stream);
  void* current = nullptr;
  if (const ExchangeApi* api = like.is_valid() ? exchange_api(Py_TYPE(like.ptr())) : nullptr;
      api != nullptr && api->current_work_stream != nullptr) {
    if (api->current_work_stream(nb::device::cuda::value, device.index, &current) != 0) throw nb::python_error();
  }
  return current;
}

StreamScope::StreamScope(Device device, std::optional<std::uintptr_t> stream, nb::handle like) {
  void* current = resolve_stream(device, stream, like);
  if (current == nullptr) return;
  ForwardContext context;
  context.stream = current;
  scope_.emplace(std::move(context));
}

}  // namespace pagedattn::python
