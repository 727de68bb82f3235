#include "mantissa/nn/numerics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mantissa/autograd/autograd.h"
#include "mantissa/core/error.h"
#include "mantissa/io/html.h"
#include "mantissa/kernels/quantize.h"
#include "mantissa/nn/module.h"

namespace mantissa::nn {
namespace {

thread_local NumericsRecorder* t_recorder = nullptr;
using Json = nlohmann::json;

std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g%%", 100 * f);
  return buf;
}

}  // namespace

void Log2Histogram::add(const Tensor& t, double scale) {
  if (!t.defined() || !is_floating(t.dtype())) return;
  const float s = static_cast<float>(scale);
  for (float v : t.to_float_vector()) {
    ++count;
    const float a = std::fabs(v * s);
    if (!std::isfinite(a)) {
      ++nonfinite;
      continue;
    }
    if (a == 0) {
      ++zeros;
      continue;
    }
    int e = 0;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
    const int b = std::clamp(e - 1, kMinExp, kMaxExp);
    ++bins[static_cast<size_t>(b - kMinExp)];
    fp16_overflow += a >= 65520.0f;
    max_abs = std::max(max_abs, static_cast<double>(a));
  }
}

void Log2Histogram::merge(const Log2Histogram& o) {
  for (size_t i = 0; i < bins.size(); ++i) bins[i] += o.bins[i];
  zeros += o.zeros;
  nonfinite += o.nonfinite;
  count += o.count;
  fp16_overflow += o.fp16_overflow;
  max_abs = std::max(max_abs, o.max_abs);
}

double Log2Histogram::fraction_at_least(int e) const {
  int64_t n = 0;
  for (int b = std::max(e, kMinExp); b <= kMaxExp; ++b) n += bins[static_cast<size_t>(b - kMinExp)];
  return count > 0 ? static_cast<double>(n) / static_cast<double>(count) : 0;
}

double Log2Histogram::fraction_below(int e) const {
  int64_t n = 0;
  for (int b = kMinExp; b < std::min(e, kMaxExp + 1); ++b)
    n += bins[static_cast<size_t>(b - kMinExp)];
  return count > 0 ? static_cast<double>(n) / static_cast<double>(count) : 0;
}

RangeFractions range_fractions(const Log2Histogram& h, const FormatRange& f) {
  RangeFractions r;
  r.overflow =
      f.overflow_exp == kFp16Range.overflow_exp
          ? (h.count > 0 ? static_cast<double>(h.fp16_overflow) / static_cast<double>(h.count) : 0)
          : h.fraction_at_least(f.overflow_exp);
  r.underflow = h.fraction_below(f.zero_exp);
  r.subnormal = h.fraction_below(f.normal_exp) - r.underflow;
  return r;
}

void NumericsRecorder::record(const std::string& layer, const std::string& kind, const Tensor& t,
                              double scale) {
  NumericsEntry& e = entries_[{layer, kind}];
  if (e.layer.empty()) {
    e.layer = layer;
    e.kind = kind;
    e.dtype = std::string(dtype_name(t.dtype()));
  }
  e.histogram.add(t, scale);
}

void NumericsRecorder::record_parameter_gradients(Module& model, double loss_scale) {
  for (auto& p : model.named_parameters()) {
    const Tensor g = p.tensor->grad();
    if (g.defined()) record(p.name, "weight_gradient", g, 1.0 / loss_scale);
  }
}

void NumericsRecorder::record_fp8(const std::string& tensor, DType format, const Fp8Sample& s) {
  Fp8Series& series = fp8_[tensor];
  series.tensor = tensor;
  series.format = format;
  series.samples.push_back(s);
}

Log2Histogram NumericsRecorder::merged(const std::string& kind) const {
  Log2Histogram h;
  for (auto& [key, e] : entries_)
    if (e.kind == kind) h.merge(e.histogram);
  return h;
}

