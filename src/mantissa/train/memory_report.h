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

#include "mantissa/core/dtype.h"
#include "mantissa/core/memory.h"
#include "mantissa/train/trainer.h"

namespace mantissa::train {

using CategoryBytes = std::array<size_t, kNumMemoryCategories>;

struct LayerMemory {
  std::string layer;  // a module path, or what else held memory ("(top level)", "gemm packing")
  CategoryBytes bytes{};
  size_t total = 0;
};

// Memory of the step at one moment of its liveness: after one allocation or free.
struct MemoryPoint {
  size_t event = 0;  // index in the step's allocations and frees
  std::string phase;
  CategoryBytes bytes{};
  size_t total = 0;
  int64_t delta = 0;  // the event's bytes: + allocated, - freed
  MemoryCategory category = MemoryCategory::workspace;
  std::string owner;   // what the memory was charged to ("layer1.0.conv1", "kernel workspace")
  std::string module;  // the module running ("" outside modules: the loader, the optimizer)
};

// A parameter as the step's optimizer holds it: what per-rank memory is computed from.
struct ParamMemory {
  int64_t numel = 0;
  DType dtype = DType::f32;
  bool trained = true;                 // requires grad: in the gradient reducer's buckets
  size_t state_bytes_per_element = 0;  // the optimizer state's buffers (and Kahan's) together
  bool master = false;                 // an FP32 master copy (4 bytes an element)
  // With several ranks (profile_step's `ranks`): a linear weight whose gradient travels as its
  // factors (train::factored_weights): one rank's factors' bytes (0: not factored), and whether
  // the step forms its gradient in parts from them (never stored) rather than whole.
  size_t factor_bytes = 0;
  bool factor_deferred = false;
  int64_t rows = 0;  // a factored weight's rows (out): ZeRO-1 shards it in blocks of them
};

struct StepMemory {
  std::string precision;    // the mode's name
  std::string description;  // its settings
  size_t peak_total = 0;
  CategoryBytes at_peak{};            // what the peak was made of
  CategoryBytes category_peaks{};     // each category's own high-water mark
  std::vector<LayerMemory> layers;    // at the peak, largest first
  std::vector<MemoryPoint> timeline;  // at most ~1000 points, the peak among them
  MemoryPoint peak;                   // the allocation that reached the peak
  size_t events = 0;                  // allocations and frees recorded
  std::optional<size_t> budget;
  bool fits = true;
  std::string oom_report;           // when it does not fit: the out-of-memory report
  std::vector<ParamMemory> params;  // the model's parameters, in registration order
};

// One training step of `c` (its model, batch size, precision and levers; the dataset is made
// synthetic, one optimizer step, no evaluation, nothing written), measured. With a memory
// budget, a step that passes it is reported as not fitting, with the out-of-memory report, and
// with the figures of the whole step measured again without the budget (what it needs). It runs
// in this process alone, whatever launched it.
// With ranks > 1 the step is measured as one rank of that many runs it: every update after the
// backward pass, and the weights that would travel as factors marked (ParamMemory::factor_bytes)
// for rank_memory.
StepMemory profile_step(TrainConfig c, int ranks = 1);
// profile_step for each configuration in turn, each measured from what a fresh process holds: the
// GEMM's per-thread buffers, which an earlier measurement leaves sized for its own step, are
// released before each (`mantissa memory` measures its precisions so; a step measured after
// another in one process would otherwise count the other's buffers as held before it).
std::vector<StepMemory> profile_steps(const std::vector<TrainConfig>& configs, int ranks = 1);

// What one rank of a data-parallel job of `ranks` ranks holds at the step's peak, by category,
// computed (not measured across processes): the step measured in one process at the per-rank
// batch (profile_step with `ranks`, updates after the backward pass, as with several ranks),
// plus the gradient reducer's buckets as Reducer::plan lays them out at the wire type, with the
// weights that travel as factors left out of the buckets, their gathered factors (every rank's)
// added and, where the step forms their gradients in parts, their stored gradients taken off; with
// ZeRO-1 the whole optimizer state and master weights are replaced by the shards the largest rank
// owns (its part of every bucket), and the reduce-scatter's part buffers and the parameters'
// gather buffers (dist::Zero1) are added. These are persistent, so they add to (or come off)
// every moment of the step alike and the peak stays where it was measured.
struct RankMemory {
  int ranks = 1;
  CategoryBytes data_parallel{}, zero{};  // at the peak
  size_t data_parallel_total = 0, zero_total = 0;
  size_t optimizer_state = 0, optimizer_state_zero = 0;  // state and master weights together
};
RankMemory rank_memory(const StepMemory& step, int ranks, double bucket_size_mib, DType wire);

// Text table (by category, then the largest layers), JSON, and HTML page of one or more runs of
// the same model (e.g. 32-true against 16-true). With `ranks` (one per run), the text and JSON
// add each run's per-rank memory with and without ZeRO-1.
std::string memory_text(const std::vector<StepMemory>& runs, size_t top_layers = 12,
                        const std::vector<RankMemory>& ranks = {});
std::string memory_json(const TrainConfig& c, const std::vector<StepMemory>& runs,
                        const std::vector<RankMemory>& ranks = {});
std::string memory_html(const TrainConfig& c, const std::vector<StepMemory>& runs);

}  // namespace mantissa::train
