// Wall-clock time of a training step by phase, module and op: what `mantissa train --profile`
// prints (PyTorch's profiler table, PopVision's execution trace in one line per op). A Profiler
// is made active for the calling thread with ProfilerScope; ProfileTimer adds the time of its
// own lifetime to the active profiler, and costs one thread-local read when none is active.
// Timers nest: an outer row's time includes the rows timed inside it, and the report says which
// rows are inclusive (the step, the phases) and which are leaves (ops, layers).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace mantissa {

struct ProfileRow {
  std::string phase;  // "forward", "backward", "optimizer", "step", ...
  std::string where;  // module path ("conv1"), "" outside modules
  std::string op;     // layer type or op name ("Conv2d", "conv2d", "adamw")
  int64_t calls = 0;
  double seconds = 0;
};

class Profiler {
 public:
  void add(std::string_view phase, std::string_view where, std::string_view op, double seconds);
  // In the order the rows were first seen (a forward pass, then its backward, ...).
  const std::vector<ProfileRow>& rows() const { return rows_; }
  void clear();

 private:
  std::vector<ProfileRow> rows_;
  std::unordered_map<std::string, size_t> index_;  // phase \x1f where \x1f op -> row
};

// The calling thread's active profiler, or null.
Profiler* active_profiler();

// Makes `p` (may be null) the calling thread's active profiler for the scope.
class ProfilerScope {
 public:
  explicit ProfilerScope(Profiler* p);
  ~ProfilerScope();
  ProfilerScope(const ProfilerScope&) = delete;
  ProfilerScope& operator=(const ProfilerScope&) = delete;

 private:
  Profiler* previous_;
};

// Adds its lifetime to the active profiler's row (phase, where, op). The strings are read when
// the timer ends; they must outlive it.
class ProfileTimer {
 public:
  ProfileTimer(std::string_view phase, std::string_view where, std::string_view op)
      : profiler_(active_profiler()), phase_(phase), where_(where), op_(op) {
    if (profiler_) start_ = std::chrono::steady_clock::now();
  }
  ~ProfileTimer() {
    if (profiler_)
      profiler_->add(
          phase_, where_, op_,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  ProfileTimer(const ProfileTimer&) = delete;
  ProfileTimer& operator=(const ProfileTimer&) = delete;

 private:
  Profiler* profiler_;
  std::string_view phase_, where_, op_;
  std::chrono::steady_clock::time_point start_;
};

// Multiply-adds of the matrix ops' forwards (kMatrix in ops/op_table.h), counted for the calling
// thread while a MacCounter is active: the model cost that training speed is compared with (a
// trained image costs about 3x its forward's multiply-adds, 2 FLOPs each). Counters nest; each op
// adds to the innermost one only. Costs one thread-local read when none is active.
class MacCounter {
 public:
  MacCounter();
  ~MacCounter();
  MacCounter(const MacCounter&) = delete;
  MacCounter& operator=(const MacCounter&) = delete;
  int64_t macs() const { return macs_; }

 private:
  friend void count_macs(int64_t n);
  int64_t macs_ = 0;
  MacCounter* previous_;
};

// Adds n multiply-adds to the calling thread's innermost MacCounter, if any.
void count_macs(int64_t n);

}  // namespace mantissa
