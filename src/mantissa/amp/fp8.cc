#include "mantissa/amp/fp8.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mantissa/comm/communicator.h"
#include "mantissa/core/error.h"
#include "mantissa/io/json_fields.h"
#include "mantissa/nn/layers.h"
#include "mantissa/nn/module.h"
#include "mantissa/nn/numerics.h"

namespace mantissa::amp {
namespace {

using json = nlohmann::json;

const char* kRoles[] = {"input", "weight", "grad_output"};

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& n : v) s += (s.empty() ? "" : ",") + n;
  return s;
}

bool is_matrix_layer(const nn::Module& m) {
  return dynamic_cast<const nn::Conv2d*>(&m) != nullptr ||
         dynamic_cast<const nn::Linear*>(&m) != nullptr;
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

}  // namespace

const char* fp8_scaling_name(Fp8Scaling s) {
  return s == Fp8Scaling::kDelayed ? "delayed" : "current";
}

const char* fp8_amax_algo_name(Fp8AmaxAlgo a) {
  return a == Fp8AmaxAlgo::kMax ? "max" : "most-recent";
}

std::string Fp8Recipe::describe() const {
  std::ostringstream os;
  os << "inputs and weights " << dtype_name(forward)
     << " (copied from the f32 parameters each step), output gradients " << dtype_name(backward)
     << ", " << fp8_scaling_name(scaling) << " scaling";
  if (scaling == Fp8Scaling::kDelayed)
    os << " (amax history " << amax_history << ", " << fp8_amax_algo_name(amax_algo) << ", margin "
       << margin << ")";
  else if (margin != 0)
    os << " (margin " << margin << ")";
  os << ", " << (keep.empty() ? std::string("none") : joined(keep)) << " kept in bf16";
  return os.str();
}

Fp8Recipe make_fp8_recipe(DType backward, const std::string& scaling, int64_t amax_history,
                          const std::string& amax_algo, int64_t margin,
                          const std::vector<std::string>& keep) {
  Fp8Recipe r;
  r.backward = backward;
  if (scaling == "delayed")
    r.scaling = Fp8Scaling::kDelayed;
  else if (scaling == "current")
    r.scaling = Fp8Scaling::kCurrent;
  else
    throw Error("--fp8-scaling '" + scaling + "' is not valid",
                "use delayed (the default: the scale from the amax history) or current (from "
                "each tensor's own amax)");
  MANTISSA_CHECK(amax_history >= 1 && amax_history <= 65536,
                 "--fp8-amax-history must lie in [1, 65536], not " + std::to_string(amax_history),
                 "Transformer Engine's default is 1024");
  r.amax_history = amax_history;
  if (amax_algo == "max")
    r.amax_algo = Fp8AmaxAlgo::kMax;
  else if (amax_algo == "most-recent")
    r.amax_algo = Fp8AmaxAlgo::kMostRecent;
  else
    throw Error("--fp8-amax-algo '" + amax_algo + "' is not valid", "use max or most-recent");
  MANTISSA_CHECK(margin >= 0 && margin <= 64,
                 "--fp8-margin must lie in [0, 64], not " + std::to_string(margin),
                 "the scale is divided by 2^margin: 0 (the default) uses the format's whole range");
  r.margin = static_cast<int>(margin);
  r.keep.clear();
  for (const std::string& k : keep) {
    MANTISSA_CHECK(!k.empty(), "--fp8-keep-layers has an empty name",
                   "list first, last, none or module paths separated by commas");
    if (k == "none") {
      MANTISSA_CHECK(keep.size() == 1, "--fp8-keep-layers none cannot be combined with names",
                     "give none alone (every linear and conv2d in FP8), or the names");
      continue;
    }
    MANTISSA_CHECK(std::find(r.keep.begin(), r.keep.end(), k) == r.keep.end(),
                   "--fp8-keep-layers names '" + k + "' twice", "name each module once");
    r.keep.push_back(k);
  }
  return r;
}

