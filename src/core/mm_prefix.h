// PrefixLM ranges of a step: the check CommonAttentionMetadata::validate runs.
#pragma once

#include <pagedattn/metadata.h>

#include <cstdint>
#include <span>
#include <string_view>

namespace pagedattn {

constexpr int kMmPrefixRangeWidth = 2;  // a range's values: (start, end)

// Throws InvalidArgument unless the step's four PrefixLM tensors are all
// undefined, or all defined (i32, contiguous, [B + 1] and [R, 2], host and
// device copies of one shape) on a causal decoder step, with offsets from 0
// to R and each request's ranges sorted, disjoint, non-empty and within
// [0, seq_len]. Reads the host copies only.
void check_mm_prefix_ranges(std::string_view where, const CommonAttentionMetadata& md);

// The part of check_mm_prefix_ranges that reads the ranges' values, on CSR
// host arrays (`ranges` flattened (start, end) pairs) against a step of
// seq_lens.size() requests, before they are stored anywhere.
void check_mm_prefix_range_values(std::string_view where, std::span<const std::int32_t> seq_lens,
                                  std::span<const std::int32_t> start_loc,
                                  std::span<const std::int32_t> ranges);

// set_mm_prefix_ranges, its errors naming `where`.
void assign_mm_prefix_ranges(std::string_view where, CommonAttentionMetadata& md,
                             std::span<const std::int32_t> start_loc, std::span<const std::int32_t> ranges);

}  // namespace pagedattn
