// The training report (report_html.h): the page holds the metrics JSON of its run, in every
// precision mode; a long run's page stays small with its summary exact; its path is checked before
// the run. (The browser checks of the page are in tests/browser.)
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "mantissa/io/html.h"
#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"
#include "train/report_page.h"

namespace mantissa {
namespace {

using nlohmann::json;

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(TrainingReport, HoldsTheMetricsJsonOfItsRun) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 512);
  c.precision = "16-mixed";
  c.loss_scale_growth_interval = 4;  // the scale grows until FP16 gradients overflow: skips
  c.max_steps = 30;
  c.evaluate = true;
  c.test_limit = 32;
  c.metrics_json = dir.file("metrics.json");
  c.report = dir.file("report.html");
  train::Trainer t(c);
  const train::TrainResult r = t.run();
  ASSERT_GT(r.skipped_steps, 0) << "the scale should have overflowed at least once";

  const json metrics = json::parse(testing::read_text(c.metrics_json));
  const std::string page = testing::read_text(c.report);
  EXPECT_EQ(testing::report_data(page), metrics);
  // What the page adds to the metrics file: this run's skipped steps, the returned outputs'
  // accuracy, the settings' starting scale and their printed line.
  EXPECT_EQ(metrics["loss_scale"]["skipped"].get<std::vector<int64_t>>(), r.skipped);
  EXPECT_EQ(metrics["loss_scale"]["skipped"].size(), static_cast<size_t>(r.skipped_steps));
  EXPECT_EQ(metrics["loss_scale"]["initial"], 65536.0);
  EXPECT_EQ(metrics["step_accuracy"]["steps"].size(), 30u);
  EXPECT_EQ(metrics["step_accuracy"]["steps"][29], 30);
  for (const json& a : metrics["step_accuracy"]["accuracy"]) {
    EXPECT_GE(a.get<double>(), 0.0);
    EXPECT_LE(a.get<double>(), 1.0);
  }
  EXPECT_EQ(metrics["precision_settings"], t.precision_settings().describe());
  // Loss, accuracy, loss scale, skipped steps, step time, memory.
  EXPECT_EQ(count_of(page, "<svg"), 6u);
  EXPECT_NE(page.find("Steps skipped for inf/NaN gradients, counted over the run (" +
                      std::to_string(r.skipped_steps) + " in all)"),
            std::string::npos);
  EXPECT_NE(page.find(io::html::escape(metrics["precision_settings"].get<std::string>())),
            std::string::npos);
  EXPECT_EQ(page.find("src="), std::string::npos) << "self-contained: nothing to fetch";
}

TEST(TrainingReport, EveryPrecisionMode) {
  for (const char* mode : {"32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "O0", "O1",
                           "O2", "O3", "32.32", "16.32", "16.16"}) {
    const testing::TempDir dir;
    train::TrainConfig c = testing::small_run("lenet5", 64);
    c.precision = mode;
    c.max_steps = 2;
    c.metrics_json = dir.file("metrics.json");
    c.report = dir.file("report.html");
    train::Trainer t(c);
    t.run();
    const json metrics = json::parse(testing::read_text(c.metrics_json));
    const std::string page = testing::read_text(c.report);
    EXPECT_EQ(testing::report_data(page), metrics) << mode;
    EXPECT_EQ(metrics["precision_settings"], t.precision_settings().describe()) << mode;
    const bool scaled = t.loss_scaler() != nullptr;
    EXPECT_EQ(page.find("No loss scaling.") == std::string::npos, scaled) << mode;
    EXPECT_EQ(count_of(page, "<svg"), scaled ? 6u : 4u) << mode;
  }
}

