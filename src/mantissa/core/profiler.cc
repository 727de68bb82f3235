#include "mantissa/core/profiler.h"

namespace mantissa {

namespace {
thread_local Profiler* t_profiler = nullptr;
thread_local MacCounter* t_macs = nullptr;
}  // namespace

void Profiler::add(std::string_view phase, std::string_view where, std::string_view op,
                   double seconds) {
  std::string key;
  key.reserve(phase.size() + where.size() + op.size() + 2);
  key.append(phase).push_back('\x1f');
  key.append(where).push_back('\x1f');
  key.append(op);
  auto [it, fresh] = index_.try_emplace(std::move(key), rows_.size());
  if (fresh) rows_.push_back({std::string(phase), std::string(where), std::string(op), 0, 0});
  ProfileRow& r = rows_[it->second];
  ++r.calls;
  r.seconds += seconds;
}

void Profiler::clear() {
  rows_.clear();
  index_.clear();
}

Profiler* active_profiler() { return t_profiler; }

ProfilerScope::ProfilerScope(Profiler* p) : previous_(t_profiler) { t_profiler = p; }
ProfilerScope::~ProfilerScope() { t_profiler = previous_; }

MacCounter::MacCounter() : previous_(t_macs) { t_macs = this; }
MacCounter::~MacCounter() { t_macs = previous_; }

void count_macs(int64_t n) {
  if (t_macs) t_macs->macs_ += n;
}

}  // namespace mantissa
