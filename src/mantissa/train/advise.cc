#include "mantissa/train/advise.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mantissa/amp/precision.h"
#include "mantissa/core/error.h"
#include "mantissa/io/html.h"
#include "mantissa/train/run_data.h"
#include "mantissa/train/trainer.h"

namespace mantissa::train {
namespace {

using json = nlohmann::json;

const nn::FormatRange& format_range(DType half) {
  return half == DType::bf16 ? nn::kBf16Range : nn::kFp16Range;
}
const char* half_name(DType half) { return half == DType::bf16 ? "bf16" : "fp16"; }

// The largest finite value's rounding threshold: |x| at or above it rounds to infinity.
double overflow_threshold(DType half) {
  return half == DType::bf16 ? std::ldexp(2.0 - std::ldexp(1.0, -8), 127) : 65520.0;
}

// Half an ulp of w in a 16-bit type (the ulp of the binade above |w|'s power of two; subnormal
// spacing below the smallest normal): an update smaller than this rounds back to w.
double half_ulp(float w, DType half) {
  const int mantissa_bits = half == DType::bf16 ? 7 : 10;
  const int min_exp = half == DType::bf16 ? -126 : -14;
  const int e = w == 0 ? min_exp : std::max(std::ilogb(w), min_exp);
  return std::ldexp(1.0, e - mantissa_bits - 1);
}

// The module a parameter belongs to: its name up to the last dot.
std::string owner_of(const std::string& parameter) {
  const size_t dot = parameter.rfind('.');
  return dot == std::string::npos ? std::string() : parameter.substr(0, dot);
}

// Non-zero updates, and those below half an ulp in FP16 and in BF16.
struct UpdateCount {
  int64_t nonzero = 0, lost_fp16 = 0, lost_bf16 = 0;
  void merge(const UpdateCount& o) {
    nonzero += o.nonzero;
    lost_fp16 += o.lost_fp16;
    lost_bf16 += o.lost_bf16;
  }
  double lost(DType half) const {
    const int64_t n = half == DType::bf16 ? lost_bf16 : lost_fp16;
    return nonzero > 0 ? static_cast<double>(n) / static_cast<double>(nonzero) : 0;
  }
};

// Loss scales 2^k (k = kMinScaleExp..kMaxScaleExp) against the gradients' histogram.
struct ScaleRange {
  std::optional<double> min, max;
  std::vector<double> overflow, underflow;
};
ScaleRange scale_range(const nn::Log2Histogram& g, DType half) {
  const nn::FormatRange& f = format_range(half);
  const double nonzero = static_cast<double>(std::max<int64_t>(g.nonzero(), 1));
  const double total = static_cast<double>(g.count);
  ScaleRange r;
  std::optional<int> kmax;
  for (int k = kMinScaleExp; k <= kMaxScaleExp; ++k) {
    r.overflow.push_back(g.fraction_at_least(f.overflow_exp - k));
    r.underflow.push_back(g.fraction_below(f.zero_exp - k) * total / nonzero);
    if (g.nonfinite == 0 && std::ldexp(g.max_abs, k) < overflow_threshold(half)) kmax = k;
  }
  if (!kmax) return r;
  const double floor = r.underflow[static_cast<size_t>(*kmax - kMinScaleExp)];
  int kmin = *kmax;
  while (kmin > kMinScaleExp &&
         r.underflow[static_cast<size_t>(kmin - 1 - kMinScaleExp)] <= floor + kScaleUnderflowSlack)
    --kmin;
  r.min = std::ldexp(1.0, kmin);
  r.max = std::ldexp(1.0, *kmax);
  return r;
}

// Whether a mode puts anything in 16 bits.
bool uses_half(const amp::PrecisionMode& m) {
  return m.autocast || m.param_dtype != DType::f32 || m.input_dtype != DType::f32;
}

// The BF16 counterpart of a precision: the name and the --half-type it needs ("" for none).
std::pair<std::string, std::string> bf16_counterpart(const std::string& name) {
  if (name == "16-mixed") return {"bf16-mixed", ""};
  if (name == "16-true") return {"bf16-true", ""};
  try {
    amp::precision_mode(name, DType::bf16);
    return {name, "bf16"};
  } catch (const Error&) {
    return {name, ""};  // its name fixes BF16 already
  }
}

std::string percent(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g%%", 100 * f);
  return buf;
}
std::string sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}
std::string pow2(double s) { return "2^" + std::to_string(std::ilogb(s)); }

// A word of a command line, quoted for a POSIX shell when it needs to be.
std::string shell_word(const std::string& w) {
  const bool plain = !w.empty() && std::all_of(w.begin(), w.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) ||
           std::string("_./,=:+-@%").find(ch) != std::string::npos;
  });
  if (plain) return w;
  std::string q = "'";
  for (char ch : w) q += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return q + "'";
}