// A run of 50,000 steps, made up (training it would take too long): the page draws and holds at
// most kReportMaxPoints points a series, and everything but the per-step series exactly.
TEST(TrainingReport, ALongRunsPageIsSmallAndItsSummaryExact) {
  train::TrainConfig c = testing::small_run("lenet5", 512);
  c.precision = "16-mixed";
  const train::RunSettings s = train::resolve(c);
  constexpr int64_t kSteps = 50000, kEarlierSkips = 100;
  train::TrainResult r;
  r.steps = kSteps;
  for (int64_t i = 0; i < kSteps; ++i) {
    r.step_losses.push_back(2.0f / (1.0f + 1e-3f * static_cast<float>(i)));
    r.step_seconds.push_back(0.01 + 1e-3 * static_cast<double>(i % 7));
    r.outputs.push_back({i + 1, 1, 0, (i * 7) % 17, 16});
  }
  for (int64_t i = 0; i < 1500; ++i) r.skipped.push_back(10 + 30 * i);
  r.skipped_steps = kEarlierSkips + 1500;
  r.loss_scale = 32768;
  r.loss_scale_history = {{2000, 131072, false}, {2010, 65536, true}, {40000, 32768, true}};
  for (int64_t e = 1; e <= 20; ++e) r.epochs.push_back({e, 1.0, 0.5, 10.0, 1600.0, 2500});
  r.test_accuracy = 0.875;
  r.test_examples = 512;
  r.memory.peak_total = 3u << 20;
  r.memory.peak[0] = 1u << 20;
  r.memory.at_peak_total[0] = 1u << 20;
  r.memory.at_peak_total[4] = 2u << 20;

  const std::string metrics_text = train::metrics_json(c, s, r);
  const std::string page = train::training_report_html(metrics_text);
  EXPECT_LT(page.size(), 300u * 1024) << "the metrics file alone is " << metrics_text.size();
  EXPECT_GT(metrics_text.size(), 2 * page.size());

  json metrics = json::parse(metrics_text);
  json data = testing::report_data(page);
  // The per-step series: thinned to group means, named under "thinned".
  const json thinned = data["thinned"];
  EXPECT_EQ(thinned.size(), 5u) << thinned;
  for (const char* pointer : {"/step_losses", "/step_seconds", "/step_accuracy/steps",
                              "/step_accuracy/accuracy", "/loss_scale/skipped"}) {
    const json::json_pointer p(pointer);
    const json& full = metrics[p];
    const json& shown = data[p];
    ASSERT_TRUE(thinned.contains(pointer)) << pointer;
    const size_t k = thinned[pointer]["group"], n = thinned[pointer]["count"];
    EXPECT_EQ(n, full.size()) << pointer;
    EXPECT_EQ(k, (n + train::kReportMaxPoints - 1) / train::kReportMaxPoints) << pointer;
    ASSERT_EQ(shown.size(), (n + k - 1) / k) << pointer;
    EXPECT_LE(shown.size(), train::kReportMaxPoints) << pointer;
    for (size_t g : {size_t{0}, shown.size() - 1}) {  // the first group, and the last (shorter)
      double sum = 0;
      const size_t hi = std::min(n, (g + 1) * k);
      for (size_t i = g * k; i < hi; ++i) sum += full[i].get<double>();
      EXPECT_EQ(shown[g].get<double>(), sum / static_cast<double>(hi - g * k)) << pointer << g;
    }
    metrics[p] = nullptr;
    data[p] = nullptr;
  }
  data.erase("thinned");
  EXPECT_EQ(data, metrics) << "everything else is the metrics' own";
  // Each chart draws at most a point per group (a step function two).
  for (size_t at = page.find("points=\""); at != std::string::npos;
       at = page.find("points=\"", at + 1)) {
    const size_t end = page.find('"', at + 8);
    EXPECT_LE(count_of(page.substr(at, end - at), " "), 2 * train::kReportMaxPoints + 4);
  }
  // The skipped steps count up from those skipped before this run.
  EXPECT_NE(page.find("(1600 in all)"), std::string::npos);
}

TEST(TrainingReport, ItsPathIsCheckedBeforeTheRun) {
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.report = "/nonexistent-dir/report.html";
  EXPECT_NE(testing::error_of([&] { train::validate(c); })
                .find("--report /nonexistent-dir/report.html: directory /nonexistent-dir does not "
                      "exist"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] {
              train::training_report_html("{\"steps\": 1}");
            }).find("the training report needs the metrics JSON"),
            std::string::npos);
}

// The shared chart pieces (io/html.h) escape what they are given and draw a lone point.
TEST(Html, EscapesTextAndDrawsALonePointAsADot) {
  EXPECT_EQ(io::html::escape("a<b & \"c\">"), "a&lt;b &amp; &quot;c&quot;&gt;");
  EXPECT_NE(io::html::page_start("<x>").find("<title>&lt;x&gt;</title>"), std::string::npos);
  io::html::LineChart chart;
  chart.series.push_back({"<one>", "#4e79a7", {1}, {0.5}, false});
  const std::string svg = io::html::line_chart(chart);
  EXPECT_NE(svg.find("<circle"), std::string::npos) << svg;
  EXPECT_NE(svg.find("<title>&lt;one&gt;</title>"), std::string::npos) << svg;
  EXPECT_EQ(svg.find("<one>"), std::string::npos) << svg;
}

}  // namespace
}  // namespace mantissa
