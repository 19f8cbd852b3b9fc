// Test helper: runs one thread per rank, as the loopback
// communicator's ranks.
#pragma once

#include <exception>
#include <functional>
#include <thread>
#include <vector>

namespace pagedattn::test {

// Runs body(rank) on one thread per rank and rethrows the first failure.
inline void run_ranks(int size, const std::function<void(int)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace pagedattn::test
