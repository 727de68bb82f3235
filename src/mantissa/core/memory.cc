#include "mantissa/core/memory.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "mantissa/core/checked.h"
#include "mantissa/core/error.h"

namespace mantissa {

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
#define MANTISSA_X(e, name) \
  case MemoryCategory::e:   \
    return name;
    MANTISSA_MEMORY_CATEGORIES(MANTISSA_X)
#undef MANTISSA_X
  }
  return "?";
}

MemoryTracker::MemoryTracker(std::string device_name) : device_name_(std::move(device_name)) {}

void MemoryTracker::set_budget(std::optional<size_t> bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  budget_ = bytes;
}

std::optional<size_t> MemoryTracker::budget() const {
  std::lock_guard<std::mutex> lock(mu_);
  return budget_;
}

void MemoryTracker::on_allocate(size_t bytes, MemoryCategory category, std::string_view owner) {
  std::lock_guard<std::mutex> lock(mu_);
  if (budget_ && (bytes > *budget_ || stats_.current_total > *budget_ - bytes))
    throw OutOfMemoryError(oom_report(bytes, category, owner),
                           "raise the memory budget, lower the batch size, or store "
                           "more in 16-bit precision",
                           /*over_budget=*/true);
  const size_t c = static_cast<size_t>(category);
  stats_.current[c] += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.current[c]);
  stats_.current_total += bytes;
  if (stats_.current_total > stats_.peak_total) {
    stats_.peak_total = stats_.current_total;
    stats_.at_peak_total = stats_.current;
  }
  ++stats_.allocations;
  ++stats_.live_allocations;
  by_owner_[std::string(owner.empty() ? "(unnamed)" : owner)] += bytes;
  if (recording_) record(static_cast<int64_t>(bytes), category, owner);
}

void MemoryTracker::record(int64_t delta, MemoryCategory category, std::string_view owner) {
  events_.push_back({delta, category, std::string(owner.empty() ? "(unnamed)" : owner),
                     stats_.current, stats_.current_total, phase_, current_module_path()});
}

void MemoryTracker::start_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
  recording_ = true;
}

std::vector<MemoryEvent> MemoryTracker::stop_recording() {
  std::lock_guard<std::mutex> lock(mu_);
  recording_ = false;
  return std::move(events_);
}

void MemoryTracker::set_phase(std::string phase) {
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = std::move(phase);
}

namespace {
std::mutex g_layers_mu;
std::set<std::string>& layer_names() {
  static std::set<std::string> names;
  return names;
}
}  // namespace

void register_layer_name(const std::string& path) {
  if (path.empty()) return;
  std::lock_guard<std::mutex> lock(g_layers_mu);
  layer_names().insert(path);
}

std::string layer_of_owner(const std::string& owner) {
  if (owner.empty() || owner == "(unnamed)") return "(top level)";
  std::lock_guard<std::mutex> lock(g_layers_mu);
  const std::set<std::string>& names = layer_names();
  std::string p = owner;
  for (;;) {
    if (names.count(p)) return p;
    const size_t dot = p.rfind('.');
    if (dot == std::string::npos) return owner;
    p.resize(dot);
  }
}

namespace {
thread_local const std::string* t_module_path = nullptr;
const std::string kNoModule;
}  // namespace

const std::string& current_module_path() { return t_module_path ? *t_module_path : kNoModule; }
ModulePathScope::ModulePathScope(const std::string* path) : previous_(t_module_path) {
  t_module_path = path;
}
ModulePathScope::~ModulePathScope() { t_module_path = previous_; }

void MemoryTracker::on_free(size_t bytes, MemoryCategory category, std::string_view owner) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t c = static_cast<size_t>(category);
  stats_.current[c] -= std::min(bytes, stats_.current[c]);
  stats_.current_total -= std::min(bytes, stats_.current_total);
  if (stats_.live_allocations > 0) --stats_.live_allocations;
  auto it = by_owner_.find(std::string(owner.empty() ? "(unnamed)" : owner));
  if (it != by_owner_.end()) {
    it->second -= std::min(bytes, it->second);
    if (it->second == 0) by_owner_.erase(it);
  }
  if (recording_) record(-static_cast<int64_t>(bytes), category, owner);
}

MemoryStats MemoryTracker::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak = stats_.current;
  stats_.peak_total = stats_.current_total;
  stats_.at_peak_total = stats_.current;
}