NumericsRecorder::ScaleAdvice NumericsRecorder::suggested_loss_scale() const {
  Log2Histogram g = merged("activation_gradient");
  g.merge(merged("weight_gradient"));
  ScaleAdvice a;
  a.underflow_unscaled = range_fractions(g, kFp16Range).underflow;
  if (g.max_abs > 0) {
    // S * max < 65504 with S a power of two.
    a.scale = std::exp2(std::floor(std::log2(65504.0 / g.max_abs)));
    if (a.scale * g.max_abs >= 65504.0) a.scale /= 2;
  }
  // At scale S = 2^k every value moves up k bins: those below 2^(-25 - k) still flush.
  const int k = static_cast<int>(std::lround(std::log2(a.scale)));
  a.underflow_at_scale = g.fraction_below(kFp16Range.zero_exp - k);
  return a;
}

std::string NumericsRecorder::json() const {
  Json j;
  j["steps_recorded"] = steps_;
  j["ranges"] = Json::array();
  for (const FormatRange& f : {kFp16Range, kBf16Range})
    j["ranges"].push_back({{"format", f.name},
                           {"overflow_at_or_above_log2", f.overflow_exp},
                           {"zero_below_log2", f.zero_exp},
                           {"subnormal_below_log2", f.normal_exp}});
  j["entries"] = Json::array();
  for (auto& [key, e] : entries_) {
    const Log2Histogram& h = e.histogram;
    Json bins = Json::object();
    for (int b = Log2Histogram::kMinExp; b <= Log2Histogram::kMaxExp; ++b)
      if (const int64_t n = h.bins[static_cast<size_t>(b - Log2Histogram::kMinExp)])
        bins[std::to_string(b)] = n;
    Json entry = {{"layer", e.layer},     {"kind", e.kind},        {"dtype", e.dtype},
                  {"count", h.count},     {"zeros", h.zeros},      {"nonfinite", h.nonfinite},
                  {"max_abs", h.max_abs}, {"log2_histogram", bins}};
    for (const FormatRange& f : {kFp16Range, kBf16Range}) {
      const RangeFractions r = range_fractions(h, f);
      entry[f.name] = {
          {"overflow", r.overflow}, {"underflow", r.underflow}, {"subnormal", r.subnormal}};
    }
    j["entries"].push_back(entry);
  }
  if (!fp8_.empty()) {
    // FP32 values that may be infinite (an amax) as JSON numbers or null.
    auto num = [](float v) { return std::isfinite(v) ? Json(v) : Json(nullptr); };
    j["fp8"] = Json::array();
    for (auto& [name, series] : fp8_) {
      Json steps = Json::array(), amax = Json::array(), scale = Json::array(), next = Json::array(),
           sat = Json::array(), flushed = Json::array();
      for (const Fp8Sample& x : series.samples) {
        steps.push_back(x.step);
        amax.push_back(num(x.amax));
        scale.push_back(num(x.scale));
        next.push_back(num(x.next_scale));
        sat.push_back(x.saturated);
        flushed.push_back(x.flushed);
      }
      j["fp8"].push_back({{"tensor", name},
                          {"format", std::string(dtype_name(series.format))},
                          {"format_max", kernels::fp8_max(series.format)},
                          {"step", steps},
                          {"amax", amax},
                          {"scale", scale},
                          {"next_scale", next},
                          {"saturated", sat},
                          {"flushed", flushed}});
    }
  }
  const ScaleAdvice a = suggested_loss_scale();
  j["suggested_loss_scale"] = {{"scale", a.scale},
                               {"fp16_gradient_underflow_unscaled", a.underflow_unscaled},
                               {"fp16_gradient_underflow_at_scale", a.underflow_at_scale}};
  return j.dump(2) + "\n";
}

