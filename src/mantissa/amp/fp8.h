// FP8 training with per-tensor scaling, as NVIDIA's Transformer Engine does it (the fp8-hybrid
// and fp8-e4m3 modes of precision.h; docs/mixed_precision.md, "FP8 training"):
//   Fp8Recipe     the recipe: formats, delayed or current scaling, the amax history, its
//                 algorithm, the margin, the layers kept in the 16-bit type. One source of truth:
//                 PrecisionSettings::fp8 holds it.
//   Fp8State      the scaling state of a model: for every module whose linear or conv2d runs in
//                 FP8, three tensors (its input, weight and output gradient), each with its FP32
//                 scale and amax history. The ops read the scales through ops::Fp8Scope; the
//                 trainer ends each step with end_step(), saves and restores the state with the
//                 checkpoint, and reports it.
// The delayed recipe, per tensor: a step quantizes with the scale of the step before and records
// the tensor's actual amax in slot 0 of the history (the largest over the step's quantizations:
// micro-batches, recomputation); at the step's end the amax is taken from the history (its
// maximum, or slot 0 for most-recent), the scale becomes (format max / amax) / 2^margin when that
// amax is finite and positive (and the scale finite), and the history rolls: every slot moves
// down one, the oldest leaves, slot 0 is cleared for the next step.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/core/dtype.h"
#include "mantissa/kernels/quantize.h"
#include "mantissa/ops/autocast.h"

namespace mantissa::comm {
class Communicator;
}
namespace mantissa::nn {
class Module;
class NumericsRecorder;
}  // namespace mantissa::nn

namespace mantissa::amp {

enum class Fp8Scaling : uint8_t { kDelayed, kCurrent };
enum class Fp8AmaxAlgo : uint8_t { kMax, kMostRecent };

struct Fp8Recipe {
  DType forward = DType::e4m3;   // activations and weights
  DType backward = DType::e5m2;  // output gradients (fp8-hybrid; fp8-e4m3: e4m3)
  Fp8Scaling scaling = Fp8Scaling::kDelayed;
  int64_t amax_history = 1024;  // steps of amax kept
  Fp8AmaxAlgo amax_algo = Fp8AmaxAlgo::kMax;
  int margin = 0;  // scale = (format max / amax) / 2^margin
  // Modules whose matrix ops stay in the 16-bit type: "first" and "last" (the first and the last
  // Conv2d or Linear layer in registration order) and dotted module paths (a path keeps its
  // whole subtree).
  std::vector<std::string> keep = {"first", "last"};

  // "e4m3 forward, e5m2 gradients, delayed scaling (amax history 1024, max, margin 0), kept in
  // bf16: first, last"
  std::string describe() const;
};

// The FP8 flags as given (amp::PrecisionChoices holds them), checked and made a recipe for a mode
// whose gradients are in `backward`. Throws mantissa::Error naming the flag.
Fp8Recipe make_fp8_recipe(DType backward, const std::string& scaling, int64_t amax_history,
                          const std::string& amax_algo, int64_t margin,
                          const std::vector<std::string>& keep);
const char* fp8_scaling_name(Fp8Scaling s);
const char* fp8_amax_algo_name(Fp8AmaxAlgo a);

// The delayed recipe's two rules, alone (the tests check them against their definitions):
// the amax a history gives (max: the largest slot, NaN if a slot is NaN; most-recent: slot 0),
// and the scale that follows from an amax: (fmax / amax) / 2^margin in FP32, or `previous` when
// amax is not finite and positive or that scale would not be finite.
float fp8_history_amax(const std::vector<float>& history, Fp8AmaxAlgo algo);
float fp8_scale_for(float amax, float fmax, int margin, float previous);

// What a run reports for one scaled tensor (--metrics-json's "fp8").
struct Fp8TensorReport {
  std::string name;  // "conv2.input", "conv2.weight", "conv2.grad_output"
  DType format;
  float scale = 1;  // the scale the next step quantizes with
  float amax = 0;   // the last step's amax
  // Of the values the last step quantized: how many, and the fractions that saturated and
  // flushed to zero.
  int64_t count = 0;
  double saturated = 0, flushed = 0;
};

// One scaled tensor's state (an ops::Fp8Tensor: the FP8 path of linear and conv2d reads its
// scale and records what it quantized).
class Fp8TensorState : public ops::Fp8Tensor {
 public:
  Fp8TensorState(const Fp8Recipe& recipe, DType format);  // keeps a copy of the recipe
  DType format() const override { return format_; }
  bool needs_amax() const override;
  float scale(float amax) const override;
  void record(const kernels::QuantizeStats& stats, float scale) override;