// The `mantissa train` command of a configuration: the settings the advisor reads that are not at
// their defaults, then the precision.
std::string command_line(const TrainConfig& c) {
  const TrainConfig d;
  std::vector<std::string> w = {"mantissa", "train", "--model", c.model};
  auto add = [&](const char* flag, const std::string& v) {
    w.push_back(flag);
    w.push_back(v);
  };
  auto num = [](double v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  if (c.dataset != d.dataset) add("--dataset", c.dataset);
  if (!c.data_dir.empty()) add("--data-dir", c.data_dir);
  if (c.image_size != d.image_size) add("--image-size", std::to_string(c.image_size));
  if (c.imagenet_stem) w.push_back("--imagenet-stem");
  if (c.train_limit != d.train_limit) add("--train-limit", std::to_string(c.train_limit));
  if (c.synthetic_size != d.synthetic_size)
    add("--synthetic-size", std::to_string(c.synthetic_size));
  if (c.batch_size != d.batch_size) add("--batch-size", std::to_string(c.batch_size));
  if (c.optimizer != d.optimizer) add("--optimizer", c.optimizer);
  if (c.lr != d.lr) add("--lr", num(c.lr));
  if (c.weight_decay) add("--weight-decay", num(*c.weight_decay));
  if (c.momentum != d.momentum) add("--momentum", num(c.momentum));
  if (c.seed != d.seed) add("--seed", std::to_string(c.seed));
  if (!c.init_from.empty()) add("--init-from", c.init_from);
  add("--precision", c.precision);
  if (!c.half_type.empty()) add("--half-type", c.half_type);
  if (!c.keep_fp32.empty()) {
    std::string list;
    for (const std::string& m : c.keep_fp32) list += (list.empty() ? "" : ",") + m;
    add("--keep-fp32", list);
  }
  if (!c.loss_scaling.empty()) add("--loss-scaling", c.loss_scaling);
  if (c.kahan) w.push_back("--kahan");
  std::string line;
  for (const std::string& s : w) line += (line.empty() ? "" : " ") + shell_word(s);
  return line;
}

// What the calibration gathers per leaf module.
struct LayerRecord {
  std::string name;
  bool has_weights = false;
  nn::Log2Histogram weights, activations, gradients;
  UpdateCount updates;
};

void check_config(const AdviseConfig& a) {
  const TrainConfig& c = a.train;
  MANTISSA_CHECK(a.steps >= 1, "--steps must be at least 1 (got " + std::to_string(a.steps) + ")",
                 "the calibration needs FP32 steps to measure; the default is 20");
  MANTISSA_CHECK(a.verify >= 0, "--verify must not be negative", "pass K >= 1 steps, or leave it");
  MANTISSA_CHECK(c.keep_fp32.empty() && c.half_modules.empty() && c.loss_scaling.empty() &&
                     !c.stochastic_rounding && !c.stochastic_outputs,
                 "the advisor chooses keep_fp32, half_modules, loss_scaling and stochastic "
                 "rounding itself",
                 "leave them at their defaults in the AdviseConfig");
  validate(c);
  const amp::PrecisionMode mode = amp::precision_mode(
      c.precision, c.half_type.empty()
                       ? std::nullopt
                       : std::optional<DType>(amp::parse_float_type(c.half_type, "--half-type")));
  MANTISSA_CHECK(uses_half(mode),
                 "--precision " + c.precision + " keeps everything in FP32: nothing to advise",
                 "name a 16-bit precision, e.g. 16-mixed, bf16-mixed, 16-true or bf16-true");
  // The histograms and update counts measure what FP16 and BF16 hold; an FP8 format's range and
  // its per-tensor scales are another question (the FP8 recipe's amax history answers it).
  MANTISSA_CHECK(!mode.fp8_gradients,
                 "--precision " + c.precision +
                     " computes in FP8, which the advisor does not model: it measures what FP16 "
                     "and BF16 keep",
                 "advise on bf16-mixed, which the FP8 modes run outside their FP8 matrix ops, then "
                 "train in " +
                     c.precision);
}

// A built-in dataset's batch for step s of a run (the trainer's order: epoch by epoch).
data::Batch batch_for_step(const data::Loader& loader, int64_t s) {
  const int64_t bpe = loader.batches_per_epoch();
  MANTISSA_CHECK(bpe > 0, "an epoch of the training data has no full batch",
                 "lower --batch-size or use more examples");
  return loader.make_batch(s / bpe, s % bpe);
}

}  // namespace

