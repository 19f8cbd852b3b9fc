#include "conformance/guarded_output.h"

#include <fmt/format.h>

#include <algorithm>

namespace pagedattn::conformance {

std::uint64_t poison_bits(DType t) {
  switch (t) {
    case DType::F32:
      return 0x7FC0DEADu;
    case DType::F16:
      return 0x7E5Au;
    case DType::BF16:
      return 0x7FDAu;
    case DType::FP8_E4M3:
      return 0x7Fu;
    case DType::FP8_E5M2:
      return 0x7Eu;
    default:
      return 0xFFu;
  }
}

std::vector<std::uint8_t> poison_bytes(DType t) {
  const std::uint64_t bits = poison_bits(t);
  std::vector<std::uint8_t> bytes(dtype_size(t));
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::uint8_t>(bits >> (8 * i));
  return bytes;
}

bool equals_at(const std::vector<std::uint8_t>& data, std::size_t element,
               const std::vector<std::uint8_t>& pattern) {
  return std::equal(pattern.begin(), pattern.end(),
                    data.begin() + static_cast<std::ptrdiff_t>(element * pattern.size()));
}

GuardedOutput make_output(int rows, int heads, int head_size, DType dtype, Device device, bool strided) {
  GuardedOutput o;
  o.rows = rows;
  o.row_elems = static_cast<std::int64_t>(heads) * head_size;
  o.width = o.row_elems + (strided ? head_size : 0);
  o.storage = Tensor::empty({rows + 2 * kGuardRows, o.width}, dtype, device);
  auto* base = static_cast<std::byte*>(o.storage.data()) +
               kGuardRows * o.width * static_cast<std::int64_t>(dtype_size(dtype));
  o.view = TensorView(base, dtype, device, Dims{rows, heads, head_size}, Dims{o.width, head_size, 1});
  return o;
}

GuardedLse make_lse(int heads, int rows, Device device) {
  GuardedLse l;
  const std::int64_t width = rows + 2 * kGuardRows;
  l.storage = Tensor::empty({heads, width}, DType::F32, device);
  auto* base = static_cast<float*>(l.storage.data()) + kGuardRows;
  l.view = TensorView(base, DType::F32, device, Dims{heads, rows}, Dims{width, 1});
  return l;
}

std::optional<std::string> read_output(const GuardedOutput& o, int real_rows, std::vector<float>& real) {
  const DType t = o.storage.dtype();
  const auto bytes = to_byte_vector(o.storage);
  const auto poison = poison_bytes(t);
  real.clear();
  for (std::int64_t g = 0; g < o.rows + 2 * kGuardRows; ++g) {
    const std::int64_t row = g - kGuardRows;
    const bool real_row = row >= 0 && row < real_rows;
    for (std::int64_t col = 0; col < o.width; ++col) {
      const auto e = static_cast<std::size_t>(g * o.width + col);
      if (real_row && col < o.row_elems) {
        real.push_back(load_as_float(&bytes[e * poison.size()], t));
      } else if (!equals_at(bytes, e, poison)) {
        const char* what =
            row < 0 || row >= o.rows ? "guard row" : (col >= o.row_elems ? "row stride gap" : "padded row");
        return fmt::format("output {} overwritten: row {}, element {}", what, row, col);
      }
    }
  }
  return std::nullopt;
}

std::optional<std::string> read_lse(const GuardedLse& l, int rows, int real_rows, std::vector<float>& real) {
  const auto bytes = to_byte_vector(l.storage);
  const auto poison = poison_bytes(DType::F32);
  const std::int64_t heads = l.storage.size(0);
  const std::int64_t width = l.storage.size(1);
  real.clear();
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t col = 0; col < width; ++col) {
      const std::int64_t token = col - kGuardRows;
      const auto e = static_cast<std::size_t>(h * width + col);
      if (token >= 0 && token < real_rows) {
        real.push_back(load_as_float(&bytes[e * poison.size()], DType::F32));
      } else if (!equals_at(bytes, e, poison)) {
        const char* what = token < 0 || token >= rows ? "guard column" : "padded token";
        return fmt::format("lse {} overwritten: head {}, token {}", what, h, token);
      }
    }
  }
  return std::nullopt;
}

}  // namespace pagedattn::conformance
