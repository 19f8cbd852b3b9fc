#include "backends/cpu_attn/thread_pool.h"

#include <pagedattn/error.h>

#include <cstdlib>
#include <memory>
#include <string>

namespace pagedattn::cpu_attn {

namespace {

// True on a pool worker and on a caller while it runs a pool job: nested
// calls then run inline instead of queueing behind themselves.
thread_local bool tl_inside_pool = false;

int threads_from_env() {
  const char* value = std::getenv(kNumThreadsEnv);
  if (value == nullptr || *value == '\0') {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  constexpr long kMaxThreads = 1024;
  check_arg(*end == '\0' && n >= 1 && n <= kMaxThreads, "CPU_ATTN", kNumThreadsEnv,
            fmt::format("an integer in [1, {}]", kMaxThreads), fmt::format("'{}'", value));
  return static_cast<int>(n);
}

std::unique_ptr<ThreadPool>& instance_slot() {
  static std::unique_ptr<ThreadPool> pool;
  return pool;
}

std::mutex& instance_mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

ThreadPool::ThreadPool(int num_threads) {
  check_arg(num_threads >= 1, "ThreadPool", "num_threads", ">= 1", num_threads);
  workers_.reserve(static_cast<std::size_t>(num_threads - 1));
  for (int slot = 1; slot < num_threads; ++slot) workers_.emplace_back([this, slot] { worker_loop(slot); });
}

ThreadPool::~ThreadPool() {
  {
    const std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool& ThreadPool::instance() {
  const std::lock_guard<std::mutex> lock(instance_mutex());
  auto& slot = instance_slot();
  if (!slot) slot = std::make_unique<ThreadPool>(threads_from_env());
  return *slot;
}

void ThreadPool::reset_instance(int num_threads) {
  auto pool = std::make_unique<ThreadPool>(num_threads);
  const std::lock_guard<std::mutex> lock(instance_mutex());
  instance_slot() = std::move(pool);
}

void ThreadPool::drain(int slot) {
  if (slot >= max_slots_) return;
  for (int task = next_task_.fetch_add(1); task < num_tasks_; task = next_task_.fetch_add(1)) fn_(ctx_, task, slot);
}

void ThreadPool::run_erased(int num_tasks, int max_slots, TaskFn fn, void* ctx) {
  if (num_tasks <= 0) return;
  const bool inline_only = workers_.empty() || num_tasks == 1 || max_slots <= 1 || tl_inside_pool;
  std::unique_lock<std::mutex> busy(busy_, std::defer_lock);
  if (inline_only || !busy.try_lock()) {
    for (int task = 0; task < num_tasks; ++task) fn(ctx, task, 0);
    return;
  }
  tl_inside_pool = true;
  {
    const std::lock_guard<std::mutex> lock(mu_);
    fn_ = fn;
    ctx_ = ctx;
    num_tasks_ = num_tasks;
    max_slots_ = max_slots;
    next_task_.store(0);
    active_workers_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  drain(0);
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return active_workers_ == 0; });
  }
  tl_inside_pool = false;
}

void ThreadPool::worker_loop(int slot) {
  tl_inside_pool = true;
  std::uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain(slot);
    {
      const std::lock_guard<std::mutex> lock(mu_);
      --active_workers_;
    }
    done_.notify_one();
  }
}

}  // namespace pagedattn::cpu_attn
