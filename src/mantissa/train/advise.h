// The precision advisor (`mantissa advise`): what a 16-bit precision will break, before training.
// A short FP32 calibration (32-true, the real data, the run's optimizer) records every layer's
// weights, activations and gradients as log2 histograms (nn/numerics.h) and every parameter's
// actual update; from them, for the target precision's 16-bit type, per layer: the fractions that
// would overflow, flush to zero or be subnormal, the updates that would be lost to rounding, and
// the range of loss scales that keeps the gradients representable. Then a recommendation (layers
// to keep in FP32, the loss scaling, FP16 or BF16, compensated or stochastic updates) as a
// TrainConfig and as the command line to run, and optionally a check of it: a few steps with the
// recommendation, with the naive precision and with 32-true from the same start.
//
//   train::AdviseConfig a;
//   a.train.model = "lenet5";
//   a.train.precision = "16-mixed";            // the target
//   train::Advice advice = train::advise(a);
//   train::TrainConfig run = train::recommended_config(a.train, advice.recommendation);
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "mantissa/nn/numerics.h"
#include "mantissa/train/config.h"

namespace mantissa::train {

struct AdviseConfig {
  // The model, data, optimizer, seed and initial weights (init_from) of the calibration and the
  // verification runs; `precision` is the target. The other precision fields must be at their
  // defaults: the advisor chooses them.
  TrainConfig train;
  int64_t steps = 20;  // FP32 calibration steps
  int64_t verify = 0;  // steps of each verification run (0: none)
};

// One leaf module. Fractions are of all values seen over the calibration steps, against the
// target's 16-bit type; gradients (the layer's output gradient and its parameters' gradients) at
// loss scale 1. Layers without parameters have no weights and no updates.
struct LayerAdvice {
  std::string name;  // module path
  std::optional<nn::RangeFractions> weights;
  nn::RangeFractions activations, gradients;
  double activation_max = 0;  // largest |activation| seen
  // Of the parameters' non-zero FP32 updates, the fraction smaller than half an ulp of their
  // weight in the target's parameter storage type (the 16-bit type): with round-to-nearest
  // storage they would not move the weight.
  std::optional<double> updates_lost;
};

struct Recommendation {
  std::string precision;  // the target, or its BF16 counterpart (16-mixed -> bf16-mixed)
  std::string half_type;  // "fp16" or "bf16"
  std::vector<std::string> keep_fp32;
  std::string loss_scaling;          // "dynamic" or "none"
  bool kahan = false;                // compensated 16-bit parameters (--kahan)
  std::vector<std::string> reasons;  // one sentence each, for the printout
  std::string command;               // the `mantissa train` command line to run
  bool clean = false;                // the target as it is needs nothing changed
};

struct Advice {
  std::string precision;          // the target
  std::string half_type;          // its 16-bit type: "fp16" or "bf16"
  bool parameters_16bit = false;  // the target stores parameters in 16 bits without master copy
  int64_t steps = 0;              // calibration steps run
  std::vector<LayerAdvice> layers;
  // Powers of two S from 2^-64 to 2^64: max is the largest with S * max|gradient| finite in the
  // 16-bit type, min the smallest that flushes at most kScaleUnderflowSlack more of the non-zero
  // gradients to zero than max does. nullopt when no scale keeps the gradients finite.
  std::optional<double> loss_scale_min, loss_scale_max;
  // The gradients' fraction of overflow and of non-zero values flushed to zero at S = 2^k,
  // k = kMinScaleExp..kMaxScaleExp (the HTML page's chart).
  std::vector<double> overflow_at_scale, underflow_at_scale;
  Recommendation recommendation;
};

inline constexpr int kMinScaleExp = -64, kMaxScaleExp = 64;
inline constexpr double kScaleUnderflowSlack = 1e-3;
// Outputs or weights that overflow FP16 but not BF16 (or gradients that no loss scale keeps
// finite in FP16) make the recommendation BF16; layers that overflow the chosen type are kept in
// FP32.
// Parameters are compensated (--kahan) when more than this fraction of updates would be lost.
inline constexpr double kUpdatesLostLimit = 0.05;

// Checks the configuration (as train::validate, and the target's name), runs the calibration and
// advises. Throws mantissa::Error naming the bad setting. `progress` (may be null) gets one line
// when the calibration starts.
Advice advise(const AdviseConfig& config, std::ostream* progress = nullptr);

// The recommendation applied to the run `base` describes: precision, half type, keep_fp32, loss
// scaling and --kahan.
TrainConfig recommended_config(const TrainConfig& base, const Recommendation& r);

// The verification: K steps each of 32-true, the recommendation and the naive target, from the
// same initial weights and batches.
struct VerifyRun {
  std::string label;      // "32-true", "recommended", "naive"
  std::string precision;  // as run
  std::vector<float> losses;
  int64_t skipped = 0;  // steps skipped by loss scaling
  std::string failure;  // the error that stopped it ("" when it ran every step)
  // Mean |loss - 32-true's loss| over the steps both ran (NaN when it failed at once).
  double gap = 0;
};
struct Verification {
  std::vector<VerifyRun> runs;  // 32-true, recommended, naive
};
Verification verify(const AdviseConfig& config, const Advice& advice);

// The printout, the JSON (the layout of docs/advise.md) and the self-contained HTML page.
std::string advice_text(const Advice& a, const Verification* v = nullptr);
std::string advice_json(const Advice& a, const Verification* v = nullptr);
std::string advice_html(const AdviseConfig& c, const Advice& a, const Verification* v = nullptr);

}  // namespace mantissa::train
