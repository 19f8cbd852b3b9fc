// The machine's ceilings, measured in the same process as the benchmark:
// streaming read bandwidth (a buffer larger than the last-level cache) and the
// fp32 FMA rate of the best SIMD target, both on every thread.
#pragma once

namespace pagedattn::bench {

struct Roofline {
  double read_gb_per_s = 0.0;  // median of the repeats
  double fma_gflop_per_s = 0.0;  // median of the repeats
  int threads = 0;
};

// `threads` >= 1 workers (each pinned to nothing; the OS spreads them).
Roofline measure_roofline(int threads);

}  // namespace pagedattn::bench
