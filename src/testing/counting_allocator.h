// Counts heap allocations of the test binary: counting_allocator.cpp replaces
// the global operator new / delete with versions that count while a test
// says so. It lives in its own translation unit, so that no test inlines the
// replaced operators (GCC then misreads new + free as mismatched).
#pragma once

namespace pagedattn::test {

void start_counting_allocations();
// Stops counting; returns the allocations since start_counting_allocations.
long stop_counting_allocations();

// Allocations while `f` runs, on any thread.
template <class F>
long allocations_during(F&& f) {
  start_counting_allocations();
  f();
  return stop_counting_allocations();
}

}  // namespace pagedattn::test
