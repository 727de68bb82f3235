#include "mantissa/train/report_html.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "mantissa/core/error.h"
#include "mantissa/core/memory.h"
#include "mantissa/io/html.h"

namespace mantissa::train {
namespace {

using json = nlohmann::json;
namespace html = io::html;

// The charts' colours (the memory categories keep theirs, html::category_colour).
constexpr const char* kBlue = "#4e79a7";
constexpr const char* kOrange = "#f28e2b";
constexpr const char* kGreen = "#59a14f";
constexpr const char* kRed = "#e15759";
constexpr const char* kPurple = "#b07aa1";

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string percent(double fraction) { return fmt("%.2f%%", 100 * fraction); }

// A JSON pointer's reference token for an object key (RFC 6901: ~ and / escaped).
std::string pointer_token(const std::string& key) {
  std::string t;
  for (char ch : key) t += ch == '~' ? "~0" : ch == '/' ? "~1" : std::string(1, ch);
  return t;
}

// Replaces every array of more than kReportMaxPoints numbers inside `v` (at `pointer`) by the
// means of groups of k consecutive values, and records {group: k, count: n} in `thinned`.
void thin(json& v, const std::string& pointer, json& thinned) {
  if (v.is_object()) {
    for (auto it = v.begin(); it != v.end(); ++it)
      thin(it.value(), pointer + "/" + pointer_token(it.key()), thinned);
    return;
  }
  if (!v.is_array()) return;
  const bool numbers = std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number(); });
  if (!numbers || v.size() <= kReportMaxPoints) {
    for (size_t i = 0; i < v.size(); ++i) thin(v[i], pointer + "/" + std::to_string(i), thinned);
    return;
  }
  const size_t n = v.size(), k = (n + kReportMaxPoints - 1) / kReportMaxPoints;
  json means = json::array();
  for (size_t lo = 0; lo < n; lo += k) {
    const size_t hi = std::min(n, lo + k);
    double sum = 0;
    for (size_t i = lo; i < hi; ++i) sum += v[i].get<double>();
    means.push_back(sum / static_cast<double>(hi - lo));
  }
  thinned[pointer] = {{"group", k}, {"count", n}};
  v = std::move(means);
}

// The page's data: what it draws, and what it embeds.
class Data {
 public:
  explicit Data(json j) : j_(std::move(j)) {
    json thinned = json::object();
    thin(j_, "", thinned);
    if (!thinned.empty()) j_["thinned"] = thinned;
  }
  const json& json_value() const { return j_; }
  const json& operator[](const char* key) const { return j_.at(key); }

  // A series' length before thinning, and its group size (1: not thinned).
  size_t count(const std::string& pointer) const {
    const json* t = thinned(pointer);
    return t ? t->at("count").get<size_t>() : j_.at(json::json_pointer(pointer)).size();
  }
  size_t group(const std::string& pointer) const {
    const json* t = thinned(pointer);
    return t ? t->at("group").get<size_t>() : 1;
  }

  // A per-step series as points: its first value is that of step `first`; a thinned group's
  // mean sits at the middle of its steps.
  html::LineSeries per_step(const std::string& pointer, double first, double y_scale = 1) const {
    html::LineSeries s;
    const json& a = j_.at(json::json_pointer(pointer));
    const size_t n = count(pointer), k = group(pointer);
    for (size_t g = 0; g < a.size(); ++g) {
      const size_t lo = g * k, hi = std::min(n, lo + k) - 1;
      s.x.push_back(first + static_cast<double>(lo + hi) / 2);
      s.y.push_back(a[g].get<double>() * y_scale);
    }
    return s;
  }

 private:
  const json* thinned(const std::string& pointer) const {
    const auto t = j_.find("thinned");
    if (t == j_.end() || !t->contains(pointer)) return nullptr;
    return &t->at(pointer);
  }
  json j_;
};

std::string value_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "-";
  return v.dump();
}

std::string bytes_text(const json& v) {
  return v.is_number() ? format_bytes(v.get<size_t>()) : "-";
}

std::array<size_t, kNumMemoryCategories> category_bytes(const json& by_name) {
  std::array<size_t, kNumMemoryCategories> b{};
  for (MemoryCategory c : kAllMemoryCategories) {
    const auto it = by_name.find(std::string(memory_category_name(c)));
    if (it != by_name.end() && it->is_number()) b[static_cast<size_t>(c)] = it->get<size_t>();
  }
  return b;
}

void row(std::ostringstream& h, const std::string& name, const std::string& value) {
  h << "<tr><td>" << html::escape(name) << "</td><td>" << html::escape(value) << "</td></tr>\n";
}

