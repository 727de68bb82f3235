#include "mantissa/core/parallel.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace mantissa {

int default_num_threads() {
  if (const char* env = std::getenv("MANTISSA_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : static_cast<int>(hw);
}

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
  std::exception_ptr error;
  std::mutex error_mutex;
  auto run = [&](size_t w) {
    const size_t begin = std::min(n, w * per * grain);
    const size_t end = std::min(n, (w + 1) * per * grain);
    if (begin >= end) return;
    try {
      fn(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  for (size_t w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace mantissa
