// The precision of a training run in one place, from the user's choices to the model:
//   PrecisionChoices    what the user asked for, as given (names as strings: the command line's
//                       precision flags; train::TrainConfig holds them);
//   resolve_precision() checks the choices and builds PrecisionSettings, once: the named mode
//                       (precision.h) with every flag that overrides it applied, the op lists read;
//   apply_precision()   applies the settings to a model and its optimizer (dtypes of parameters
//                       and gradients, per-module precision, master weights, state types,
//                       stochastic rounding);
//   ForwardPrecision    the op context of each forward pass (automatic casting, partials,
//                       stochastic op outputs, FP8 matrix ops).
// docs/mixed_precision.md describes every setting.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/fp8.h"
#include "mantissa/amp/loss_scaler.h"
#include "mantissa/amp/precision.h"
#include "mantissa/nn/module.h"
#include "mantissa/ops/autocast.h"
#include "mantissa/optim/optim.h"

namespace mantissa::amp {

struct PrecisionChoices {
  std::string precision = "32-true";      // a name of precision_names()
  std::string half_type;                  // fp16 | bf16 for the modes whose name does not fix it
  std::vector<std::string> keep_fp32;     // module paths run in FP32
  std::vector<std::string> half_modules;  // module paths run in the mode's 16-bit type
  std::string autocast_lower_list, autocast_fp32_list;  // op-list files replacing the defaults
  std::string loss_scaling;  // "" (the mode's), none, dynamic, or a static scale
  // Options of a dynamic scale (a static one is the value of loss_scaling). Set with no loss
  // scaling, or with a static scale, they are refused: they would change nothing.
  std::optional<double> loss_scale_min, loss_scale_max, loss_scale_init;
  // A numerics report (the JSON --numerics-report writes): its suggested loss scale is the initial
  // scale (`--loss-scale-init from:FILE`); an alternative to loss_scale_init.
  std::string loss_scale_init_report;
  int64_t loss_scale_growth_interval = 2000;
  int64_t loss_scale_hysteresis = 1;
  // Optimizer writes of 16-bit parameters and state; refused when the run has none to round.
  bool stochastic_rounding = false;
  bool stochastic_outputs = false;  // every 16-bit op output (forward)
  // Kahan-compensated updates of the 16-bit parameters (Optimizer::enable_kahan): modes whose
  // parameters are 16-bit and that keep no FP32 master weights; not with stochastic_rounding.
  bool kahan = false;
  std::string partials = "fp32";  // accumulation of matmul and convolution: fp32 | fp16
  std::string accum_type, first_moment_type, second_moment_type;  // "": the mode's default
  // The FP8 modes' recipe (amp/fp8.h; Transformer Engine's DelayedScaling defaults).
  std::string fp8_scaling = "delayed";  // delayed | current
  int64_t fp8_amax_history = 1024;
  std::string fp8_amax_algo = "max";  // max | most-recent
  int64_t fp8_margin = 0;
  std::vector<std::string> fp8_keep_layers = {"first", "last"};  // first, last, none, paths
};

struct PrecisionSettings {
  // The named mode: the 16-bit type, parameter and input dtypes, automatic casting, master
  // weights, the FP32 loss, O2's FP32 normalization layers. Its loss_scaling and state types are
  // the mode's defaults; the fields below hold what applies.
  PrecisionMode mode;
  kernels::Partials partials = kernels::Partials::kF32;
  std::optional<DType> grad_dtype;  // the type gradients are held in (nullopt: the parameter's)
  optim::StateTypes state_types;
  std::optional<LossScalerOptions> loss_scaling;  // nullopt: no loss scaling
  std::string loss_scale_init_report;             // where the initial scale came from, if a report
  // Seeds of stochastic rounding: of the optimizer's 16-bit writes, and of 16-bit op outputs.
  std::optional<uint64_t> stochastic_rounding_seed, stochastic_outputs_seed;
  bool kahan = false;                                   // Kahan-compensated 16-bit parameters
  std::vector<std::string> keep_fp32, half_modules;     // module paths
  ops::AutocastPolicy policy;                           // the op lists of automatic casting
  std::string autocast_lower_list, autocast_fp32_list;  // the files they came from ("": default)
  std::optional<Fp8Recipe> fp8;                         // the FP8 modes' recipe

  // The line the trainer prints when it starts: the mode's settings with the overrides, e.g.
  // "precision 16-mixed: parameters f32, ..., optimizer state f32/f32, partials fp32", then each
  // further override that is set (gradient type, stochastic rounding, module overrides, op-list
  // files, ...). Checkpoints record it: a resume must match it.
  std::string describe() const;
  // The model's output as the loss takes it: cast to FP32 when the mode computes the loss in
  // FP32 (O2), as it is otherwise.
  Tensor loss_input(const Tensor& output) const;
};

// Checks the choices (unknown names, files that cannot be read, settings that contradict each
// other, and settings that would change nothing under the others: loss-scale options without a
// dynamic scale, stochastic rounding with nothing 16-bit to round, op lists or module overrides
// that the mode leaves without effect) and resolves them; throws mantissa::Error naming the flag,
// the conflict and the fix. `seed` is the run's: the streams of stochastic rounding derive from it.
PrecisionSettings resolve_precision(const PrecisionChoices& choices, uint64_t seed);

// Applies the settings to a model and the optimizer of its parameters, before the first step:
// the parameters are cast to the mode's type (O2: they stay FP32 and are marked to be read as
// 16-bit, with 16-bit gradients, except the normalization layers'; the log-softmax runs in FP32),
// the per-module overrides set (keep_fp32 last: it wins, read as stored), gradients
// held in grad_dtype, then the optimizer's state types, its FP32 master copies (made from the
// parameters' current values, so after any initial weights are loaded), stochastic rounding and
// Kahan compensation.
// Throws naming an unknown module path.
void apply_precision(const PrecisionSettings& s, nn::Module& model, optim::Optimizer& optimizer);

// The op context of one forward pass under the settings, while alive: the partials, automatic
// casting to the mode's 16-bit type (when the mode casts; `log` may be null), O2's parameters
// read as 16-bit (ops::ReadAsScope), stochastic rounding of 16-bit op outputs (when on) from
// stream `stochastic_stream` of its seed, and the FP8 matrix ops of an FP8 mode, scaled by `fp8`
// (required then; made by the run after apply_precision: Fp8State(*s.fp8, model)).
//
// An evaluation pass (the ForwardPrecision::kEvaluation constructor) computes what a training
// pass computes but for its rounding of op outputs, which is to nearest (an evaluation gives the
// same figures each time); an FP8 mode's matrix ops run in FP8 with `fp8`'s scales (usually an
// Fp8Frozen: the training's scales, unchanged by evaluating) or, without `fp8`, in the mode's
// 16-bit type.
class ForwardPrecision {
 public:
  ForwardPrecision(const PrecisionSettings& s, ops::AutocastLog* log, uint64_t stochastic_stream,
                   ops::Fp8Provider* fp8 = nullptr);
  enum Evaluation { kEvaluation };
  ForwardPrecision(Evaluation, const PrecisionSettings& s, ops::Fp8Provider* fp8 = nullptr);
  ForwardPrecision(const ForwardPrecision&) = delete;
  ForwardPrecision& operator=(const ForwardPrecision&) = delete;

 private:
  ops::PartialsScope partials_;
  std::optional<ops::AutocastScope> autocast_;
  std::optional<ops::ReadAsScope> read_as_;
  std::optional<ops::StochasticOutputsScope> stochastic_;
  std::optional<ops::Fp8Scope> fp8_;
};

}  // namespace mantissa::amp
