// Precision modes: every name users know (PyTorch Lightning's 32-true / 16-mixed / bf16-mixed /
// 16-true / bf16-true, the Apex and MindSpore levels O0-O3, the IPU guide's input.model forms
// 32.32 / 16.32 / 16.16), and the FP8 modes of Transformer Engine's recipes (fp8-hybrid,
// fp8-e4m3), maps to one explicit set of settings, which the trainer applies and prints.
// docs/mixed_precision.md has the table.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mantissa/amp/loss_scaler.h"
#include "mantissa/core/dtype.h"

namespace mantissa::amp {

struct PrecisionMode {
  std::string name;                // as the user wrote it
  DType half = DType::f16;         // the mode's 16-bit type
  DType param_dtype = DType::f32;  // storage of the model's parameters
  bool keep_norm_fp32 = false;     // O2: normalization layers' parameters read in FP32
  // O2: the FP32 parameters (the masters) are read by the model's ops as their `half` values and
  // their gradients computed and held in `half` (ops::ReadAsScope): the 16-bit model, whose copy
  // is never made. Normalization layers' excepted (keep_norm_fp32).
  bool read_as_half = false;
  bool autocast = false;           // ops cast by the op policy
  bool master_weights = false;     // FP32 copies of 16-bit parameters in the optimizer
  bool fp32_loss = false;          // the model's output cast to FP32 before the loss (O2)
  DType input_dtype = DType::f32;  // the loader's images
  std::optional<LossScalerOptions> loss_scaling;  // the mode's default
  DType first_moment = DType::f32;   // optimizer state defaults (SGD momentum, Adam exp_avg)
  DType second_moment = DType::f32;  // Adam exp_avg_sq
  // The FP8 modes (fp8-hybrid, fp8-e4m3): linear and conv2d take E4M3 inputs and weights and
  // gradients in this format (amp/fp8.h); everything else as bf16-mixed.
  std::optional<DType> fp8_gradients;

  // Whether some of the model's ops compute on 16-bit values: by automatic casting, by O2's
  // reading, or on 16-bit parameters.
  bool computes_in_16_bits() const {
    return autocast || read_as_half || is_16bit_float(param_dtype);
  }

  // One line per setting, printed when training starts.
  std::string describe() const;
};

// The mode named `name`. `half` replaces the 16-bit type of the modes whose name does not fix it
// (O1-O3, 16.32, 16.16); naming bf16 for 16-mixed and the like is an error. Throws listing the
// valid names.
PrecisionMode precision_mode(const std::string& name, std::optional<DType> half = std::nullopt);
std::vector<std::string> precision_names();

// f32, f16 or bf16 by any name parse_dtype() knows ("fp32", "half", "bfloat16", ...); anything
// else throws naming `flag`.
DType parse_float_type(const std::string& text, const std::string& flag);

}  // namespace mantissa::amp
