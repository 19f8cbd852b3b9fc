// Setting up a conformance case: checking that the case itself makes sense,
// why a backend skips it, and its random inputs as row tensors (separate, or
// views into one fused qkv buffer).
#pragma once

#include <pagedattn/backend/backend.h>
#include <pagedattn/conformance.h>

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "conformance/rng.h"

namespace pagedattn::conformance {

// [rows, heads, D] model-dtype values.
std::vector<float> random_rows(Rng& rng, std::size_t elements, DType dtype);

// The parts joined by "; ".
std::string join(const std::vector<std::string>& parts);

// The case itself must make sense before a backend is blamed.
void validate_case(const ConformanceCase& c);

// Why `backend` cannot run `c` on `device`, or nothing if it can.
std::optional<std::string> skip_reason(const AttentionBackend& backend, const ConformanceCase& c,
                                       Device device);

// Row tensors [rows, heads_i, D]; with `fused`, views into one
// [rows, sum(heads_i) * D] buffer (rows strided, as a fused qkv projection).
struct RowTensors {
  std::vector<Tensor> owners;
  std::vector<TensorView> views;
};

RowTensors make_row_tensors(const std::vector<const std::vector<float>*>& parts,
                            const std::vector<int>& heads, int rows, int head_size, DType dtype,
                            Device device, bool fused);

}  // namespace pagedattn::conformance
