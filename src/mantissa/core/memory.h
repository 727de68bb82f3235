// Memory accounting. Every byte a tensor holds is charged to a category (parameters, gradients,
// optimizer state, master weights, activations, workspace, input data) and to an owner label (a
// module path such as "layer1.0.conv1", or a buffer name). The tracker keeps current and peak bytes
// per category and in total, and enforces an optional budget: an allocation that would pass it
// throws OutOfMemoryError with a report of the request and the largest holders, so a user can
// reproduce "out of memory in FP32, fits in FP16" on any machine.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mantissa {

// X(enumerator, name); the order is the order of every report.
#define MANTISSA_MEMORY_CATEGORIES(X)   \
  X(parameters, "parameters")           \
  X(gradients, "gradients")             \
  X(optimizer_state, "optimizer_state") \
  X(master_weights, "master_weights")   \
  X(activations, "activations")         \
  X(workspace, "workspace")             \
  X(input_data, "input_data")

enum class MemoryCategory : uint8_t {
#define MANTISSA_X(e, name) e,
  MANTISSA_MEMORY_CATEGORIES(MANTISSA_X)
#undef MANTISSA_X
};
inline constexpr int kNumMemoryCategories = 0
#define MANTISSA_X(e, name) +1
    MANTISSA_MEMORY_CATEGORIES(MANTISSA_X)
#undef MANTISSA_X
    ;
inline constexpr MemoryCategory kAllMemoryCategories[] = {
#define MANTISSA_X(e, name) MemoryCategory::e,
    MANTISSA_MEMORY_CATEGORIES(MANTISSA_X)
#undef MANTISSA_X
};
std::string_view memory_category_name(MemoryCategory c);

struct MemoryStats {
  std::array<size_t, kNumMemoryCategories> current{};
  std::array<size_t, kNumMemoryCategories> peak{};  // each category's own high-water mark
  size_t current_total = 0;
  size_t peak_total = 0;  // high-water mark of the sum (not the sum of the peaks)
  // Bytes per category at the moment the total peaked.
  std::array<size_t, kNumMemoryCategories> at_peak_total{};
  size_t allocations = 0;  // number of allocations so far
  size_t live_allocations = 0;

  size_t current_of(MemoryCategory c) const { return current[static_cast<size_t>(c)]; }
  size_t peak_of(MemoryCategory c) const { return peak[static_cast<size_t>(c)]; }
};

// One allocation or free, as recorded between start_recording() and stop_recording(): the
// liveness of one training step.
struct MemoryEvent {
  int64_t delta = 0;  // + allocated, - freed
  MemoryCategory category = MemoryCategory::workspace;
  std::string owner;
  std::array<size_t, kNumMemoryCategories> current{};  // after the event
  size_t total = 0;                                    // after the event
  std::string phase;                                   // set_phase()'s label at the time
  std::string module;  // the module running on the recording thread (current_module_path())
};

class MemoryTracker {
 public:
  explicit MemoryTracker(std::string device_name = "cpu");
  MemoryTracker(const MemoryTracker&) = delete;
  MemoryTracker& operator=(const MemoryTracker&) = delete;

  // Limit on the total bytes held at once; std::nullopt for none.
  void set_budget(std::optional<size_t> bytes);
  std::optional<size_t> budget() const;

  // Charges an allocation. Over budget: throws OutOfMemoryError and records nothing.
  void on_allocate(size_t bytes, MemoryCategory category, std::string_view owner);
  void on_free(size_t bytes, MemoryCategory category, std::string_view owner);

  MemoryStats stats() const;
  // Starts a new measurement: peaks become the current values.
  void reset_peaks();
  // Owners holding the most bytes now, largest first (at most k).
  std::vector<std::pair<std::string, size_t>> largest_owners(size_t k) const;
  // A table of current and peak bytes by category.
  std::string report() const;

  // Liveness: every allocation and free from start_recording() on, with the phase label of the
  // moment ("forward", "backward", "optimizer": the trainer sets them).
  void start_recording();
  std::vector<MemoryEvent> stop_recording();
  void set_phase(std::string phase);
  const std::string& device_name() const { return device_name_; }

 private:
  std::string oom_report(size_t bytes, MemoryCategory category, std::string_view owner) const;
  void record(int64_t delta, MemoryCategory category, std::string_view owner);  // mu_ held

  mutable std::mutex mu_;
  std::string device_name_;
  std::optional<size_t> budget_;
  MemoryStats stats_;
  std::unordered_map<std::string, size_t> by_owner_;
  bool recording_ = false;
  std::vector<MemoryEvent> events_;
  std::string phase_;
};

// Layers that memory reports group owners under: nn::Module registers its path, so
// "layer1.0.conv1" holds "layer1.0.conv1.weight", its ".exp_avg" and its activations. Returns
// the longest registered path that the owner equals or starts with (at a '.'), "(top level)" for
// an unnamed owner, and the owner itself otherwise ("gemm packing").
void register_layer_name(const std::string& path);
std::string layer_of_owner(const std::string& owner);

// The owner label of allocations that name none: the module whose forward (or backward) runs on
// this thread, "layer1.0.conv1" ("" outside modules). nn::Module and the autograd engine set it.
const std::string& current_module_path();
class ModulePathScope {
 public:
  explicit ModulePathScope(const std::string* path);
  ~ModulePathScope();
  ModulePathScope(const ModulePathScope&) = delete;
  ModulePathScope& operator=(const ModulePathScope&) = delete;

 private:
  const std::string* previous_;
};

// The tracker of the CPU device, which tensors use unless told otherwise.
MemoryTracker& default_memory_tracker();
// Host memory that a device would not hold: whole datasets, which a loader streams to the device
// batch by batch (the batches are the device's input_data). Never budgeted.
MemoryTracker& host_memory_tracker();

// "0 B", "512 B", "1.50 KiB", "12.00 MiB", "1.25 GiB".
std::string format_bytes(size_t bytes);
// "1000", "1000B", "512KiB", "512MiB", "1.5GiB", "2GB" (decimal units: kB, MB, GB; binary: KiB,
// MiB, GiB; case-insensitive, spaces allowed before the unit), rounded to a whole byte.
// std::nullopt if malformed (a sign, an exponent, an unknown unit, anything after the unit) or if
// the size does not fit in size_t.
std::optional<size_t> parse_bytes(std::string_view text);

}  // namespace mantissa