TrainConfig recommended_config(const TrainConfig& base, const Recommendation& r) {
  TrainConfig c = base;
  c.precision = r.precision;
  if (r.precision != base.precision) c.half_type.clear();  // bf16-mixed, bf16-true fix it
  // The modes whose name does not fix the 16-bit type change it by --half-type.
  if (r.half_type == "bf16" && bf16_counterpart(c.precision).second == "bf16" &&
      amp::precision_mode(c.precision, c.half_type.empty()
                                           ? std::nullopt
                                           : std::optional<DType>(
                                                 amp::parse_float_type(c.half_type, "--half-type")))
              .half != DType::bf16)
    c.half_type = "bf16";
  c.keep_fp32 = r.keep_fp32;
  c.loss_scaling = r.loss_scaling;
  c.kahan = r.kahan;
  return c;
}

Advice advise(const AdviseConfig& a, std::ostream* progress) {
  check_config(a);
  const TrainConfig& target = a.train;
  const amp::PrecisionMode mode = amp::precision_mode(
      target.precision, target.half_type.empty() ? std::nullopt
                                                 : std::optional<DType>(amp::parse_float_type(
                                                       target.half_type, "--half-type")));
  const DType half = mode.param_dtype != DType::f32 ? mode.param_dtype : mode.half;

  // ---- The FP32 calibration: the trainer's steps in 32-true, recorded ----
  TrainConfig cal = target;
  cal.precision = "32-true";
  cal.half_type.clear();
  cal.progress = cal.evaluate = false;
  cal.metrics_json.clear();
  cal.report.clear();
  cal.save.clear();
  cal.resume.clear();
  cal.numerics_report.clear();
  if (progress)
    *progress << "calibrating: " << a.steps << " FP32 steps of " << target.model << " on "
              << target.dataset << ", batch " << target.batch_size << std::endl;
  Trainer trainer(cal, {});
  nn::NumericsRecorder& recorder = trainer.record_numerics();
  const RunData data(cal, DType::f32);
  const std::unique_ptr<data::Loader> loader = data.train_loader();

  std::vector<LayerRecord> layers;
  std::map<std::string, size_t> index;  // module path -> layers
  for (auto& [path, m] : trainer.model().named_modules()) {
    if (path.empty() || !m->children().empty()) continue;
    index[path] = layers.size();
    layers.emplace_back().name = path;
  }
  auto params = trainer.model().named_parameters();
  for (int64_t s = 0; s < a.steps; ++s) {
    // (numel) per parameter: the FP32 weights before the step
    std::vector<std::vector<float>> before;
    for (auto& p : params) {
      const Tensor w = p.tensor->contiguous();
      before.emplace_back(w.data<float>(), w.data<float>() + w.numel());
      auto it = index.find(owner_of(p.name));
      if (it == index.end()) continue;
      layers[it->second].has_weights = true;
      layers[it->second].weights.add(*p.tensor);
    }
    trainer.call({batch_for_step(*loader, s)});
    for (size_t i = 0; i < params.size(); ++i) {
      auto it = index.find(owner_of(params[i].name));
      if (it == index.end()) continue;
      const Tensor w = params[i].tensor->contiguous();
      const float* after = w.data<float>();
      UpdateCount u;
      for (size_t j = 0; j < before[i].size(); ++j) {
        const float w0 = before[i][j];
        const double du = std::fabs(static_cast<double>(after[j]) - static_cast<double>(w0));
        if (du == 0) continue;
        ++u.nonzero;
        u.lost_fp16 += du < half_ulp(w0, DType::f16);
        u.lost_bf16 += du < half_ulp(w0, DType::bf16);
      }
      layers[it->second].updates.merge(u);
    }
  }
  for (auto& [key, e] : recorder.entries()) {
    const bool weight = e.kind == "weight_gradient";
    auto it = index.find(weight ? owner_of(e.layer) : e.layer);
    if (it == index.end()) continue;
    LayerRecord& l = layers[it->second];
    (e.kind == "activation" ? l.activations : l.gradients).merge(e.histogram);
  }

  // ---- Per layer, against the target's 16-bit type ----
  Advice advice;
  advice.precision = target.precision;
  advice.half_type = half_name(half);
  advice.parameters_16bit = mode.param_dtype != DType::f32 && !mode.master_weights;
  advice.steps = a.steps;
  const nn::FormatRange& range = format_range(half);
  UpdateCount all_updates;
  for (const LayerRecord& l : layers) {
    if (l.activations.count == 0 && !l.has_weights) continue;
    LayerAdvice la;
    la.name = l.name;
    if (l.has_weights) {
      la.weights = nn::range_fractions(l.weights, range);
      la.updates_lost = l.updates.lost(half);
    }
    la.activations = nn::range_fractions(l.activations, range);
    la.gradients = nn::range_fractions(l.gradients, range);
    la.activation_max = l.activations.max_abs;
    advice.layers.push_back(la);
    all_updates.merge(l.updates);
  }
  nn::Log2Histogram gradients = recorder.merged("activation_gradient");
  gradients.merge(recorder.merged("weight_gradient"));
  const ScaleRange scales = scale_range(gradients, half);
  advice.loss_scale_min = scales.min;
  advice.loss_scale_max = scales.max;
  advice.overflow_at_scale = scales.overflow;
  advice.underflow_at_scale = scales.underflow;

  // ---- The recommendation ----
  Recommendation& r = advice.recommendation;
  r.precision = target.precision;
  r.half_type = advice.half_type;
  // Layers whose outputs or weights overflow the 16-bit type. When BF16 holds them (the classic
  // case: a model trained in BF16 run in FP16), BF16 is the fix: keeping the layers in FP32 is
  // not enough when their outputs pass through bare ops of the model's forward (a functional
  // ReLU, which automatic casting lowers to 16 bits), which no per-module setting reaches.
  // What even BF16 cannot hold is kept in FP32.
  std::vector<const LayerAdvice*> overflowing;
  bool bf16_holds = true;
  for (const LayerAdvice& l : advice.layers) {
    if (l.activations.overflow == 0 && !(l.weights && l.weights->overflow > 0)) continue;
    overflowing.push_back(&l);
    if (l.activation_max >= overflow_threshold(DType::bf16)) bf16_holds = false;
  }
  auto overflow_reason = [&](const LayerAdvice& l) {
    return l.name + ": " +
           (l.activations.overflow > 0
                ? percent(l.activations.overflow) + " of its outputs overflow " + advice.half_type +
                      " (largest |x| " + sci(l.activation_max) + ")"
                : percent(l.weights->overflow) + " of its weights overflow " + advice.half_type);
  };
  DType chosen = half;
  if (half == DType::f16 && bf16_holds && (!overflowing.empty() || !scales.max)) {
    chosen = DType::bf16;
    const auto [name, half_flag] = bf16_counterpart(target.precision);
    r.precision = name;
    r.half_type = "bf16";
    for (const LayerAdvice* l : overflowing)
      r.reasons.push_back(overflow_reason(*l) + "; BF16 holds them (FP32's range)");
    r.reasons.push_back("run " + name + (half_flag.empty() ? "" : " --half-type bf16") +
                        " (or keep the layers above in FP32 with --keep-fp32, where their "
                        "outputs reach only modules)");
  } else {
    for (const LayerAdvice* l : overflowing) {
      r.keep_fp32.push_back(l->name);
      r.reasons.push_back(overflow_reason(*l) + ": keep it in FP32");
    }
  }
  // Loss scaling: FP16 needs it to lift small gradients; BF16 only when scale 1 would flush them.
  const ScaleRange chosen_scales = chosen == half ? scales : scale_range(gradients, chosen);
  const bool one_fits = chosen_scales.min && *chosen_scales.min <= 1 && *chosen_scales.max >= 1;
  r.loss_scaling = chosen == DType::f16 || !one_fits ? "dynamic" : "none";
  if (chosen_scales.min)
    r.reasons.push_back(
        "gradients stay representable in " + std::string(half_name(chosen)) + " at loss scales " +
        pow2(*chosen_scales.min) + " to " + pow2(*chosen_scales.max) + " (" +
        percent(chosen_scales.underflow[static_cast<size_t>(-kMinScaleExp)]) +
        " of the non-zero gradients flush to zero at scale 1): loss scaling " + r.loss_scaling);
  // Updates lost to rounding matter only where parameters are stored in 16 bits without an FP32
  // master copy.
  const bool chosen_params_16bit = advice.parameters_16bit;
  if (chosen_params_16bit && all_updates.lost(chosen) > kUpdatesLostLimit) {
    r.kahan = true;
    r.reasons.push_back(percent(all_updates.lost(chosen)) +
                        " of the weight updates are smaller than half an ulp of their weight in " +
                        half_name(chosen) +
                        " and would be lost: --kahan (or --stochastic-rounding, which keeps them "
                        "on average)");
  }
  const std::string default_scaling =
      mode.loss_scaling ? (mode.loss_scaling->dynamic ? "dynamic" : "static") : "none";
  r.clean = r.keep_fp32.empty() && r.precision == target.precision && !r.kahan &&
            r.loss_scaling == default_scaling;
  if (r.clean)
    r.reasons.insert(r.reasons.begin(),
                     "clean bill: " + target.precision + " as it is (nothing overflows" +
                         (advice.parameters_16bit ? ", few updates are lost)"
                                                  : "; FP32 master weights keep every update)"));
  r.command = command_line(recommended_config(target, r));
  return advice;
}

