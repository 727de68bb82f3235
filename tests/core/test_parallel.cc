#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mantissa/mantissa.h"

namespace mantissa {
namespace {

TEST(Parallel, VisitsEveryIndexOnceInGrainAlignedRanges) {
  for (int threads : {1, 2, 5}) {
    for (size_t n : {size_t{0}, size_t{1}, size_t{100}, size_t{12345}}) {
      std::vector<std::atomic<int>> hits(n);
      parallel_for(n, 64, threads, [&](size_t b, size_t e) {
        EXPECT_EQ(b % 64, 0u);
        for (size_t i = b; i < e; ++i) hits[i]++;
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i;
    }
  }
}

TEST(Parallel, RethrowsAWorkerException) {
  EXPECT_THROW(parallel_for(1000, 10, 4,
                            [](size_t b, size_t) {
                              if (b >= 500) throw std::runtime_error("boom");
                            }),
               std::runtime_error);
}

// A parallel_for or parallel_tasks inside a task runs on that task's thread, the calling thread's
// tasks (which hold the pool's job lock) as the workers'.
TEST(Parallel, NestedCallsRunInline) {
  std::atomic<int> total{0}, elsewhere{0};
  parallel_for(8, 1, 4, [&](size_t b, size_t e) {
    const std::thread::id outer = std::this_thread::get_id();
    for (size_t i = b; i < e; ++i) {
      parallel_for(100, 10, 4, [&](size_t b2, size_t e2) {
        total += static_cast<int>(e2 - b2);
        if (std::this_thread::get_id() != outer) ++elsewhere;
      });
      parallel_tasks(5, 4, [&](size_t) {
        ++total;
        if (std::this_thread::get_id() != outer) ++elsewhere;
      });
    }
  });
  EXPECT_EQ(total.load(), 840);
  EXPECT_EQ(elsewhere.load(), 0);
}

TEST(Parallel, ManyShortJobs) {
  // The pool is reused: thousands of tiny jobs complete (and quickly, though no test times it).
  std::atomic<long> sum{0};
  for (int job = 0; job < 5000; ++job)
    parallel_for(64, 1, 2, [&](size_t b, size_t e) { sum += static_cast<long>(e - b); });
  EXPECT_EQ(sum.load(), 5000L * 64);
}

TEST(Parallel, TasksRunOnceEachOnAnyThreadCount) {
  for (int threads : {1, 2, 5})
    for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
      std::vector<std::atomic<int>> hits(n);
      parallel_tasks(n, threads, [&](size_t t) { hits[t]++; });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << i << " of " << n;
    }
  EXPECT_THROW(parallel_tasks(100, 3,
                              [](size_t t) {
                                if (t == 57) throw std::runtime_error("boom");
                              }),
               std::runtime_error);
  std::atomic<int> inner{0};
  parallel_tasks(4, 2, [&](size_t) { parallel_tasks(10, 2, [&](size_t) { inner++; }); });
  EXPECT_EQ(inner.load(), 40);
}

// A job's tasks run under the module path of the thread that started it, whichever thread runs
// them (what a kernel's workers allocate is charged to the layer running), and the workers are
// back outside any module afterwards.
TEST(Parallel, TasksRunUnderTheCallersModulePath) {
  const std::string layer = "layer1.0.conv1";
  std::vector<std::string> seen(64);
  std::atomic<int> other_threads{0};
  const std::thread::id caller = std::this_thread::get_id();
  {
    const ModulePathScope scope(&layer);
    parallel_tasks(seen.size(), 2, [&](size_t t) {
      if (std::this_thread::get_id() != caller) other_threads++;
      std::this_thread::sleep_for(std::chrono::microseconds(100));  // let the worker take some
      seen[t] = current_module_path();
    });
  }
  EXPECT_GT(other_threads.load(), 0) << "no task ran on a worker: the test checks nothing";
  for (const std::string& s : seen) EXPECT_EQ(s, layer);
  parallel_tasks(seen.size(), 2, [&](size_t t) { seen[t] = current_module_path(); });
  for (const std::string& s : seen) EXPECT_EQ(s, "");
}

TEST(Parallel, DefaultThreadsIsPositive) { EXPECT_GE(default_num_threads(), 1); }

}  // namespace
}  // namespace mantissa
