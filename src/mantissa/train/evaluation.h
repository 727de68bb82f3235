// Evaluation of a classifier on a test split: accuracy and mean loss, in evaluation mode and
// without recording. The trainer evaluates after training; `mantissa eval` evaluates a checkpoint.
#pragma once

#include <cstdint>
#include <string>

#include "mantissa/amp/settings.h"
#include "mantissa/data/loader.h"
#include "mantissa/nn/models.h"

namespace mantissa::train {

struct EvalResult {
  double accuracy = 0;
  int64_t correct = 0;  // correctly classified examples
  int64_t examples = 0;
  double loss = 0;
  std::string model;
};

// Number of rows of `out` (B, classes) whose largest score is at the label (i64 (B)).
int64_t count_correct(const Tensor& out, const Tensor& labels);

// Accuracy and mean loss of `m` over one epoch of `loader`; the model's train/eval mode is
// restored afterwards. With `precision`, each forward is the training's forward under those
// settings (amp::ForwardPrecision's evaluation pass: the same partials, automatic casting and O2
// reading, op outputs rounded to nearest) and the loss takes the output as the mode says (FP32
// for O2); without, as the model's dtypes give. The FP8 modes' matrix ops run in FP8 with `fp8`'s
// scales (amp::Fp8Frozen: the training's scales, unchanged by evaluating); without `fp8` they run
// in the mode's 16-bit type.
EvalResult evaluate_model(nn::Classifier& m, data::Loader& loader,
                          const amp::PrecisionSettings* precision = nullptr,
                          ops::Fp8Provider* fp8 = nullptr);

}  // namespace mantissa::train