Verification verify(const AdviseConfig& a, const Advice& advice) {
  Verification v;
  const Recommendation& r = advice.recommendation;
  TrainConfig base = a.train;
  base.progress = base.evaluate = false;
  base.metrics_json.clear();
  base.report.clear();
  base.save.clear();
  base.numerics_report.clear();
  TrainConfig fp32 = base;
  fp32.precision = "32-true";
  fp32.half_type.clear();
  const std::vector<std::pair<std::string, TrainConfig>> runs = {
      {"32-true", fp32}, {"recommended", recommended_config(base, r)}, {"naive", base}};
  for (const auto& [label, c] : runs) {
    VerifyRun run;
    run.label = label;
    run.precision = c.precision + (c.half_type.empty() ? "" : " (" + c.half_type + ")");
    try {
      Trainer trainer(c, {});
      const RunData data(c, trainer.precision().input_dtype);
      const std::unique_ptr<data::Loader> loader = data.train_loader();
      for (int64_t s = 0; s < a.verify; ++s) {
        const CallOutput out = trainer.call({batch_for_step(*loader, s)});
        run.losses.push_back(static_cast<float>(out.outputs.back().loss_sum));
      }
      if (trainer.loss_scaler()) run.skipped = trainer.loss_scaler()->skipped_steps();
    } catch (const Error& e) {
      run.failure = e.message();
    }
    v.runs.push_back(std::move(run));
  }
  const std::vector<float>& ref = v.runs[0].losses;
  for (VerifyRun& run : v.runs) {
    const size_t n = std::min(ref.size(), run.losses.size());
    double sum = 0;
    for (size_t i = 0; i < n; ++i) sum += std::fabs(static_cast<double>(run.losses[i]) - ref[i]);
    run.gap = n > 0 ? sum / static_cast<double>(n) : std::nan("");
  }
  return v;
}

