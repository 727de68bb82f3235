#include "mantissa/core/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mantissa/core/memory.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MANTISSA_CPU_RELAX() _mm_pause()
#else
#define MANTISSA_CPU_RELAX() ((void)0)
#endif

namespace mantissa {

namespace {
std::atomic<int> g_num_threads{0};  // set_num_threads(); 0: not set
}  // namespace

void set_num_threads(int n) { g_num_threads.store(n > 0 ? n : 0); }

int default_num_threads() {
  if (const int n = g_num_threads.load(std::memory_order_relaxed); n > 0) return n;
  if (const char* env = std::getenv("MANTISSA_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

namespace {

// A persistent pool: kernels call parallel_for many times per training step, far too often to
// start threads each time. Workers sleep on a condition variable between jobs; a job is a set of
// task indices taken from an atomic counter, the calling thread working alongside. One job runs at
// a time; a parallel_for called from inside a job runs on the calling thread alone.
class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool pool;
    return pool;
  }

  void run(size_t tasks, int threads, const std::function<void(size_t)>& task) {
    // Nested (this thread is running a task of a job, the calling thread included, which holds
    // job_mu_: it must not lock it again) or concurrent (another thread's job runs): inline.
    if (t_in_task) {
      for (size_t t = 0; t < tasks; ++t) task(t);
      return;
    }
    std::unique_lock<std::mutex> job_lock(job_mu_, std::try_to_lock);
    if (!job_lock.owns_lock() || in_job_) {
      for (size_t t = 0; t < tasks; ++t) task(t);
      return;
    }
    ensure_workers(static_cast<size_t>(threads) - 1);
    const size_t helpers = std::min<size_t>(static_cast<size_t>(threads) - 1, workers_.size());
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = &task;
      tasks_ = tasks;
      module_path_ = &current_module_path();
      next_.store(0);
      remaining_helpers_.store(helpers);
      active_helpers_ = helpers;
      error_ = nullptr;
      generation_.fetch_add(1);
      in_job_ = true;
    }
    wake_.notify_all();
    work();
    // Helpers usually finish within microseconds of the caller: spin a little before sleeping.
    for (int spin = 0; spin < kSpins && remaining_helpers_.load() != 0; ++spin)
      MANTISSA_CPU_RELAX();
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return remaining_helpers_.load() == 0; });
    in_job_ = false;
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

 private:
  void ensure_workers(size_t n) {
    while (workers_.size() < n) {
      const size_t id = workers_.size();
      workers_.emplace_back([this, id] { loop(id); });
    }
  }

  // Takes task indices until none are left, under the module path of the thread that started the
  // job: what a task allocates is charged to the layer whose op runs it.
  void work() {
    const ModulePathScope path(module_path_);
    for (;;) {
      const size_t t = next_.fetch_add(1);
      if (t >= tasks_) return;
      try {
        t_in_task = true;
        (*task_)(t);
        t_in_task = false;
      } catch (...) {
        t_in_task = false;
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  void loop(size_t id) {
    uint64_t seen = 0;
    for (;;) {
      // Jobs come in bursts (one per kernel call): spin a little before sleeping.
      for (int spin = 0; spin < kSpins && generation_.load() == seen; ++spin) MANTISSA_CPU_RELAX();
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock,
                   [&] { return stop_ || (generation_.load() != seen && id < active_helpers_); });
        if (stop_) return;
        seen = generation_.load();
      }
      work();
      std::lock_guard<std::mutex> lock(mu_);
      if (remaining_helpers_.fetch_sub(1) == 1) done_.notify_one();
    }
  }

  static thread_local bool t_in_task;  // this thread is inside a task of a job
  std::mutex job_mu_;                  // one job at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(size_t)>* task_ = nullptr;
  size_t tasks_ = 0;
  const std::string* module_path_ = nullptr;  // the caller's current_module_path() during a job
  std::atomic<size_t> next_{0};
  static constexpr int kSpins = 20000;  // ~50-100 us of pause instructions
  std::atomic<size_t> remaining_helpers_{0};
  size_t active_helpers_ = 0;
  std::atomic<uint64_t> generation_{0};
  bool in_job_ = false, stop_ = false;
  std::exception_ptr error_;
};

thread_local bool ThreadPool::t_in_task = false;

}  // namespace

void parallel_for(size_t n, size_t grain, int threads,
                  const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t units = (n + grain - 1) / grain;
  const size_t workers = std::min<size_t>(units, static_cast<size_t>(std::max(threads, 1)));
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  // Contiguous, grain-aligned ranges, one per worker.
  const size_t per = (units + workers - 1) / workers;
  const size_t tasks = (units + per - 1) / per;
  ThreadPool::instance().run(tasks, static_cast<int>(workers), [&](size_t w) {
    const size_t begin = std::min(n, w * per * grain);
    const size_t end = std::min(n, (w + 1) * per * grain);
    if (begin < end) fn(begin, end);
  });
}

void parallel_tasks(size_t tasks, int threads, const std::function<void(size_t)>& fn) {
  if (tasks == 0) return;
  const size_t workers = std::min<size_t>(tasks, static_cast<size_t>(std::max(threads, 1)));
  if (workers <= 1) {
    for (size_t t = 0; t < tasks; ++t) fn(t);
    return;
  }
  ThreadPool::instance().run(tasks, static_cast<int>(workers), fn);
}

}  // namespace mantissa
