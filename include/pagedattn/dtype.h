// Names and parsing of element types and devices (the scalar definitions live
// in scalar.h, which kernels include).
#pragma once

#include <fmt/format.h>
#include <pagedattn/backend/scalar.h>

#include <optional>
#include <string>
#include <string_view>

namespace pagedattn {

// Canonical short name: "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2", "i32", "i64", "u8".
std::string_view dtype_name(DType t);

// Accepts the canonical names and common aliases ("float32", "float", "float16",
// "half", "bfloat16", "fp8", "int32", ...). Returns nullopt for anything else.
std::optional<DType> parse_dtype(std::string_view name);

enum class DeviceType : std::uint8_t { CPU = 0, CUDA = 1 };

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static constexpr Device cpu() { return Device{DeviceType::CPU, 0}; }
  static constexpr Device cuda(int index = 0) { return Device{DeviceType::CUDA, index}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  friend bool operator==(const Device&, const Device&) = default;
};

// CUDA compute capability (major.minor); {0, 0} for the CPU.
struct DeviceCapability {
  int major = 0;
  int minor = 0;
  int as_int() const { return major * 10 + minor; }
  friend bool operator==(const DeviceCapability&, const DeviceCapability&) = default;
};

// "cpu" or "cuda:N".
std::string device_name(const Device& d);
std::string_view device_type_name(DeviceType t);
// Accepts "cpu", "cuda", "cuda:N".
std::optional<Device> parse_device(std::string_view name);

}  // namespace pagedattn

template <>
struct fmt::formatter<pagedattn::DType> : fmt::formatter<std::string_view> {
  auto format(pagedattn::DType t, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(pagedattn::dtype_name(t), ctx);
  }
};

template <>
struct fmt::formatter<pagedattn::Device> : fmt::formatter<std::string_view> {
  auto format(const pagedattn::Device& d, format_context& ctx) const {
    return fmt::formatter<std::string_view>::format(pagedattn::device_name(d), ctx);
  }
};