namespace {

std::string fractions_cells(const nn::RangeFractions& f) {
  return percent(f.overflow) + " / " + percent(f.underflow) + " / " + percent(f.subnormal);
}

json fractions_json(const nn::RangeFractions& f) {
  return {{"overflow", f.overflow}, {"underflow", f.underflow}, {"subnormal", f.subnormal}};
}

std::string verify_line(const VerifyRun& run) {
  char buf[160];
  std::string line =
      run.label + (run.label == run.precision ? "" : " (" + run.precision + ")") + ": ";
  if (!run.losses.empty()) {
    std::snprintf(buf, sizeof buf, "%zu steps, final loss %.4f, mean gap to 32-true %.4g",
                  run.losses.size(), static_cast<double>(run.losses.back()), run.gap);
    line += buf;
    if (run.skipped > 0) line += ", " + std::to_string(run.skipped) + " steps skipped";
  }
  if (!run.failure.empty()) line += (run.losses.empty() ? "" : "; ") + ("failed: " + run.failure);
  return line;
}

}  // namespace

std::string advice_text(const Advice& a, const Verification* v) {
  std::ostringstream o;
  o << "precision " << a.precision << " (" << a.half_type << "), from " << a.steps
    << " FP32 steps; fractions overflow / flush to zero / subnormal in " << a.half_type << ":\n";
  char buf[256];
  std::snprintf(buf, sizeof buf, "  %-20s %-28s %-28s %-28s %s\n", "layer", "weights",
                "activations", "gradients", "updates lost");
  o << buf;
  for (const LayerAdvice& l : a.layers) {
    std::snprintf(buf, sizeof buf, "  %-20s %-28s %-28s %-28s %s\n", l.name.c_str(),
                  l.weights ? fractions_cells(*l.weights).c_str() : "-",
                  fractions_cells(l.activations).c_str(), fractions_cells(l.gradients).c_str(),
                  l.updates_lost ? percent(*l.updates_lost).c_str() : "-");
    o << buf;
  }
  if (a.loss_scale_min)
    o << "loss scales that keep the gradients representable: " << pow2(*a.loss_scale_min) << " to "
      << pow2(*a.loss_scale_max) << "\n";
  else
    o << "no loss scale keeps the gradients finite\n";
  o << "recommendation:\n";
  for (const std::string& reason : a.recommendation.reasons) o << "  " << reason << "\n";
  o << "  " << a.recommendation.command << "\n";
  if (v) {
    o << "verify (the same start and batches):\n";
    for (const VerifyRun& run : v->runs) o << "  " << verify_line(run) << "\n";
  }
  return o.str();
}

