#include <pagedattn/dtype.h>

#include "core/strings.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <string>
#include <utility>

namespace pagedattn {
namespace {

// Every accepted spelling (lower case) and the type it names; canonical names first.
constexpr std::array<std::pair<std::string_view, DType>, 29> kDTypeAliases{{
    {"f32", DType::F32},
    {"f16", DType::F16},
    {"bf16", DType::BF16},
    {"fp8_e4m3", DType::FP8_E4M3},
    {"fp8_e5m2", DType::FP8_E5M2},
    {"i32", DType::I32},
    {"i64", DType::I64},
    {"u8", DType::U8},
    {"i8", DType::I8},
    {"float32", DType::F32},
    {"float", DType::F32},
    {"fp32", DType::F32},
    {"float16", DType::F16},
    {"half", DType::F16},
    {"fp16", DType::F16},
    {"bfloat16", DType::BF16},
    {"fp8", DType::FP8_E4M3},
    {"e4m3", DType::FP8_E4M3},
    {"fp8_e4m3fn", DType::FP8_E4M3},
    {"float8_e4m3fn", DType::FP8_E4M3},
    {"e5m2", DType::FP8_E5M2},
    {"float8_e5m2", DType::FP8_E5M2},
    {"int32", DType::I32},
    {"int", DType::I32},
    {"int64", DType::I64},
    {"long", DType::I64},
    {"uint8", DType::U8},
    {"byte", DType::U8},
    {"int8", DType::I8},
}};

constexpr std::string_view kCudaPrefix = "cuda:";

}  // namespace

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    case DType::FP8_E4M3:
      return "fp8_e4m3";
    case DType::FP8_E5M2:
      return "fp8_e5m2";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
    case DType::I8:
      return "i8";
  }
  return "unknown";
}

std::optional<DType> parse_dtype(std::string_view name) {
  const std::string key = detail::to_lower(name);
  for (const auto& [alias, type] : kDTypeAliases) {
    if (key == alias) return type;
  }
  return std::nullopt;
}

std::string_view device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
  }
  return "unknown";
}

std::string device_name(const Device& d) {
  if (d.is_cpu()) return "cpu";
  return fmt::format("{}:{}", device_type_name(d.type), d.index);
}

std::optional<Device> parse_device(std::string_view name) {
  const std::string key = detail::to_lower(name);
  if (key == "cpu") return Device::cpu();
  if (key == "cuda") return Device::cuda(0);
  if (!key.starts_with(kCudaPrefix)) return std::nullopt;
  const std::string_view digits = std::string_view(key).substr(kCudaPrefix.size());
  int index = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), index);
  if (digits.empty() || ec != std::errc{} || end != digits.data() + digits.size() || index < 0) {
    return std::nullopt;
  }
  return Device::cuda(index);
}

}  // namespace pagedattn
