#include "mantissa/amp/settings.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "mantissa/core/error.h"
#include "mantissa/io/input_file.h"
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

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// A numerics report's size limit: far above the histograms of any model over any run.
constexpr uint64_t kMaxReportBytes = uint64_t{1} << 30;

// The suggested loss scale of a numerics report (nn::NumericsRecorder::json()).
double suggested_loss_scale(const std::string& path) {
  const std::string hint = "pass the JSON file that --numerics-report wrote";
  // Opened as every input file is (io/input_file.h): a directory, FIFO or device is refused
  // without being read or waited on.
  const io::InputFile file(path, "--loss-scale-init numerics report", kMaxReportBytes, hint);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(file.read_all());
  } catch (const nlohmann::json::exception&) {
    throw Error("--loss-scale-init from:" + path + ": the file is not JSON", hint);
  }
  const nlohmann::json* scale = nullptr;
  if (j.is_object() && j.contains("suggested_loss_scale") &&
      j["suggested_loss_scale"].is_object() && j["suggested_loss_scale"].contains("scale"))
    scale = &j["suggested_loss_scale"]["scale"];
  MANTISSA_CHECK(scale && scale->is_number(),
                 "--loss-scale-init from:" + path +
                     ": not a numerics report (no number at suggested_loss_scale.scale)",
                 hint);
  const double v = scale->get<double>();
  MANTISSA_CHECK(std::isfinite(v) && v > 0,
                 "--loss-scale-init from:" + path + ": the suggested loss scale " + num(v) +
                     " is not a positive number",
                 "the file is damaged; write it again with --numerics-report");
  check_loss_scale(v, "--loss-scale-init from:" + path + ": the suggested loss scale " + num(v));
  return v;
}