float fp8_history_amax(const std::vector<float>& history, Fp8AmaxAlgo algo) {
  MANTISSA_ASSERT(!history.empty(), "an amax history holds at least one step");
  if (algo == Fp8AmaxAlgo::kMostRecent) return history[0];
  float m = history[0];
  for (float a : history) {
    if (std::isnan(a)) return a;  // as torch.max: a NaN anywhere keeps the scale
    m = std::max(m, a);
  }
  return m;
}

float fp8_scale_for(float amax, float fmax, int margin, float previous) {
  if (!(std::isfinite(amax) && amax > 0)) return previous;
  const float s = fmax / amax / std::ldexp(1.0f, margin);
  return std::isfinite(s) && s > 0 ? s : previous;
}

// ---- One tensor ----

Fp8TensorState::Fp8TensorState(const Fp8Recipe& recipe, DType format)
    : recipe_(recipe),
      format_(format),
      fmax_(kernels::fp8_max(format)),
      history_(static_cast<size_t>(recipe.amax_history), 0.0f) {}

bool Fp8TensorState::needs_amax() const { return recipe_.scaling == Fp8Scaling::kCurrent; }

float Fp8TensorState::scale(float amax) const {
  if (recipe_.scaling == Fp8Scaling::kDelayed) return scale_;
  return fp8_scale_for(amax, fmax_, recipe_.margin, scale_);
}

void Fp8TensorState::record(const kernels::QuantizeStats& stats, float scale) {
  history_[0] = std::max(history_[0], stats.amax);  // amaxes are never NaN (quantize.h)
  step_.merge(stats);
  used_ = scale;
  // Current scaling keeps the scale it used: a tensor whose amax is zero or not finite is
  // quantized with the last one.
  if (recipe_.scaling == Fp8Scaling::kCurrent) scale_ = scale;
}

void Fp8TensorState::end_step() {
  if (recipe_.scaling == Fp8Scaling::kDelayed)
    scale_ =
        fp8_scale_for(fp8_history_amax(history_, recipe_.amax_algo), fmax_, recipe_.margin, scale_);
  std::rotate(history_.begin(), history_.begin() + 1, history_.end());
  history_[0] = 0.0f;
  last_ = step_;
  step_ = {};
  last_used_ = used_;
}

void Fp8TensorState::restore(float scale, std::vector<float> history) {
  scale_ = scale;
  history_ = std::move(history);
}

// ---- The model's tensors ----

Fp8State::Fp8State(const Fp8Recipe& recipe, nn::Module& model) : recipe_(recipe) {
  std::vector<std::pair<std::string, nn::Module*>> layers;
  for (auto& [path, m] : model.named_modules())
    if (is_matrix_layer(*m)) layers.emplace_back(path, m);
  for (const std::string& k : recipe_.keep) {
    if (k == "first" || k == "last") {
      if (!layers.empty())
        kept_.push_back(k == "first" ? layers.front().first : layers.back().first);
      continue;
    }
    try {
      model.submodule(k);
    } catch (const Error& e) {
      throw Error(
          "--fp8-keep-layers names a module '" + k + "' that " + model.type() + " does not have",
          e.hint() + ", or first, last, none");
    }
    kept_.push_back(k);
  }
  for (auto& [path, m] : layers)
    if (!is_kept(path) && !m->precision()) add(path);
}

bool Fp8State::is_kept(const std::string& path) const {
  for (const std::string& k : kept_)
    if (path == k ||
        (path.size() > k.size() && path.compare(0, k.size(), k) == 0 && path[k.size()] == '.'))
      return true;
  return false;
}