std::string NumericsRecorder::html(const std::string& title) const {
  std::ostringstream h;
  // The title and the layers' names come from the model (a user's module may be named anything):
  // escaped.
  h << io::html::page_start("Mantissa numerics: " + title)
    << "<h1>Numerics: " << io::html::escape(title) << "</h1>\n<p>" << steps_
    << (steps_ == 1 ? " recorded step" : " recorded steps")
    << ". Log2 histograms of the magnitudes; "
    << "the shaded band is FP16's normal range, the lighter one its subnormals; values left of "
       "it flush to zero in FP16, values right of it overflow.</p>\n";
  const ScaleAdvice a = suggested_loss_scale();
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "<p><b>Suggested loss scale: %g</b> (the largest power of two that keeps every "
                "gradient seen finite in FP16). Gradients flushing to zero in FP16: %s unscaled, "
                "%s at that scale.</p>\n",
                a.scale, pct(a.underflow_unscaled).c_str(), pct(a.underflow_at_scale).c_str());
  h << buf;
  // One chart per kind, all layers merged (the paper's figure).
  for (const char* kind : {"activation_gradient", "weight_gradient", "activation"}) {
    const Log2Histogram m = merged(kind);
    if (m.count == 0) continue;
    int lo = Log2Histogram::kMaxExp, hi = Log2Histogram::kMinExp;
    for (int b = Log2Histogram::kMinExp; b <= Log2Histogram::kMaxExp; ++b)
      if (m.bins[static_cast<size_t>(b - Log2Histogram::kMinExp)]) lo = std::min(lo, b), hi = b;
    lo = std::min(lo, -30);
    hi = std::max(hi, 17);
    int64_t top = 1;
    for (int b = lo; b <= hi; ++b)
      top = std::max(top, m.bins[static_cast<size_t>(b - Log2Histogram::kMinExp)]);
    const double W = 8, H = 160, L = 50, T = 10;
    auto X = [&](int e) { return L + W * (e - lo); };
    h << "<h2>" << kind << "s (" << m.count << " values, " << pct(double(m.zeros) / m.count)
      << " zero)</h2>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << X(hi + 1) + 20
      << "\" height=\"" << H + 50 << "\">\n";
    h << "<rect x=\"" << X(kFp16Range.zero_exp) << "\" y=\"" << T << "\" width=\""
      << X(kFp16Range.normal_exp) - X(kFp16Range.zero_exp) << "\" height=\"" << H
      << "\" fill=\"#eef4ea\"/><rect x=\"" << X(kFp16Range.normal_exp) << "\" y=\"" << T
      << "\" width=\"" << X(kFp16Range.overflow_exp) - X(kFp16Range.normal_exp) << "\" height=\""
      << H << "\" fill=\"#d5e8cc\"/>\n";
    for (int b = lo; b <= hi; ++b) {
      const int64_t n = m.bins[static_cast<size_t>(b - Log2Histogram::kMinExp)];
      if (!n) continue;
      const double bh = H * static_cast<double>(n) / static_cast<double>(top);
      h << "<rect x=\"" << X(b) + 1 << "\" y=\"" << T + H - bh << "\" width=\"" << W - 2
        << "\" height=\"" << bh << "\" fill=\"#4e79a7\"><title>2^" << b << ": " << n
        << "</title></rect>\n";
    }
    for (int b = lo; b <= hi; ++b)
      if (b % 8 == 0)
        h << "<text x=\"" << X(b) << "\" y=\"" << T + H + 16 << "\" font-size=\"11\">2^" << b
          << "</text>\n";
    h << "<text x=\"" << X(kFp16Range.zero_exp) << "\" y=\"" << T + H + 34
      << "\" font-size=\"11\" fill=\"#383\">FP16 zero below 2^-25</text><text x=\""
      << X(kFp16Range.overflow_exp) - 60 << "\" y=\"" << T + H + 34
      << "\" font-size=\"11\" fill=\"#383\">inf from 65520</text>\n</svg>\n";
  }
  h << "<h2>By layer</h2>\n<table><tr><th>layer</th><th>values</th><th>stored</th><th>max "
       "|x|</th><th>FP16 overflow</th><th>FP16 zero</th><th>FP16 subnormal</th><th>BF16 "
       "zero</th></tr>\n";
  for (const char* kind : {"activation", "activation_gradient", "weight_gradient"}) {
    h << "<tr><th colspan=\"8\">" << kind << "s</th></tr>\n";
    for (auto& [key, e] : entries_) {
      if (e.kind != kind) continue;
      const RangeFractions f16 = range_fractions(e.histogram, kFp16Range);
      const RangeFractions b16 = range_fractions(e.histogram, kBf16Range);
      std::snprintf(buf, sizeof buf, "%.3g", e.histogram.max_abs);
      h << "<tr><td>" << io::html::escape(e.layer) << "</td><td>" << e.histogram.count
        << "</td><td>" << e.dtype << "</td><td>" << buf << "</td><td>" << pct(f16.overflow)
        << "</td><td>" << pct(f16.underflow) << "</td><td>" << pct(f16.subnormal) << "</td><td>"
        << pct(b16.underflow) << "</td></tr>\n";
    }
  }
  h << "</table>\n" << fp8_html() << io::html::kPageEnd;
  return h.str();
}