// The mode's loss scaling, or the one --loss-scaling names, with the --loss-scale-* flags applied.
// Those flags are options of a dynamic scale: without loss scaling or with a static scale they
// would change nothing, so they are refused there.
std::optional<LossScalerOptions> loss_scaling_of(const PrecisionChoices& c,
                                                 const PrecisionMode& mode) {
  std::optional<LossScalerOptions> o =
      c.loss_scaling.empty() ? mode.loss_scaling : parse_loss_scaling(c.loss_scaling);
  MANTISSA_CHECK(c.loss_scale_growth_interval > 0, "--loss-scale-growth-interval must be positive",
                 "e.g. 2000");
  MANTISSA_CHECK(c.loss_scale_hysteresis >= 1, "--loss-scale-hysteresis must be at least 1",
                 "1 backs off on every overflow");
  const bool init_given = c.loss_scale_init || !c.loss_scale_init_report.empty();
  MANTISSA_CHECK(!c.loss_scale_init || c.loss_scale_init_report.empty(),
                 "--loss-scale-init is given twice: a number and from:" + c.loss_scale_init_report,
                 "give one of them");
  const PrecisionChoices defaults;
  const char* set = init_given         ? "--loss-scale-init"
                    : c.loss_scale_min ? "--loss-scale-min"
                    : c.loss_scale_max ? "--loss-scale-max"
                    : c.loss_scale_growth_interval != defaults.loss_scale_growth_interval
                        ? "--loss-scale-growth-interval"
                    : c.loss_scale_hysteresis != defaults.loss_scale_hysteresis
                        ? "--loss-scale-hysteresis"
                        : nullptr;
  if (!o) {
    MANTISSA_CHECK(!set,
                   std::string(set ? set : "") + " applies to loss scaling, which " +
                       (c.loss_scaling.empty() ? "--precision " + mode.name + " does not use"
                                               : std::string("--loss-scaling none turns off")),
                   std::string("add --loss-scaling dynamic, or drop ") + (set ? set : ""));
    return o;
  }
  if (!o->dynamic) {
    MANTISSA_CHECK(
        !set,
        std::string(set ? set : "") + " applies to a dynamic loss scale, and --loss-scaling " +
            c.loss_scaling + " is a static one",
        init_given ? "a static scale is the value of --loss-scaling: give one of them, or use "
                     "--loss-scaling dynamic --loss-scale-init X for a dynamic scale from X"
                   : std::string("use --loss-scaling dynamic, or drop ") + (set ? set : ""));
    return o;
  }
  for (const auto& [flag, v] : {std::pair{"--loss-scale-init", c.loss_scale_init},
                                std::pair{"--loss-scale-min", c.loss_scale_min},
                                std::pair{"--loss-scale-max", c.loss_scale_max}})
    if (v) check_loss_scale(*v, std::string(flag) + " " + num(*v));
  if (!c.loss_scale_init_report.empty())
    o->init_scale = suggested_loss_scale(c.loss_scale_init_report);
  if (c.loss_scale_init) o->init_scale = *c.loss_scale_init;
  o->min_scale = c.loss_scale_min;
  o->max_scale = c.loss_scale_max;
  o->growth_interval = c.loss_scale_growth_interval;
  o->hysteresis = c.loss_scale_hysteresis;
  // The scaler clamps its start into [min, max]: a default start may be clamped (that is what a
  // cap is for), an initial scale the user gave may not be overridden silently.
  const std::string init_str =
      "--loss-scale-init " +
      (c.loss_scale_init ? num(*c.loss_scale_init)
                         : "from:" + c.loss_scale_init_report + " (" + num(o->init_scale) + ")");
  MANTISSA_CHECK(!init_given || !o->min_scale || o->init_scale >= *o->min_scale,
                 init_str + " is below --loss-scale-min " + num(o->min_scale.value_or(0)),
                 "the scale would start at the minimum: lower --loss-scale-min or raise the start");
  MANTISSA_CHECK(!init_given || !o->max_scale || o->init_scale <= *o->max_scale,
                 init_str + " is above --loss-scale-max " + num(o->max_scale.value_or(0)),
                 "the scale would start at the maximum: raise --loss-scale-max or lower the start");
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
  if (s.loss_scaling) s.loss_scale_init_report = c.loss_scale_init_report;
  const std::string mode_flag = "--precision " + s.mode.name;
  // What the mode stores in 16 bits: the flags below act on those values only.
  const bool half_params = s.mode.param_dtype != DType::f32 || !c.half_modules.empty();
  const bool half_state =
      s.state_types.first_moment != DType::f32 || s.state_types.second_moment != DType::f32;
  MANTISSA_CHECK(!c.stochastic_rounding || half_params || half_state,
                 "--stochastic-rounding has nothing to round: " + mode_flag +
                     " keeps the parameters and the optimizer state in FP32" +
                     (s.mode.read_as_half ? " (its ops read the FP32 parameters rounded to "
                                            "nearest; no 16-bit copy is written)"
                                          : ""),
                 "use it with 16-bit parameters (16-true, bf16-true, --half-modules) or 16-bit "
                 "optimizer state (--first-moment-type / --second-moment-type bf16), or drop it");
  MANTISSA_CHECK(!c.stochastic_outputs || half_params || s.mode.autocast || s.mode.read_as_half,
                 "--stochastic-outputs needs 16-bit op outputs, and " + mode_flag + " has none",
                 "use it with a 16-bit --precision (16-true, bf16-true, 16-mixed, ...)");
  for (const auto& [flag, file] : {std::pair{"--autocast-lower-list", &c.autocast_lower_list},
                                   std::pair{"--autocast-fp32-list", &c.autocast_fp32_list}})
    MANTISSA_CHECK(
        file->empty() || s.mode.autocast,
        std::string(flag) + " applies to automatic casting, which " + mode_flag + " does not use",
        "use a mixed mode (16-mixed, bf16-mixed, O1), or drop it");
  // Module overrides in a mode that already runs every module in that type change nothing
  // (unless the other override makes a subtree different first).
  const bool all_fp32 =
      s.mode.param_dtype == DType::f32 && s.mode.input_dtype == DType::f32 && !s.mode.autocast;
  const bool all_half = s.mode.param_dtype == s.mode.half && s.mode.input_dtype == s.mode.half &&
                        !s.mode.autocast && !s.mode.keep_norm_fp32;
  MANTISSA_CHECK(c.keep_fp32.empty() || !all_fp32 || !c.half_modules.empty(),
                 "--keep-fp32 changes nothing: " + mode_flag + " runs every module in FP32",
                 "use it with a 16-bit --precision, or for a part of --half-modules");
  MANTISSA_CHECK(c.half_modules.empty() || !all_half || !c.keep_fp32.empty(),
                 "--half-modules changes nothing: " + mode_flag + " runs every module in " +
                     std::string(dtype_name(s.mode.half)),
                 "use it with a mode that keeps modules in FP32 (32-true, 16-mixed, O2, ...), or "
                 "for a part of --keep-fp32");
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
  s.autocast_lower_list = c.autocast_lower_list;
  s.autocast_fp32_list = c.autocast_fp32_list;
  return s;
}

std::string PrecisionSettings::describe() const {
  PrecisionMode shown = mode;  // with the settings that override the mode's defaults
  shown.loss_scaling = loss_scaling;
  shown.first_moment = state_types.first_moment;
  shown.second_moment = state_types.second_moment;
  auto joined = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& x : v) s += (s.empty() ? "" : ",") + x;
    return s;
  };
  std::string line = shown.describe() + ", partials " + partials_name(partials);
  if (grad_dtype) line += ", gradients " + std::string(dtype_name(*grad_dtype));
  if (stochastic_rounding_seed) line += ", stochastic rounding";
  if (kahan) line += ", Kahan-compensated parameters";
  if (stochastic_outputs_seed) line += ", stochastic op outputs";
  if (fp8) line += ", fp8 linear and conv2d: " + fp8->describe() + ", fp32 accumulation";
  if (!loss_scale_init_report.empty())
    line += ", initial loss scale from numerics report " + loss_scale_init_report;
  if (!half_modules.empty()) line += ", 16-bit modules " + joined(half_modules);
  if (!keep_fp32.empty()) line += ", fp32 modules " + joined(keep_fp32);
  if (!autocast_lower_list.empty()) line += ", lower-precision ops from " + autocast_lower_list;
  if (!autocast_fp32_list.empty()) line += ", fp32 ops from " + autocast_fp32_list;
  return line;
}