  // The step's end: the delayed recipe's update and the history's roll; the step's statistics
  // become the last step's.
  void end_step();

  float current_scale() const { return scale_; }
  const std::vector<float>& history() const { return history_; }  // slot 0: this step's amax
  const kernels::QuantizeStats& step_stats() const { return step_; }
  const kernels::QuantizeStats& last_step_stats() const { return last_; }
  float last_scale_used() const { return last_used_; }
  // Restores a checkpoint's state (history of the recipe's length).
  void restore(float scale, std::vector<float> history);
  // This step's amax as reduced across ranks (Fp8State::reduce_amax).
  void set_step_amax(float amax) { history_[0] = amax; }

 private:
  Fp8Recipe recipe_;
  DType format_;
  float fmax_;
  float scale_ = 1;  // Transformer Engine starts every scale at 1
  std::vector<float> history_;
  kernels::QuantizeStats step_, last_;
  float used_ = 1, last_used_ = 1;  // the scale the step quantized with (current scaling: the last)
};

class Fp8State : public ops::Fp8Provider {
 public:
  // The state of `model`'s FP8 tensors under `recipe`, made after the
  // precision is applied (amp::apply_precision): a Conv2d or Linear layer runs in FP8 unless the
  // recipe keeps it or it has a precision of its own (--keep-fp32, --half-modules: automatic
  // casting is off inside it). Other modules that call linear or conv2d get their state on first
  // use. Throws naming a kept path that is not a module of the model.
  Fp8State(const Fp8Recipe& recipe, nn::Module& model);

  std::optional<ops::Fp8OpScaling> scaling(const std::string& module_path) override;

  // Data parallelism: every rank's amaxes of this step MAX-reduced over `group`, so that every
  // rank updates to the same scales. Call it on every rank after the step's last backward pass
  // and before end_step(). One all-reduce of one FP32 value per tensor, in name order.
  void reduce_amax(comm::Communicator& group);
  // The step's end (after the optimizer's update): every tensor's scale updated and history
  // rolled. `numerics` (may be null) records each tensor's amax and scale of step `step`.
  void end_step(int64_t step, nn::NumericsRecorder* numerics = nullptr);

  const Fp8Recipe& recipe() const { return recipe_; }
  // The modules whose matrix ops stay in the 16-bit type, as resolved ("first" -> "conv1").
  const std::vector<std::string>& kept() const { return kept_; }
  // The tensors by name ("conv2.input"), in name order.
  const std::map<std::string, std::shared_ptr<Fp8TensorState>>& tensors() const { return tensors_; }
  std::vector<Fp8TensorReport> report() const;

  // Checkpoints: the recipe and every tensor's scale and history, FP32 values kept as their bit
  // patterns (exact, infinities included). load_json checks that the recipe is this run's and
  // throws naming the flag that differs, or `source` when the text is damaged.
  std::string to_json() const;
  void load_json(const std::string& text, const std::string& source);

 private:
  bool is_kept(const std::string& module_path) const;
  ops::Fp8OpScaling add(const std::string& module_path);

  Fp8Recipe recipe_;
  std::vector<std::string> kept_;
  std::map<std::string, std::shared_ptr<Fp8TensorState>> tensors_;
  std::map<std::string, ops::Fp8OpScaling> modules_;
};

// The scales of an Fp8State, read and never changed: evaluation runs the matrix ops in FP8 as
// training does, with the scales training left (current scaling: from each tensor's own amax),
// and records no amax or statistic, so evaluating between steps leaves the training unchanged.
class Fp8Frozen : public ops::Fp8Provider {
 public:
  explicit Fp8Frozen(Fp8State& state) : state_(state) {}  // `state` outlives this
  std::optional<ops::Fp8OpScaling> scaling(const std::string& module_path) override;

 private:
  Fp8State& state_;
  std::map<std::string, ops::Fp8OpScaling> modules_;
};

}  // namespace mantissa::amp