std::string advice_json(const Advice& a, const Verification* v) {
  json j;
  j["precision"] = a.precision;
  json layers = json::array();
  for (const LayerAdvice& l : a.layers)
    layers.push_back({{"name", l.name},
                      {"weights", l.weights ? fractions_json(*l.weights) : json(nullptr)},
                      {"activations", fractions_json(l.activations)},
                      {"gradients", fractions_json(l.gradients)},
                      {"updates_lost", l.updates_lost ? json(*l.updates_lost) : json(nullptr)}});
  j["layers"] = layers;
  j["loss_scale"] = {{"min", a.loss_scale_min ? json(*a.loss_scale_min) : json(nullptr)},
                     {"max", a.loss_scale_max ? json(*a.loss_scale_max) : json(nullptr)}};
  const Recommendation& r = a.recommendation;
  j["recommendation"] = {{"keep_fp32", r.keep_fp32},
                         {"loss_scaling", r.loss_scaling},
                         {"half_type", r.half_type},
                         {"command", r.command}};
  if (v) {
    json runs = json::array();
    for (const VerifyRun& run : v->runs)
      runs.push_back({{"label", run.label},
                      {"precision", run.precision},
                      {"losses", run.losses},
                      {"skipped", run.skipped},
                      {"failure", run.failure},
                      {"gap", std::isfinite(run.gap) ? json(run.gap) : json(nullptr)}});
    j["verify"] = {{"runs", runs}};
  }
  return j.dump(2) + "\n";
}