Tensor PrecisionSettings::loss_input(const Tensor& output) const {
  return mode.fp32_loss && output.dtype() != DType::f32 ? ops::cast(output, DType::f32) : output;
}

void apply_precision(const PrecisionSettings& s, nn::Module& model, optim::Optimizer& optimizer) {
  const PrecisionMode& mode = s.mode;
  // The mode's parameter type, also over a model that arrives in another (a user's model made
  // 16-bit before training in an FP32 mode trains in FP32, as the settings line says).
  bool other_dtype = mode.param_dtype != DType::f32;
  for (const Tensor* t : model.parameters()) other_dtype |= t->dtype() != mode.param_dtype;
  if (other_dtype) model.to(mode.param_dtype);
  if (mode.read_as_half) {
    // O2: every parameter but the normalization layers' is rounded to its 16-bit value, then read
    // as 16-bit (ops::ReadAsScope) and gets a 16-bit gradient, as a 16-bit parameter would;
    // normalization layers read FP32 weights and take 16-bit activations as they come; the
    // log-softmax (the loss's first half) runs in FP32.
    std::set<const Tensor*> fp32;
    for (auto& [path, sub] : model.named_modules()) {
      if (sub->is_normalization())
        for (const Tensor* t : sub->parameters()) fp32.insert(t);
      if (sub->is_log_softmax()) sub->to(DType::f32);
    }
    for (Tensor* t : model.parameters()) {
      if (fp32.count(t) || t->dtype() != DType::f32) continue;
      // The masters start from the 16-bit model's values, as masters copied from a model cast
      // to 16 bits do (Apex's O2).
      t->copy_from(t->detach().to(mode.half));
      t->autograd_meta()->read_as = mode.half;
      t->autograd_meta()->grad_dtype = mode.half;
    }
  }
  for (const std::string& path : s.half_modules) model.submodule(path).to(mode.half);
  for (const std::string& path : s.keep_fp32) {
    nn::Module& m = model.submodule(path);
    m.to(DType::f32);
    for (Tensor* t : m.parameters()) {  // read and differentiated as stored
      t->autograd_meta()->read_as.reset();
      t->autograd_meta()->grad_dtype.reset();
    }
  }
  if (s.grad_dtype)
    for (auto& p : model.named_parameters()) p.tensor->autograd_meta()->grad_dtype = *s.grad_dtype;
  // The flags that act on 16-bit parameters, checked against what the module overrides left
  // (resolve_precision checked the mode): --keep-fp32 may have taken back every one.
  bool half_params = false;
  for (const Tensor* t : model.parameters()) half_params |= is_16bit_float(t->dtype());
  const bool half_state =
      s.state_types.first_moment != DType::f32 || s.state_types.second_moment != DType::f32;
  MANTISSA_CHECK(!s.kahan || half_params,
                 "--kahan has nothing to compensate: --keep-fp32 keeps every parameter of "
                 "--precision " +
                     mode.name + " in FP32",
                 "drop --kahan, or keep fewer modules in FP32");
  MANTISSA_CHECK(!s.stochastic_rounding_seed || half_params || half_state,
                 "--stochastic-rounding has nothing to round: --keep-fp32 keeps every parameter "
                 "of --precision " +
                     mode.name + " in FP32, and the optimizer state is FP32",
                 "drop --stochastic-rounding, or keep fewer modules in FP32");
  optimizer.set_state_types(s.state_types);
  if (mode.master_weights) optimizer.enable_master_weights();
  if (s.stochastic_rounding_seed) optimizer.set_stochastic_rounding(s.stochastic_rounding_seed);
  if (s.kahan) optimizer.enable_kahan();
}

ForwardPrecision::ForwardPrecision(const PrecisionSettings& s, ops::AutocastLog* log,
                                   uint64_t stochastic_stream, ops::Fp8Provider* fp8)
    : partials_(s.partials) {
  MANTISSA_CHECK(!s.fp8 || fp8, "--precision " + s.mode.name + " runs without its FP8 state",
                 "make an amp::Fp8State(*settings.fp8, model) and pass it to ForwardPrecision");
  if (s.mode.autocast) autocast_.emplace(s.mode.half, s.policy, log);
  if (s.mode.read_as_half) read_as_.emplace();
  if (s.stochastic_outputs_seed) stochastic_.emplace(*s.stochastic_outputs_seed, stochastic_stream);
  if (s.fp8) fp8_.emplace(*fp8);
}

ForwardPrecision::ForwardPrecision(Evaluation, const PrecisionSettings& s, ops::Fp8Provider* fp8)
    : partials_(s.partials) {
  if (s.mode.autocast) autocast_.emplace(s.mode.half, s.policy);
  if (s.mode.read_as_half) read_as_.emplace();
  if (s.fp8 && fp8) fp8_.emplace(*fp8);
}

}  // namespace mantissa::amp