namespace {
std::vector<std::pair<std::string, size_t>> top_owners(
    const std::unordered_map<std::string, size_t>& by_owner, size_t k) {
  std::vector<std::pair<std::string, size_t>> v(by_owner.begin(), by_owner.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  if (v.size() > k) v.resize(k);
  return v;
}
}  // namespace

std::vector<std::pair<std::string, size_t>> MemoryTracker::largest_owners(size_t k) const {
  std::lock_guard<std::mutex> lock(mu_);
  return top_owners(by_owner_, k);
}

std::string MemoryTracker::report() const {
  const MemoryStats s = stats();
  std::ostringstream out;
  char line[128];
  std::snprintf(line, sizeof line, "%-16s %14s %14s\n", "category", "current", "peak");
  out << line;
  for (MemoryCategory c : kAllMemoryCategories) {
    std::snprintf(line, sizeof line, "%-16s %14s %14s\n",
                  std::string(memory_category_name(c)).c_str(),
                  format_bytes(s.current_of(c)).c_str(), format_bytes(s.peak_of(c)).c_str());
    out << line;
  }
  std::snprintf(line, sizeof line, "%-16s %14s %14s\n", "total",
                format_bytes(s.current_total).c_str(), format_bytes(s.peak_total).c_str());
  out << line;
  return out.str();
}

// Called with mu_ held.
std::string MemoryTracker::oom_report(size_t bytes, MemoryCategory category,
                                      std::string_view owner) const {
  std::ostringstream out;
  out << "out of memory on " << device_name_ << ": cannot allocate " << format_bytes(bytes)
      << " for " << memory_category_name(category);
  if (!owner.empty()) out << " ('" << owner << "')";
  out << "; " << format_bytes(stats_.current_total) << " of the " << format_bytes(*budget_)
      << " budget is in use, " << format_bytes(*budget_ - std::min(*budget_, stats_.current_total))
      << " free.\n  held by category:";
  std::vector<std::pair<MemoryCategory, size_t>> cats;
  for (MemoryCategory c : kAllMemoryCategories)
    if (stats_.current_of(c) > 0) cats.emplace_back(c, stats_.current_of(c));
  std::sort(cats.begin(), cats.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  if (cats.empty()) out << " nothing";
  for (const auto& [c, b] : cats)
    out << "\n    " << memory_category_name(c) << ": " << format_bytes(b);
  const auto owners = top_owners(by_owner_, 5);
  if (!owners.empty()) {
    out << "\n  largest holders:";
    for (const auto& [name, b] : owners) out << "\n    " << name << ": " << format_bytes(b);
  }
  std::unordered_map<std::string, size_t> by_layer;
  for (const auto& [name, b] : by_owner_) by_layer[layer_of_owner(name)] += b;
  const auto layers = top_owners(by_layer, 5);
  if (!layers.empty()) {
    out << "\n  largest holders by layer (parameters, their gradients and state, activations):";
    for (const auto& [name, b] : layers) out << "\n    " << name << ": " << format_bytes(b);
  }
  return out.str();
}

MemoryTracker& default_memory_tracker() {
  static MemoryTracker tracker("cpu");
  return tracker;
}

MemoryTracker& host_memory_tracker() {
  static MemoryTracker tracker("host");
  return tracker;
}

std::string format_bytes(size_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  int u = -1;
  while (v >= 1024.0 && u < 3) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

std::optional<size_t> parse_bytes(std::string_view text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  const size_t num_start = i;
  bool seen_digit = false, seen_dot = false;
  for (; i < text.size(); ++i) {
    const char ch = text[i];
    if (std::isdigit(static_cast<unsigned char>(ch))) {
      seen_digit = true;
    } else if (ch == '.' && !seen_dot) {
      seen_dot = true;
    } else {
      break;
    }
  }
  if (!seen_digit) return std::nullopt;
  // from_chars: no locale, no exception for a number too large for a double (a long digit run).
  double value = 0;
  const char* const first = text.data() + num_start;
  const auto [end, ec] = std::from_chars(first, text.data() + i, value);
  if (ec != std::errc() || end != text.data() + i) return std::nullopt;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string unit(text.substr(i));
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  double mult;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "kib" || unit == "k")
    mult = 1024.0;
  else if (unit == "mib" || unit == "m")
    mult = 1024.0 * 1024;
  else if (unit == "gib" || unit == "g")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "tib" || unit == "t")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else
    return std::nullopt;
  return checked_cast_from_double<size_t>(std::round(value * mult));
}

}  // namespace mantissa
