// The median the benchmarks report: medians, not minima or maxima, because on a
// shared machine single repeats stray both ways.
#pragma once

#include <algorithm>
#include <vector>

namespace pagedattn::bench {

// The upper median of `values` (taken by value: it is sorted). Needs at least one value.
inline double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace pagedattn::bench
