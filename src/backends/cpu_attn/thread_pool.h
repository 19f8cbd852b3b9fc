// The CPU_ATTN threading layer: one small persistent pool per process.
//
// Policy (docs/cpu_attn.md):
//  - size = PAGEDATTN_NUM_THREADS, default std::thread::hardware_concurrency();
//    the caller of run() is one of the threads, so N - 1 workers are spawned;
//  - never oversubscribe: a call from inside a pool task, or while another
//    thread's call is running, runs all its tasks inline on the calling thread;
//  - tasks are claimed dynamically; results must not depend on which thread
//    runs a task (CPU_ATTN's work items write disjoint outputs).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pagedattn::cpu_attn {

// Environment variable that sizes the process-wide pool.
inline constexpr const char* kNumThreadsEnv = "PAGEDATTN_NUM_THREADS";

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the calling thread.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(task) for every task in [0, num_tasks) and returns when all are
  // done. `fn` must not throw. Allocates nothing.
  template <typename F>
  void run(int num_tasks, F&& fn) {
    run_slots(num_tasks, size(), [&fn](int task, int) { fn(task); });
  }

  // The same with at most `max_slots` threads taking part, fn(task, slot):
  // `slot` in [0, max_slots) names the thread, and no two threads run tasks
  // with the same slot at once (the caller is slot 0, and so is every task of
  // a call that runs inline), so a task may use per-slot memory.
  template <typename F>
  void run_slots(int num_tasks, int max_slots, F&& fn) {
    run_erased(num_tasks, max_slots, [](void* ctx, int task, int slot) { (*static_cast<F*>(ctx))(task, slot); },
               &fn);
  }

  // The process-wide pool, created on first use from PAGEDATTN_NUM_THREADS.
  // Throws InvalidArgument when the variable is not a positive integer.
  static ThreadPool& instance();
  // Replaces the process-wide pool with one of `num_threads` threads (tests,
  // benchmarks). Must not race with running forward calls.
  static void reset_instance(int num_threads);

 private:
  using TaskFn = void (*)(void* ctx, int task, int slot);
  void run_erased(int num_tasks, int max_slots, TaskFn fn, void* ctx);
  void worker_loop(int slot);
  void drain(int slot);

  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the one caller whose job the workers run
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::uint64_t generation_ = 0;
  int active_workers_ = 0;
  bool stop_ = false;
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int num_tasks_ = 0;
  int max_slots_ = 0;
  std::atomic<int> next_task_{0};
};

}  // namespace pagedattn::cpu_attn