ops::Fp8OpScaling Fp8State::add(const std::string& path) {
  const std::string prefix = path.empty() ? "" : path + ".";
  ops::Fp8OpScaling sc;
  auto make = [&](const char* role, DType format) {
    auto t = std::make_shared<Fp8TensorState>(recipe_, format);
    tensors_[prefix + role] = t;
    return t;
  };
  sc.input = make(kRoles[0], recipe_.forward);
  sc.weight = make(kRoles[1], recipe_.forward);
  sc.grad_output = make(kRoles[2], recipe_.backward);
  modules_[path] = sc;
  return sc;
}

std::optional<ops::Fp8OpScaling> Fp8State::scaling(const std::string& path) {
  const auto it = modules_.find(path);
  if (it != modules_.end()) return it->second;
  if (is_kept(path)) return std::nullopt;
  return add(path);
}

void Fp8State::reduce_amax(comm::Communicator& group) {
  std::vector<float> amax;
  amax.reserve(tensors_.size());
  for (auto& [name, t] : tensors_) amax.push_back(t->history()[0]);
  if (amax.empty() || group.size() == 1) return;
  group.all_reduce(amax.data(), amax.size(), DType::f32, comm::ReduceOp::kMax);
  size_t i = 0;
  for (auto& [name, t] : tensors_) t->set_step_amax(amax[i++]);
}

void Fp8State::end_step(int64_t step, nn::NumericsRecorder* numerics) {
  for (auto& [name, t] : tensors_) {
    const float amax = t->history()[0];
    t->end_step();
    if (!numerics) continue;
    const kernels::QuantizeStats& s = t->last_step_stats();
    const double n = static_cast<double>(std::max<int64_t>(s.count, 1));
    numerics->record_fp8(
        name, t->format(),
        {step, amax, t->last_scale_used(), t->current_scale(), static_cast<double>(s.saturated) / n,
         static_cast<double>(s.flushed) / n});
  }
}

std::vector<Fp8TensorReport> Fp8State::report() const {
  std::vector<Fp8TensorReport> out;
  for (auto& [name, t] : tensors_) {
    const kernels::QuantizeStats& s = t->last_step_stats();
    const double n = static_cast<double>(std::max<int64_t>(s.count, 1));
    out.push_back({name, t->format(), t->current_scale(), s.amax, s.count,
                   static_cast<double>(s.saturated) / n, static_cast<double>(s.flushed) / n});
  }
  return out;
}

std::string Fp8State::to_json() const {
  json j;
  j["forward"] = std::string(dtype_name(recipe_.forward));
  j["backward"] = std::string(dtype_name(recipe_.backward));
  j["scaling"] = fp8_scaling_name(recipe_.scaling);
  j["amax_history"] = recipe_.amax_history;
  j["amax_algo"] = fp8_amax_algo_name(recipe_.amax_algo);
  j["margin"] = recipe_.margin;
  j["keep"] = recipe_.keep;
  json tensors = json::object();
  for (auto& [name, t] : tensors_) {
    json h = json::array();
    for (float a : t->history()) h.push_back(bits(a));
    tensors[name] = {{"scale", bits(t->current_scale())}, {"amax_history", h}};
  }
  j["tensors"] = tensors;
  return j.dump();
}