std::string advice_html(const AdviseConfig& c, const Advice& a, const Verification* v) {
  namespace html = io::html;
  using html::escape;
  std::ostringstream h;
  h << html::page_start("Mantissa advise: " + c.train.model + ", " + a.precision);
  h << "<h1>What " << escape(a.precision) << " would break: " << escape(c.train.model) << "</h1>\n"
    << "<p>From " << a.steps << " FP32 steps on " << escape(c.train.dataset) << " (batch "
    << c.train.batch_size << "); fractions against " << escape(a.half_type) << ".</p>\n";
  const Recommendation& r = a.recommendation;
  h << "<h2>Recommendation</h2>\n<ul>\n";
  for (const std::string& reason : r.reasons) h << "<li>" << escape(reason) << "</li>\n";
  h << "</ul>\n<pre>" << escape(r.command) << "</pre>\n";

  h << "<h2>Per layer</h2>\n<table><tr><th>layer</th><th>weights</th><th>activations</th>"
       "<th>gradients</th><th>largest |activation|</th><th>updates lost</th></tr>\n";
  for (const LayerAdvice& l : a.layers)
    h << "<tr><td>" << escape(l.name) << "</td><td>"
      << (l.weights ? fractions_cells(*l.weights) : "-") << "</td><td>"
      << fractions_cells(l.activations) << "</td><td>" << fractions_cells(l.gradients)
      << "</td><td>" << sci(l.activation_max) << "</td><td>"
      << (l.updates_lost ? percent(*l.updates_lost) : "-") << "</td></tr>\n";
  h << "</table>\n<p>Each cell: overflow / flush to zero / subnormal, of all values seen; "
       "gradients at loss scale 1.</p>\n";

  // The gradients against the loss scale: what overflows and what flushes to zero at each 2^k.
  h << "<h2>Gradients against the loss scale</h2>\n";
  html::LineChart chart;
  html::LineSeries over{"overflow", "#e15759", {}, {}}, under{"flushed to zero", "#4e79a7", {}, {}};
  for (int k = kMinScaleExp; k <= kMaxScaleExp; ++k) {
    const size_t i = static_cast<size_t>(k - kMinScaleExp);
    over.x.push_back(k);
    over.y.push_back(a.overflow_at_scale[i]);
    under.x.push_back(k);
    under.y.push_back(a.underflow_at_scale[i]);
  }
  chart.series = {under, over};
  chart.y_min = 0;
  chart.y_max = 1;
  chart.x_label = [](double k) { return "2^" + std::to_string(static_cast<int>(k)); };
  chart.y_label = [](double f) { return percent(f); };
  h << html::line_chart(chart);
  if (a.loss_scale_min)
    h << "<p>Loss scales that keep the gradients representable: " << pow2(*a.loss_scale_min)
      << " to " << pow2(*a.loss_scale_max) << ".</p>\n";

  if (v) {
    h << "<h2>Verification</h2>\n<ul>\n";
    for (const VerifyRun& run : v->runs) h << "<li>" << escape(verify_line(run)) << "</li>\n";
    h << "</ul>\n";
    html::LineChart losses;
    const char* colours[] = {"#4e79a7", "#59a14f", "#e15759"};
    for (size_t i = 0; i < v->runs.size(); ++i) {
      html::LineSeries s{v->runs[i].label, colours[i % 3], {}, {}};
      for (size_t k = 0; k < v->runs[i].losses.size(); ++k) {
        s.x.push_back(static_cast<double>(k + 1));
        s.y.push_back(v->runs[i].losses[k]);
      }
      losses.series.push_back(s);
    }
    h << html::line_chart(losses);
  }
  h << html::kPageEnd;
  return h.str();
}

}  // namespace mantissa::train
