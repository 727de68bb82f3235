#include "mantissa/amp/settings.h"

#include <algorithm>

#include "mantissa/core/error.h"
#include "mantissa/ops/ops.h"

namespace mantissa::amp {
namespace {

kernels::Partials parse_partials(const std::string& text) {
  if (text == "fp32") return kernels::Partials::kF32;
  if (text == "fp16") return kernels::Partials::kF16;
  throw Error("--partials '" + excerpt(text) + "' is not valid", "use fp32 or fp16");
}

const char* partials_name(kernels::Partials p) {
  return p == kernels::Partials::kF16 ? "fp16" : "fp32";
}

// The mode's loss scaling, or the one --loss-scaling names, with the --loss-scale-* flags applied.
std::optional<LossScalerOptions> loss_scaling_of(const PrecisionChoices& c,
                                                 const PrecisionMode& mode) {
  std::optional<LossScalerOptions> o =
      c.loss_scaling.empty() ? mode.loss_scaling : parse_loss_scaling(c.loss_scaling);
  MANTISSA_CHECK(c.loss_scale_growth_interval > 0, "--loss-scale-growth-interval must be positive",
                 "e.g. 2000");
  MANTISSA_CHECK(c.loss_scale_hysteresis >= 1, "--loss-scale-hysteresis must be at least 1",
                 "1 backs off on every overflow");
  if (o) {
    if (c.loss_scale_init) o->init_scale = *c.loss_scale_init;
    o->min_scale = c.loss_scale_min;
    o->max_scale = c.loss_scale_max;
    o->growth_interval = c.loss_scale_growth_interval;
    o->hysteresis = c.loss_scale_hysteresis;
  }
  return o;
}

// The default op lists, with the lists that --autocast-lower-list / --autocast-fp32-list replace.
ops::AutocastPolicy policy_of(const PrecisionChoices& c) {
  std::optional<std::vector<std::string>> lower, fp32;
  if (!c.autocast_lower_list.empty()) lower = ops::read_op_list(c.autocast_lower_list);
  if (!c.autocast_fp32_list.empty()) fp32 = ops::read_op_list(c.autocast_fp32_list);
  ops::AutocastPolicy policy;
  policy.replace_lists(lower, fp32);
  return policy;
}

// The FP8 modes' recipe from the --fp8-* flags, which only they take.
std::optional<Fp8Recipe> fp8_recipe_of(const PrecisionChoices& c, const PrecisionMode& mode) {
  if (!mode.fp8_gradients) {
    const PrecisionChoices d;
    MANTISSA_CHECK(c.fp8_scaling == d.fp8_scaling && c.fp8_amax_history == d.fp8_amax_history &&
                       c.fp8_amax_algo == d.fp8_amax_algo && c.fp8_margin == d.fp8_margin &&
                       c.fp8_keep_layers == d.fp8_keep_layers,
                   "the --fp8-* options apply to the FP8 modes, not --precision " + mode.name,
                   "use --precision fp8-hybrid or fp8-e4m3, or drop them");
    return std::nullopt;
  }
  MANTISSA_CHECK(!c.stochastic_outputs,
                 "--stochastic-outputs does not combine with --precision " + mode.name,
                 "drop it: FP8 matrix ops round their outputs to nearest");
  return make_fp8_recipe(*mode.fp8_gradients, c.fp8_scaling, c.fp8_amax_history, c.fp8_amax_algo,
                         c.fp8_margin, c.fp8_keep_layers);
}

}  // namespace

PrecisionSettings resolve_precision(const PrecisionChoices& c, uint64_t seed) {
  PrecisionSettings s;
  const std::optional<DType> half =
      c.half_type.empty() ? std::nullopt
                          : std::optional<DType>(parse_float_type(c.half_type, "--half-type"));
  s.mode = precision_mode(c.precision, half);
  s.partials = parse_partials(c.partials);
  if (!c.accum_type.empty()) s.grad_dtype = parse_float_type(c.accum_type, "--accum-type");
  s.state_types = {s.mode.first_moment, s.mode.second_moment};
  if (!c.first_moment_type.empty())
    s.state_types.first_moment = parse_float_type(c.first_moment_type, "--first-moment-type");
  if (!c.second_moment_type.empty())
    s.state_types.second_moment = parse_float_type(c.second_moment_type, "--second-moment-type");
  s.loss_scaling = loss_scaling_of(c, s.mode);
  s.fp8 = fp8_recipe_of(c, s.mode);
  MANTISSA_CHECK(!s.fp8 || !s.loss_scaling || !s.loss_scaling->dynamic,
                 "--loss-scaling dynamic does not combine with --precision " + c.precision,
                 "drop it: BF16 needs no loss scaling, and an overflow step's inf would stay in "
                 "the FP8 amax histories, freezing their scales");
  MANTISSA_CHECK(!c.stochastic_outputs || s.mode.param_dtype != DType::f32 || s.mode.autocast,
                 "--stochastic-outputs needs 16-bit op outputs",
                 "use it with a 16-bit --precision (16-true, bf16-true, 16-mixed, ...)");
  // Streams of their own: the seed also keys initialisation, shuffling and dropout.
  if (c.stochastic_rounding) s.stochastic_rounding_seed = seed ^ 0x5352u;
  if (c.stochastic_outputs) s.stochastic_outputs_seed = seed ^ 0x4f5554u;
  if (c.kahan) {
    MANTISSA_CHECK(s.mode.param_dtype != DType::f32,
                   "--kahan with --precision " + c.precision + ", whose parameters are FP32",
                   "use it where parameters are 16-bit: bf16-true, 16-true, 16.16, O3");
    MANTISSA_CHECK(!s.mode.master_weights,
                   "--kahan with --precision " + c.precision + ", which keeps FP32 master weights",
                   "the masters keep every update already: drop --kahan, or use a mode without "
                   "them (bf16-true, 16-true, 16.16, O3)");
    MANTISSA_CHECK(!c.stochastic_rounding, "--kahan together with --stochastic-rounding",
                   "use one of them: each keeps the updates below half an ulp");
  }
  s.kahan = c.kahan;
  s.policy = policy_of(c);  // the op-list files: readable, known ops, no op in both
  for (const auto& k : c.keep_fp32)
    MANTISSA_CHECK(
        std::find(c.half_modules.begin(), c.half_modules.end(), k) == c.half_modules.end(),
        "module '" + excerpt(k) + "' is in both --keep-fp32 and --half-modules",
        "name it in one of them");
  s.keep_fp32 = c.keep_fp32;
  s.half_modules = c.half_modules;
  return s;
}

std::string PrecisionSettings::describe() const {
  PrecisionMode shown = mode;  // with the settings that override the mode's defaults
  shown.loss_scaling = loss_scaling;
  shown.first_moment = state_types.first_moment;
  shown.second_moment = state_types.second_moment;
  return shown.describe() + ", partials " + partials_name(partials) +
         (stochastic_rounding_seed ? ", stochastic rounding" : "") +
         (kahan ? ", Kahan-compensated parameters" : "") +
         (stochastic_outputs_seed ? ", stochastic op outputs" : "") +
         (fp8 ? ", fp8 linear and conv2d: " + fp8->describe() + ", fp32 accumulation" : "");
}

Tensor PrecisionSettings::loss_input(const Tensor& output) const {
  return mode.fp32_loss && output.dtype() != DType::f32 ? ops::cast(output, DType::f32) : output;
}

void apply_precision(const PrecisionSettings& s, nn::Module& model, optim::Optimizer& optimizer) {
  const PrecisionMode& mode = s.mode;
  if (mode.param_dtype != DType::f32) {
    model.to(mode.param_dtype);
    if (mode.keep_norm_fp32) {
      // O2: normalization layers keep FP32 weights and statistics and take 16-bit activations
      // as they come; the log-softmax (the loss's first half) runs in FP32.
      for (auto& [path, sub] : model.named_modules()) {
        if (sub->is_normalization()) sub->cast_parameters(DType::f32);
        if (sub->is_log_softmax()) sub->to(DType::f32);
      }
    }
  }
  for (const std::string& path : s.half_modules) model.submodule(path).to(mode.half);
  for (const std::string& path : s.keep_fp32) model.submodule(path).to(DType::f32);
  if (s.grad_dtype)
    for (auto& p : model.named_parameters()) p.tensor->autograd_meta()->grad_dtype = *s.grad_dtype;
  optimizer.set_state_types(s.state_types);
  if (mode.master_weights) optimizer.enable_master_weights();
  if (s.stochastic_rounding_seed) optimizer.set_stochastic_rounding(s.stochastic_rounding_seed);
  if (s.kahan) optimizer.enable_kahan();
}

ForwardPrecision::ForwardPrecision(const PrecisionSettings& s, ops::AutocastLog* log,
                                   uint64_t stochastic_stream, Fp8State* fp8)
    : partials_(s.partials) {
  MANTISSA_CHECK(!s.fp8 || fp8, "--precision " + s.mode.name + " runs without its FP8 state",
                 "make an amp::Fp8State(*settings.fp8, model) and pass it to ForwardPrecision");
  if (s.mode.autocast) autocast_.emplace(s.mode.half, s.policy, log);
  if (s.stochastic_outputs_seed) stochastic_.emplace(*s.stochastic_outputs_seed, stochastic_stream);
  if (s.fp8) fp8_.emplace(*fp8);
}

}  // namespace mantissa::amp
