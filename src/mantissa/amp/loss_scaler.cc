#include "mantissa/amp/loss_scaler.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "mantissa/core/error.h"
#include "mantissa/io/json_fields.h"

namespace mantissa::amp {
namespace {

using json = nlohmann::json;

constexpr double kDefaultFloor = 5.9604644775390625e-08;  // 2^-24

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

LossScaler::LossScaler(const LossScalerOptions& o)
    : o_(o), scale_(o.init_scale), hysteresis_left_(o.hysteresis) {
  MANTISSA_CHECK(std::isfinite(o.init_scale) && o.init_scale > 0,
                 "loss scale " + num(o.init_scale) + " is not a positive number",
                 "use e.g. --loss-scaling 1024 or --loss-scaling dynamic");
  MANTISSA_CHECK(o.growth_factor > 1, "loss-scale growth factor must be above 1", "e.g. 2");
  MANTISSA_CHECK(o.backoff_factor > 0 && o.backoff_factor < 1,
                 "loss-scale backoff factor must lie in (0, 1)", "e.g. 0.5");
  MANTISSA_CHECK(o.growth_interval > 0, "loss-scale growth interval must be positive", "e.g. 2000");
  MANTISSA_CHECK(o.hysteresis >= 1, "loss-scale hysteresis must be at least 1", "1 disables it");
  MANTISSA_CHECK(!o.min_scale || *o.min_scale > 0, "minimum loss scale must be positive", "e.g. 1");
  MANTISSA_CHECK(!o.min_scale || !o.max_scale || *o.min_scale <= *o.max_scale,
                 "minimum loss scale " + num(*o.min_scale) + " is above the maximum " +
                     num(o.max_scale.value_or(0)),
                 "swap them");
  if (o.dynamic) {
    if (o.max_scale) scale_ = std::min(scale_, *o.max_scale);
    if (o.min_scale) scale_ = std::max(scale_, *o.min_scale);
  }
}

float LossScaler::inverse_scale() const { return static_cast<float>(1.0 / scale_); }

double LossScaler::floor() const { return o_.min_scale.value_or(kDefaultFloor); }

bool LossScaler::update(bool found_inf, const std::vector<std::string>& offenders) {
  ++steps_;
  if (!found_inf) {
    if (!o_.dynamic) return false;
    if (++growth_tracker_ >= o_.growth_interval) {
      growth_tracker_ = 0;
      hysteresis_left_ = o_.hysteresis;
      double next = scale_ * o_.growth_factor;
      if (o_.max_scale) next = std::min(next, *o_.max_scale);
      // Growing past FP32's range would make every scaled loss inf.
      if (std::isfinite(static_cast<float>(next)) && next != scale_) {
        scale_ = next;
        history_.push_back({steps_, scale_, false});
      }
    }
    return false;
  }
  ++skipped_;
  growth_tracker_ = 0;
  auto diagnosis = [&](const std::string& what) {
    std::string names;
    for (size_t i = 0; i < offenders.size() && i < 8; ++i) names += (i ? ", " : "") + offenders[i];
    if (offenders.size() > 8) names += " and " + std::to_string(offenders.size() - 8) + " more";
    return what + " at optimizer step " + std::to_string(steps_) + ": inf/NaN gradients in " +
           (names.empty() ? std::string("(no parameter named)") : names) + "; " +
           std::to_string(skipped_) + " of " + std::to_string(steps_) + " steps skipped";
  };
  if (!o_.dynamic) {
    // A static scale cannot adapt: skipping is right for a rare overflow, but a run that skips
    // every step learns nothing.
    MANTISSA_CHECK(skipped_ < 100 || skipped_ * 2 < steps_,
                   diagnosis("static loss scale " + num(scale_) + " overflows"),
                   "lower --loss-scaling, use --loss-scaling dynamic, or find the op that makes "
                   "inf/NaN with --detect-anomaly");
    return true;
  }
  if (hysteresis_left_ > 1) {
    --hysteresis_left_;
    return true;
  }
  MANTISSA_CHECK(scale_ > floor(),
                 diagnosis("loss scale at its minimum " + num(floor()) + " and still overflowing"),
                 "the inf/NaN does not come from scaling: lower --lr, set --max-grad-norm, keep "
                 "the named layers in FP32 with --keep-fp32, or find the op with "
                 "--detect-anomaly");
  scale_ = std::max(scale_ * o_.backoff_factor, floor());
  history_.push_back({steps_, scale_, true});
  return true;
}

std::string LossScaler::to_json() const {
  json j;
  j["dynamic"] = o_.dynamic;
  j["scale"] = scale_;
  j["growth_factor"] = o_.growth_factor;
  j["backoff_factor"] = o_.backoff_factor;
  j["growth_interval"] = o_.growth_interval;
  j["min_scale"] = o_.min_scale ? json(*o_.min_scale) : json(nullptr);
  j["max_scale"] = o_.max_scale ? json(*o_.max_scale) : json(nullptr);
  j["hysteresis"] = o_.hysteresis;
  j["hysteresis_left"] = hysteresis_left_;
  j["growth_tracker"] = growth_tracker_;
  j["steps"] = steps_;
  j["skipped_steps"] = skipped_;
  json h = json::array();
  for (const ScaleChange& c : history_)
    h.push_back({{"step", c.step}, {"scale", c.scale}, {"overflow", c.overflow}});
  j["history"] = h;
  return j.dump();
}

void LossScaler::load_json(const std::string& text, const std::string& source) {
  try {
    const json j = json::parse(text);
    // A counter or interval of the file: an integer in [lo, hi], never cast from a float.
    const auto integer = [&](const json& v, const char* name, int64_t lo) {
      const std::optional<int64_t> x = io::json_integer(v, lo, INT64_MAX);
      MANTISSA_CHECK(x.has_value(),
                     source + ": loss-scaler field '" + name + "' is not an integer of at least " +
                         std::to_string(lo),
                     "the file is damaged");
      return *x;
    };
    LossScalerOptions o;
    o.dynamic = j.at("dynamic").get<bool>();
    o.init_scale = j.at("scale").get<double>();
    o.growth_factor = j.at("growth_factor").get<double>();
    o.backoff_factor = j.at("backoff_factor").get<double>();
    o.growth_interval = integer(j.at("growth_interval"), "growth_interval", 1);
    if (!j.at("min_scale").is_null()) o.min_scale = j["min_scale"].get<double>();
    if (!j.at("max_scale").is_null()) o.max_scale = j["max_scale"].get<double>();
    o.hysteresis = integer(j.at("hysteresis"), "hysteresis", 1);
    LossScaler s(o);
    s.scale_ = o.init_scale;
    s.hysteresis_left_ = integer(j.at("hysteresis_left"), "hysteresis_left", 1);
    s.growth_tracker_ = integer(j.at("growth_tracker"), "growth_tracker", 0);
    s.steps_ = integer(j.at("steps"), "steps", 0);
    s.skipped_ = integer(j.at("skipped_steps"), "skipped_steps", 0);
    for (const json& c : j.at("history"))
      s.history_.push_back({integer(c.at("step"), "history step", 0), c.at("scale").get<double>(),
                            c.at("overflow").get<bool>()});
    MANTISSA_CHECK(s.steps_ >= s.skipped_ && s.hysteresis_left_ <= o.hysteresis,
                   source + ": loss-scaler counters are inconsistent", "the file is damaged");
    *this = std::move(s);
  } catch (const json::exception& e) {
    throw Error(source + ": loss-scaler state is not valid (" + e.what() + ")",
                "the file is damaged");
  }
}

std::optional<LossScalerOptions> parse_loss_scaling(const std::string& text) {
  if (text == "none" || text == "off") return std::nullopt;
  LossScalerOptions o;
  if (text == "dynamic") return o;
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used == text.size() && std::isfinite(v) && v > 0) {
      check_loss_scale(v, "--loss-scaling " + excerpt(text));
      o.dynamic = false;
      o.init_scale = v;
      return o;
    }
  } catch (const std::invalid_argument&) {
  } catch (const std::out_of_range&) {
  }
  throw Error("--loss-scaling '" + excerpt(text) + "' is not valid",
              "use none, dynamic, or a positive number such as 1024");
}

void check_loss_scale(double v, const std::string& what) {
  MANTISSA_CHECK(v >= static_cast<double>(std::numeric_limits<float>::min()) &&
                     v <= static_cast<double>(std::numeric_limits<float>::max()),
                 what +
                     " is outside the range of a loss scale: it and its inverse must be finite "
                     "and nonzero in FP32 (1.2e-38 to 3.4e38)",
                 "loss scales are usually powers of two from 1 to 2^24, e.g. 65536");
}

}  // namespace mantissa::amp
