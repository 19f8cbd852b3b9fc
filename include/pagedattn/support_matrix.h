// The support matrix, generated from the backends' own capability queries so
// the documentation can never drift from the code (docs/support_matrix.md is
// this output; a test compares them).
#pragma once

#include <pagedattn/backend/backend.h>

#include <string>
#include <utility>
#include <vector>

namespace pagedattn {

struct SupportRow {
  std::string feature;
  std::vector<std::string> cells;  // one per backend, in the given order
};

std::vector<SupportRow> support_matrix(const std::vector<const AttentionBackend*>& backends);

// A Markdown table with a header row of backend names.
std::string support_matrix_markdown(const std::vector<const AttentionBackend*>& backends);

}  // namespace pagedattn