void Fp8State::load_json(const std::string& text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(source + ": FP8 state is not valid JSON (" + e.what() + ")", "the file is damaged");
  }
  try {
    auto same = [&](const char* key, const std::string& here, const char* flag) {
      const std::string saved =
          j.at(key).is_string() ? j.at(key).get<std::string>() : j.at(key).dump();
      MANTISSA_CHECK(saved == here,
                     source + " was trained with " + flag + " " + saved + ", not " + here,
                     std::string("pass ") + flag + " " + saved + " to resume it");
    };
    same("forward", std::string(dtype_name(recipe_.forward)), "an FP8 forward format");
    same("backward", std::string(dtype_name(recipe_.backward)), "FP8 gradients in");
    same("scaling", fp8_scaling_name(recipe_.scaling), "--fp8-scaling");
    same("amax_history", std::to_string(recipe_.amax_history), "--fp8-amax-history");
    same("amax_algo", fp8_amax_algo_name(recipe_.amax_algo), "--fp8-amax-algo");
    same("margin", std::to_string(recipe_.margin), "--fp8-margin");
    const std::vector<std::string> keep = j.at("keep").get<std::vector<std::string>>();
    MANTISSA_CHECK(keep == recipe_.keep,
                   source + " was trained with --fp8-keep-layers " +
                       (keep.empty() ? std::string("none") : joined(keep)) + ", not " +
                       (recipe_.keep.empty() ? std::string("none") : joined(recipe_.keep)),
                   "pass --fp8-keep-layers " + (keep.empty() ? std::string("none") : joined(keep)) +
                       " to resume it");
    const json& tensors = j.at("tensors");
    for (auto& [name, t] : tensors_)
      MANTISSA_CHECK(tensors.contains(name), source + " holds no FP8 state for " + name,
                     "resume into the model the checkpoint was saved from");
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      const std::string& name = it.key();
      if (!tensors_.count(name)) {
        // A tensor of a module that calls linear or conv2d itself: made as its first use would.
        const size_t dot = name.rfind('.');
        const std::string module = dot == std::string::npos ? "" : name.substr(0, dot);
        if (!is_kept(module)) scaling(module);
      }
      MANTISSA_CHECK(tensors_.count(name),
                     source + " holds FP8 state for " + name + ", which this run does not scale",
                     "resume with the --fp8-keep-layers and model of the original run");
      // Floats are stored as their bit patterns: integers in [0, 2^32).
      const auto bits = [&](const json& v) {
        const std::optional<int64_t> x = io::json_integer(v, 0, UINT32_MAX);
        MANTISSA_CHECK(
            x.has_value(),
            source + ": the FP8 state of " + name + " holds a value that is not a 32-bit pattern",
            "the file is damaged");
        return std::bit_cast<float>(static_cast<uint32_t>(*x));
      };
      std::vector<float> h;
      for (const json& b : it.value().at("amax_history")) h.push_back(bits(b));
      MANTISSA_CHECK(static_cast<int64_t>(h.size()) == recipe_.amax_history,
                     source + ": the amax history of " + name + " has " + std::to_string(h.size()) +
                         " steps, not " + std::to_string(recipe_.amax_history),
                     "the file is damaged");
      const float scale = bits(it.value().at("scale"));
      MANTISSA_CHECK(std::isfinite(scale) && scale > 0,
                     source + ": the FP8 scale of " + name + " is not a finite positive number",
                     "the file is damaged");
      tensors_.at(name)->restore(scale, std::move(h));
    }
  } catch (const json::exception& e) {
    throw Error(source + ": FP8 state is not valid (" + e.what() + ")", "the file is damaged");
  }
}

// ---- Evaluation ----

namespace {

class FrozenTensor : public ops::Fp8Tensor {
 public:
  explicit FrozenTensor(std::shared_ptr<ops::Fp8Tensor> t) : t_(std::move(t)) {}
  DType format() const override { return t_->format(); }
  bool needs_amax() const override { return t_->needs_amax(); }
  float scale(float amax) const override { return t_->scale(amax); }
  void record(const kernels::QuantizeStats&, float) override {}

 private:
  std::shared_ptr<ops::Fp8Tensor> t_;
};

}  // namespace

std::optional<ops::Fp8OpScaling> Fp8Frozen::scaling(const std::string& path) {
  const auto it = modules_.find(path);
  if (it != modules_.end()) return it->second;
  std::optional<ops::Fp8OpScaling> live = state_.scaling(path);
  if (!live) return std::nullopt;
  ops::Fp8OpScaling frozen{std::make_shared<FrozenTensor>(live->input),
                           std::make_shared<FrozenTensor>(live->weight),
                           std::make_shared<FrozenTensor>(live->grad_output)};
  modules_[path] = frozen;
  return frozen;
}

}  // namespace mantissa::amp