void summary(std::ostringstream& h, const Data& d) {
  const json& c = d["config"];
  const int64_t steps = d["steps"].get<int64_t>();
  h << "<table class=\"kv\">\n";
  row(h, "model", value_text(c.at("model")));
  row(h, "data",
      value_text(c.at("dataset")) +
          (c.at("image_size").is_null()
               ? ""
               : ", " + value_text(c.at("image_size")) + "x" + value_text(c.at("image_size"))) +
          ", batch " + value_text(c.at("batch_size")));
  row(h, "optimizer", value_text(c.at("optimizer")) + ", lr " + value_text(c.at("lr")));
  row(h, "steps",
      std::to_string(steps) + (d["interrupted"].get<bool>() ? " (interrupted)" : "") + " in " +
          std::to_string(d["epochs"].size()) + (d["epochs"].size() == 1 ? " epoch" : " epochs"));
  if (!d["epochs"].empty()) {
    const json& e = d["epochs"].back();
    row(h, "last epoch",
        "loss " + fmt("%.4f", e.at("loss").get<double>()) + ", train accuracy " +
            percent(e.at("train_accuracy").get<double>()));
  }
  row(h, "test accuracy",
      d["test_accuracy"].is_null()
          ? "not evaluated"
          : percent(d["test_accuracy"].get<double>()) + " (" +
                std::to_string(d["test_examples"].get<int64_t>()) + " images)");
  row(h, "speed",
      fmt("%.1f images/s", d["images_per_second"].get<double>()) + ", " +
          fmt("%.1f GFLOP/s", d["gflops_per_second"].get<double>()) + ", " +
          fmt("%.1f s training", d["train_seconds"].get<double>()) + ", " +
          fmt("%.2f s waiting for data", d["data_wait_seconds"].get<double>()));
  row(h, "peak memory", bytes_text(d["peak_memory_bytes"].at("total")));
  const json& ls = d["loss_scale"];
  row(h, "loss scale",
      ls.is_null() ? "none"
                   : fmt("%g", ls.at("final").get<double>()) + " at the end (" +
                         fmt("%g", ls.at("initial").get<double>()) + " at the start), " +
                         std::to_string(ls.at("skipped_steps").get<int64_t>()) + " skipped " +
                         (ls.at("skipped_steps").get<int64_t>() == 1 ? "step" : "steps"));
  h << "</table>\n";
}

void charts(std::ostringstream& h, const Data& d) {
  const double steps = d["steps"].get<double>();
  // This run's steps (a resumed run's losses go back to the first step; its other series do
  // not): the last count(step_seconds) steps.
  const double first = steps - static_cast<double>(d.count("/step_seconds")) + 1;
  const auto integer = [](double x) { return fmt("%.0f", x); };

  h << "<h2>Loss</h2>\n<p>The training loss of every optimizer step"
    << (d.group("/step_losses") > 1
            ? " (means of " + std::to_string(d.group("/step_losses")) + " steps)"
            : std::string())
    << ".</p>\n";
  html::LineChart loss;
  loss.series.push_back(d.per_step("/step_losses", 1));
  loss.series.back().name = "loss";
  loss.series.back().colour = kBlue;
  loss.x_label = integer;
  // From the lowest loss up: how it falls matters more than its distance from 0.
  const std::vector<double>& losses = loss.series.back().y;
  if (!losses.empty()) loss.y_min = *std::min_element(losses.begin(), losses.end());
  h << html::line_chart(loss);

  h << "<h2>Accuracy</h2>\n<p>The training accuracy of each output the calls returned, at its "
       "step";
  const json& test = d["test_accuracy"];
  h << (test.is_null() ? "" : "; dashed, the test accuracy") << ".</p>\n";
  html::LineChart acc;
  html::LineSeries a{"training accuracy", kGreen, {}, {}, false};
  const json& returned = d["step_accuracy"];
  for (size_t i = 0; i < returned.at("steps").size(); ++i) {
    a.x.push_back(returned.at("steps")[i].get<double>());
    a.y.push_back(100 * returned.at("accuracy")[i].get<double>());
  }
  acc.series.push_back(std::move(a));
  if (!test.is_null())
    acc.references.push_back(
        {100 * test.get<double>(), "test " + percent(test.get<double>()), kRed});
  acc.y_min = 0;
  acc.y_max = 100;
  acc.x_label = integer;
  acc.y_label = [](double y) { return fmt("%.0f%%", y); };
  h << html::line_chart(acc);

  const json& ls = d["loss_scale"];
  if (ls.is_null()) {
    h << "<h2>Loss scale</h2>\n<p>No loss scaling.</p>\n";
  } else {
    h << "<h2>Loss scale</h2>\n<p>The scale S the loss is multiplied by before the backward "
         "pass, from the start of the run.</p>\n";
    html::LineChart scale;
    html::LineSeries s{"loss scale", kOrange, {0}, {ls.at("initial").get<double>()}, true};
    for (const json& change : ls.at("history")) {
      s.x.push_back(change.at("step").get<double>());
      s.y.push_back(change.at("scale").get<double>());
    }
    s.x.push_back(steps);
    s.y.push_back(ls.at("final").get<double>());
    scale.series.push_back(std::move(s));
    scale.log2_y = true;
    scale.x_label = integer;
    scale.y_label = [](double y) { return "2^" + fmt("%g", std::log2(y)); };
    h << html::line_chart(scale);

    // Skipped steps, counted up over this run from those skipped before it.
    const size_t n = d.count("/loss_scale/skipped"), k = d.group("/loss_scale/skipped");
    const double before =
        static_cast<double>(ls.at("skipped_steps").get<int64_t>()) - static_cast<double>(n);
    h << "<h2>Skipped steps</h2>\n<p>Steps skipped for inf/NaN gradients, counted over the run ("
      << ls.at("skipped_steps").get<int64_t>() << " in all).</p>\n";
    html::LineChart skipped;
    html::LineSeries c{"skipped steps", kRed, {first - 1}, {before}, true};
    const json& at = ls.at("skipped");
    for (size_t g = 0; g < at.size(); ++g) {
      c.x.push_back(at[g].get<double>());
      c.y.push_back(before + static_cast<double>(std::min(n, (g + 1) * k)));
    }
    c.x.push_back(steps);
    c.y.push_back(before + static_cast<double>(n));
    skipped.series.push_back(std::move(c));
    skipped.x_label = integer;
    skipped.y_label = integer;
    // An even count at the top, so that the middle tick is a whole number too.
    skipped.y_max = 2 * std::ceil(std::max(1.0, before + static_cast<double>(n)) / 2);
    h << html::line_chart(skipped);
  }

  h << "<h2>Step time</h2>\n<p>The wall time of each optimizer step of this run, in "
       "milliseconds, its data included.</p>\n";
  html::LineChart time;
  time.series.push_back(d.per_step("/step_seconds", first, 1e3));
  time.series.back().name = "milliseconds";
  time.series.back().colour = kPurple;
  time.x_label = integer;
  h << html::line_chart(time);
}

