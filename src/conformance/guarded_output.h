// The conformance harness's poison patterns and the guarded buffers a
// forward writes into: an output and an LSE inside poisoned allocations with
// guard rows, read back with every element outside the real region checked.
#pragma once

#include <pagedattn/tensor.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace pagedattn::conformance {

constexpr int kGuardRows = 2;  // poisoned rows before and after the output (and LSE columns)

// NaN bit patterns with payloads arithmetic does not produce (e4m3 has one NaN).
std::uint64_t poison_bits(DType t);
std::vector<std::uint8_t> poison_bytes(DType t);
// Whether element `element` of `data` holds `pattern`.
bool equals_at(const std::vector<std::uint8_t>& data, std::size_t element,
               const std::vector<std::uint8_t>& pattern);

// An output [rows, H, D] inside a poisoned allocation with guard rows (and,
// when strided, a spare head's width per row).
struct GuardedOutput {
  Tensor storage;  // [kGuardRows + rows + kGuardRows, width]
  TensorView view;
  int rows = 0;
  std::int64_t width = 0;
  std::int64_t row_elems = 0;
};

GuardedOutput make_output(int rows, int heads, int head_size, DType dtype, Device device, bool strided);

// An LSE [H, rows] f32 inside a poisoned [H, rows + 2 * kGuardRows] allocation.
struct GuardedLse {
  Tensor storage;
  TensorView view;
};

GuardedLse make_lse(int heads, int rows, Device device);

// Real region [0, real_rows) x [0, row_elems) as floats; any other element
// that is no longer the poison pattern is reported.
std::optional<std::string> read_output(const GuardedOutput& o, int real_rows, std::vector<float>& real);
// Every head's real tokens [0, real_rows) as floats; a guard column or padded
// token that is no longer the poison pattern is reported.
std::optional<std::string> read_lse(const GuardedLse& l, int rows, int real_rows, std::vector<float>& real);

}  // namespace pagedattn::conformance
