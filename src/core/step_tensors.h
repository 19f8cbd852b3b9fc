// Checks and views of a step's metadata tensors that metadata.cpp and
// mm_prefix.cpp share (definitions: metadata.cpp).
#pragma once

#include <pagedattn/metadata.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace pagedattn {

// The values of a host int32 tensor, which callers have checked is
// contiguous; empty when it is undefined.
inline std::span<const std::int32_t> host_i32(const Tensor& t) {
  if (!t.defined()) return {};
  return {static_cast<const std::int32_t*>(t.data()), static_cast<std::size_t>(t.numel())};
}

// Throws InvalidArgument unless `t` is defined, of `rank` and `dtype`, and on
// `device`; an undefined one is reported as not `defined_expected`.
void check_step_tensor(std::string_view where, const Tensor& t, std::string_view name, DType dtype, int rank,
                       Device device, std::string_view defined_expected = "a defined tensor");

// Throws InvalidArgument unless `t` is contiguous (read as one span).
void check_contiguous(std::string_view where, const Tensor& t, std::string_view name);

}  // namespace pagedattn