void memory(std::ostringstream& h, const Data& d) {
  const auto at_peak = category_bytes(d["memory_at_peak_bytes"]);
  const auto own = category_bytes(d["peak_memory_bytes"]);
  h << "<h2>Memory by category</h2>\n<p>What the peak of "
    << html::escape(bytes_text(d["peak_memory_bytes"].at("total")))
    << " was made of, and the highest each category reached (at moments of its own).</p>\n"
    << html::category_key()
    << html::category_bars(
           {{"at the peak", at_peak, bytes_text(d["peak_memory_bytes"].at("total"))},
            {"own peaks", own, ""}});
  h << "<table><tr><th>category</th><th>at the peak</th><th>own peak</th></tr>\n";
  for (MemoryCategory c : kAllMemoryCategories) {
    const size_t i = static_cast<size_t>(c);
    h << "<tr><td>" << memory_category_name(c) << "</td><td>" << format_bytes(at_peak[i])
      << "</td><td>" << format_bytes(own[i]) << "</td></tr>\n";
  }
  h << "</table>\n";
}

void tables(std::ostringstream& h, const Data& d) {
  h << "<h2>Epochs</h2>\n<table><tr><th>epoch</th><th>steps</th><th>loss</th><th>train "
       "accuracy</th><th>seconds</th><th>images/s</th></tr>\n";
  for (const json& e : d["epochs"])
    h << "<tr><td>" << e.at("epoch").get<int64_t>() << "</td><td>" << e.at("steps").get<int64_t>()
      << "</td><td>" << fmt("%.4f", e.at("loss").get<double>()) << "</td><td>"
      << percent(e.at("train_accuracy").get<double>()) << "</td><td>"
      << fmt("%.1f", e.at("seconds").get<double>()) << "</td><td>"
      << fmt("%.1f", e.at("images_per_second").get<double>()) << "</td></tr>\n";
  h << "</table>\n<h2>Configuration</h2>\n<table class=\"kv\">\n";
  const json& c = d["config"];
  for (auto it = c.begin(); it != c.end(); ++it) row(h, it.key(), value_text(it.value()));
  h << "</table>\n";
}

}  // namespace

std::string training_report_html(const std::string& metrics_json) {
  try {
    const Data d(json::parse(metrics_json));
    const json& c = d["config"];
    const std::string title = value_text(c.at("model")) + " on " + value_text(c.at("dataset")) +
                              ", " + value_text(c.at("precision"));
    std::ostringstream h;
    h << html::page_start("Mantissa training: " + title, ".kv td{text-align:left}")
      << "<h1>Training: " << html::escape(title) << "</h1>\n";
    summary(h, d);
    h << "<h2>Precision</h2>\n<p>" << html::escape(value_text(d["precision_settings"])) << "</p>\n";
    charts(h, d);
    memory(h, d);
    tables(h, d);
    // The data, for a reader or a program: '<' written as \u003c, so that no text inside it can
    // end the script element.
    std::string data;
    for (char ch : d.json_value().dump())
      data += ch == '<' ? std::string("\\u003c") : std::string(1, ch);
    h << "<script type=\"application/json\" id=\"metrics\">" << data << "</script>\n"
      << html::kPageEnd;
    return h.str();
  } catch (const json::exception& e) {
    throw Error(std::string("the training report needs the metrics JSON: ") + e.what(),
                "pass the text that metrics_json() returns");
  }
}

}  // namespace mantissa::train
