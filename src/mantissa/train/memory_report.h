// `mantissa memory`: what one training step holds, without a training run. The step runs once
// on synthetic data of the model's shape with every allocation recorded, so the figures are the
// engine's own (not an estimate): the peak by category and by layer, each category's own peak,
// and the liveness of the step (memory after every allocation and free, by phase). Two
// precisions side by side give the PopTorch seed's FP32-against-FP16 comparison; a budget says
// whether each fits. Written as text, JSON, and a self-contained HTML page with SVG charts.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/core/memory.h"
#include "mantissa/train/trainer.h"

namespace mantissa::train {

using CategoryBytes = std::array<size_t, kNumMemoryCategories>;

struct LayerMemory {
  std::string layer;  // a module path, or what else held memory ("(top level)", "gemm packing")
  CategoryBytes bytes{};
  size_t total = 0;
};

// Memory of the step at one moment of its liveness.
struct MemoryPoint {
  size_t event = 0;  // index in the step's allocations and frees
  std::string phase;
  CategoryBytes bytes{};
  size_t total = 0;
};

struct StepMemory {
  std::string precision;    // the mode's name
  std::string description;  // its settings
  size_t peak_total = 0;
  CategoryBytes at_peak{};            // what the peak was made of
  CategoryBytes category_peaks{};     // each category's own high-water mark
  std::vector<LayerMemory> layers;    // at the peak, largest first
  std::vector<MemoryPoint> timeline;  // at most ~1000 points, the peak among them
  size_t events = 0;                  // allocations and frees recorded
  std::optional<size_t> budget;
  bool fits = true;
  std::string oom_report;  // when it does not fit: the out-of-memory report
};

// One training step of `c` (its model, batch size, precision and levers; the dataset is made
// synthetic, one optimizer step, no evaluation, nothing written), measured. With a memory
// budget, a step that passes it is reported as not fitting, with the out-of-memory report, and
// with the figures of the whole step measured again without the budget (what it needs).
StepMemory profile_step(TrainConfig c);

// Text table (by category, then the largest layers), JSON, and HTML page of one or more runs of
// the same model (e.g. 32-true against 16-true).
std::string memory_text(const std::vector<StepMemory>& runs, size_t top_layers = 12);
std::string memory_json(const TrainConfig& c, const std::vector<StepMemory>& runs);
std::string memory_html(const TrainConfig& c, const std::vector<StepMemory>& runs);

}  // namespace mantissa::train