std::string NumericsRecorder::fp8_html() const {
  if (fp8_.empty()) return {};
  std::ostringstream h;
  h << "<h2>FP8 scaling</h2>\n<p>Each tensor quantized to FP8 at the recorded steps: "
       "<span style=\"color:#4e79a7\">its amax</span> and <span style=\"color:#e15759\">the "
       "largest magnitude its scale lets through</span> (format max / scale), in powers of two. "
       "Where the amax passes the limit, values saturate; the gap below it is range left unused "
       "at the bottom, where small values flush to zero.</p>\n<table><tr><th>tensor</th><th>format"
       "</th><th>last amax</th><th>last scale</th><th>saturated (max)</th><th>flushed (max)</th>"
       "<th>amax and limit by step</th></tr>\n";
  char buf[64];
  for (auto& [name, series] : fp8_) {
    const double fmax = kernels::fp8_max(series.format);
    io::html::LineSeries amax{"amax", "#4e79a7", {}, {}, false},
        limit{"format max / scale", "#e15759", {}, {}, true};
    double sat = 0, flushed = 0;
    for (const Fp8Sample& x : series.samples) {
      amax.x.push_back(static_cast<double>(x.step));
      amax.y.push_back(x.amax);  // an amax of zero or inf is left out of the chart
      limit.x.push_back(static_cast<double>(x.step));
      limit.y.push_back(fmax / x.scale);
      sat = std::max(sat, x.saturated);
      flushed = std::max(flushed, x.flushed);
    }
    io::html::LineChart chart;
    chart.log2_y = true;
    chart.series = {limit, amax};
    const Fp8Sample& last = series.samples.back();
    h << "<tr><td>" << io::html::escape(name) << "</td><td>" << dtype_name(series.format)
      << "</td>";
    std::snprintf(buf, sizeof buf, "%.4g", last.amax);
    h << "<td>" << buf << "</td>";
    std::snprintf(buf, sizeof buf, "%.4g", last.next_scale);
    h << "<td>" << buf << "</td><td>" << pct(sat) << "</td><td>" << pct(flushed) << "</td><td>"
      << io::html::line_chart(chart) << "</td></tr>\n";
  }
  h << "</table>\n";
  return h.str();
}

NumericsScope::NumericsScope(NumericsRecorder& r, double gradient_scale) : previous_(t_recorder) {
  t_recorder = &r;
  r.gradient_scale_ = gradient_scale;
}
NumericsScope::~NumericsScope() { t_recorder = previous_; }
NumericsRecorder* numerics_recorder() { return t_recorder; }

}  // namespace mantissa::nn
