#include "backends/cpu_attn/thread_pool.h"

#include <gtest/gtest.h>
#include <pagedattn/error.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace pagedattn::cpu_attn {
namespace {

TEST(ThreadPoolTest, RunsEveryTaskExactlyOnce) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (int round = 0; round < 20; ++round) {
      std::vector<std::atomic<int>> hits(97);
      pool.run(static_cast<int>(hits.size()), [&](int t) { hits[static_cast<std::size_t>(t)].fetch_add(1); });
      for (const auto& h : hits) EXPECT_EQ(h.load(), 1);
    }
  }
}

TEST(ThreadPoolTest, WorkersShareTheTasks) {
  ThreadPool pool(2);
  std::mutex mu;
  std::set<std::thread::id> ids;
  pool.run(16, [&](int) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // long enough for the worker to wake
    const std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ids.size(), 2u);
}

TEST(ThreadPoolTest, NestedCallsRunInlineOnTheCallingThread) {
  ThreadPool pool(2);
  std::atomic<int> inner_total{0};
  std::atomic<bool> inner_left_thread{false};
  pool.run(4, [&](int) {
    const auto outer = std::this_thread::get_id();
    pool.run(5, [&](int) {
      if (std::this_thread::get_id() != outer) inner_left_thread = true;
      inner_total.fetch_add(1);
    });
  });
  EXPECT_EQ(inner_total.load(), 20);
  EXPECT_FALSE(inner_left_thread.load());
}

TEST(ThreadPoolTest, ConcurrentCallersBothFinish) {
  ThreadPool pool(2);
  std::atomic<int> total{0};
  auto caller = [&] {
    for (int i = 0; i < 50; ++i) pool.run(8, [&](int) { total.fetch_add(1); });
  };
  std::thread a(caller);
  std::thread b(caller);
  a.join();
  b.join();
  EXPECT_EQ(total.load(), 2 * 50 * 8);
}

// run_slots: every task runs once, with a slot below max_slots that no other
// thread holds meanwhile, on at most max_slots threads.
TEST(ThreadPoolTest, SlotsBoundTheThreads) {
  constexpr int kSlots = 2;
  constexpr int kTasks = 64;
  ThreadPool pool(4);
  std::vector<std::atomic<int>> running(kSlots);
  std::vector<std::atomic<int>> runs(kTasks);
  std::mutex mu;
  std::set<std::thread::id> threads;
  std::atomic<bool> bad_slot{false};
  std::atomic<bool> shared_slot{false};
  pool.run_slots(kTasks, kSlots, [&](int task, int slot) {
    runs[static_cast<std::size_t>(task)].fetch_add(1);
    if (slot < 0 || slot >= kSlots) {
      bad_slot = true;
      return;
    }
    if (running[static_cast<std::size_t>(slot)].fetch_add(1) != 0) shared_slot = true;
    {
      const std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    running[static_cast<std::size_t>(slot)].fetch_sub(1);
  });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
  EXPECT_FALSE(bad_slot.load());
  EXPECT_FALSE(shared_slot.load());
  EXPECT_LE(threads.size(), static_cast<std::size_t>(kSlots));
}

TEST(ThreadPoolTest, RejectsZeroThreads) { EXPECT_THROW(ThreadPool(0), Error); }

}  // namespace
}  // namespace pagedattn::cpu_attn
