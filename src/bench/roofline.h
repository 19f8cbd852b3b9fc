// The machine's ceilings, measured in the same process as the benchmark:
// streaming read bandwidth (a buffer larger than the last-level cache) and the
// fp32 FMA rate of the best SIMD target, both on every thread.
#pragma once

#include <pagedattn/tensor.h>

#include <cstddef>
#include <vector>

namespace pagedattn::bench {

// The roofline's streaming read, one pass per call, on `threads` threads at
// once. A shared host's memory bandwidth can move by 2x within seconds
// (docs/perf.md), so the benchmark also runs it between its timed repeats:
// the bandwidth a run is divided by then comes from the same phase as the run.
class ReadProbe {
 public:
  // Fewer than one thread counts as one. Allocates and first-touches the buffer.
  explicit ReadProbe(int threads);
  int threads() const { return threads_; }
  // One pass over the buffer: GB/s.
  double gb_per_s();

 private:
  int threads_;
  std::size_t slice_;  // floats per thread
  Tensor storage_;
  std::vector<float> sums_;  // one per thread, so the reads are not optimized away
};

struct Roofline {
  double read_gb_per_s = 0.0;  // median of the repeats
  double fma_gflop_per_s = 0.0;  // median of the repeats
  int threads = 0;
};

// The probe's read (median of a few passes) and the FMA rate on as many
// threads (each pinned to nothing; the OS spreads them).
Roofline measure_roofline(ReadProbe& probe);

}  // namespace pagedattn::bench
