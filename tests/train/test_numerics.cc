// The numerics report: log2 histograms, the FP16/BF16 range fractions, the suggested loss scale,
// and the report a training run writes.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "mantissa/mantissa.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

TEST(Numerics, HistogramBinsByExponentAndCountsTheFormatsRanges) {
  const float values[] = {0.0f,     1.0f,     3.0f,     std::ldexp(1.0f, -30),
                          65519.0f, 65520.0f, 70000.0f, std::ldexp(1.0f, -20),
                          INFINITY, -2.5f};
  nn::Log2Histogram h;
  h.add(Tensor::from_floats(std::vector<float>(std::begin(values), std::end(values)), {10}));
  EXPECT_EQ(h.count, 10);
  EXPECT_EQ(h.zeros, 1);
  EXPECT_EQ(h.nonfinite, 1);
  auto bin = [&](int e) { return h.bins[static_cast<size_t>(e - nn::Log2Histogram::kMinExp)]; };
  EXPECT_EQ(bin(0), 1);           // 1
  EXPECT_EQ(bin(1), 2);           // 3, -2.5
  EXPECT_EQ(bin(-30), 1);         // 2^-30
  EXPECT_EQ(bin(15), 2);          // 65519, 65520
  EXPECT_EQ(bin(16), 1);          // 70000
  EXPECT_EQ(h.fp16_overflow, 2);  // 65520 and 70000 round to inf; 65519 to 65504
  const nn::RangeFractions f16 = nn::range_fractions(h, nn::kFp16Range);
  EXPECT_DOUBLE_EQ(f16.overflow, 0.2);
  EXPECT_DOUBLE_EQ(f16.underflow, 0.1);  // 2^-30 flushes to zero
  EXPECT_DOUBLE_EQ(f16.subnormal, 0.1);  // 2^-20 is subnormal in FP16
  const nn::RangeFractions bf16 = nn::range_fractions(h, nn::kBf16Range);
  EXPECT_EQ(bf16.overflow, 0.0);
  EXPECT_EQ(bf16.underflow + bf16.subnormal, 0.0);
  // Scaled: the same values times 2^10 move ten bins up.
  nn::Log2Histogram s;
  s.add(Tensor::from_floats({1.0f, std::ldexp(1.0f, -30)}, {2}), 1024.0);
  EXPECT_EQ(s.bins[static_cast<size_t>(10 - nn::Log2Histogram::kMinExp)], 1);
  EXPECT_EQ(s.bins[static_cast<size_t>(-20 - nn::Log2Histogram::kMinExp)], 1);
}

TEST(Numerics, SuggestsTheLargestPowerOfTwoScaleThatKeepsGradientsFinite) {
  nn::NumericsRecorder r;
  r.record("fc", "activation_gradient", Tensor::from_floats({3.0f, std::ldexp(1.0f, -28)}, {2}));
  r.record("fc.weight", "weight_gradient", Tensor::from_floats({-0.5f, 0.0f}, {2}));
  const nn::NumericsRecorder::ScaleAdvice a = r.suggested_loss_scale();
  EXPECT_EQ(a.scale, 16384.0);                   // 3 * 16384 = 49152 < 65504 <= 3 * 32768
  EXPECT_DOUBLE_EQ(a.underflow_unscaled, 0.25);  // 2^-28 of four values
  EXPECT_DOUBLE_EQ(a.underflow_at_scale, 0.0);   // 2^-28 * 2^14 = 2^-14
}

TEST(Numerics, ATrainingRunReportsEveryLayersActivationsAndGradients) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 256);
  c.precision = "16-mixed";
  c.max_steps = 5;
  c.numerics_every = 2;  // steps 1, 3, 5
  c.numerics_report = dir.file("numerics.json");
  train::Trainer t(c);
  t.run();
  std::ifstream in(c.numerics_report);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["steps_recorded"], 3);
  std::map<std::string, nlohmann::json> by;
  for (auto& e : j["entries"])
    by[e["layer"].get<std::string>() + "/" + e["kind"].get<std::string>()] = e;
  ASSERT_TRUE(by.count("fc1/activation"));
  EXPECT_EQ(by["fc1/activation"]["count"], 3 * 16 * 120);  // 3 steps, batch 16, 120 features
  EXPECT_EQ(by["fc1/activation"]["dtype"], "f16");         // autocast ran it in FP16
  EXPECT_EQ(by["fc1/activation_gradient"]["count"], 3 * 16 * 120);
  EXPECT_EQ(by["conv1.weight/weight_gradient"]["count"], 3 * 6 * 1 * 5 * 5);
  for (auto& [k, e] : by) EXPECT_EQ(e["nonfinite"], 0) << k;
  const double scale = j["suggested_loss_scale"]["scale"];
  double max_grad = 0;
  for (auto& [k, e] : by)
    if (e["kind"] != "activation") max_grad = std::max(max_grad, e["max_abs"].get<double>());
  EXPECT_LT(scale * max_grad, 65504.0);
  EXPECT_GE(2 * scale * max_grad, 65504.0);
  std::ifstream html(dir.file("numerics.html"));
  const std::string page((std::istreambuf_iterator<char>(html)), {});
  EXPECT_NE(page.find("<svg"), std::string::npos);
  EXPECT_NE(page.find("Suggested loss scale"), std::string::npos);
}

// A user's module may be named anything: the page escapes the names and the title, and the line
// that names the files counts its steps in words.
TEST(Numerics, ThePageEscapesNamesAndTheLineCountsSteps) {
  const testing::TempDir dir;
  nn::NumericsRecorder r;
  r.record("blocks<1>&x", "activation", Tensor::from_floats({1.0f, 2.0f}, {2}));
  r.count_step();
  const std::string line = train::write_numerics_report(dir.file("n.json"), r, "net <b> & \"co\"");
  EXPECT_NE(line.find("(1 step); suggested loss scale"), std::string::npos) << line;
  std::ifstream in(dir.file("n.html"));
  const std::string page((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(page.find("<td>blocks&lt;1&gt;&amp;x</td>"), std::string::npos) << page;
  EXPECT_NE(page.find("<h1>Numerics: net &lt;b&gt; &amp; &quot;co&quot;</h1>"), std::string::npos);
  EXPECT_NE(page.find("<title>Mantissa numerics: net &lt;b&gt;"), std::string::npos);
  EXPECT_NE(page.find("1 recorded step."), std::string::npos);
  EXPECT_EQ(page.find("net <b>"), std::string::npos);
  EXPECT_EQ(page.find("blocks<1>"), std::string::npos);
  r.count_step();
  EXPECT_NE(train::write_numerics_report(dir.file("n.json"), r, "net").find("(2 steps)"),
            std::string::npos);
}

// Recomputed blocks run their first forward without recording: their layers' gradients are
// probed when the blocks run again in the backward pass, and activations are counted once.
TEST(Numerics, RecomputedBlocksAreReportedLikeOthers) {
  std::map<std::string, nlohmann::json> seen[2];
  for (bool recompute : {false, true}) {
    const testing::TempDir dir;
    train::TrainConfig c = testing::small_run("resnet18", 32);
    c.batch_size = 4;
    c.max_steps = 1;
    c.recompute = recompute;
    c.numerics_report = dir.file("n.json");
    train::Trainer(c).run();
    std::ifstream in(c.numerics_report);
    const nlohmann::json j = nlohmann::json::parse(in);  // held: the loop reads into it
    for (auto& e : j["entries"])
      seen[recompute][e["layer"].get<std::string>() + "/" + e["kind"].get<std::string>()] = e;
  }
  ASSERT_TRUE(seen[1].count("layer1.0.conv1/activation_gradient"));
  EXPECT_EQ(seen[0].size(), seen[1].size());
  for (auto& [k, e] : seen[0]) {
    ASSERT_TRUE(seen[1].count(k)) << k;
    EXPECT_EQ(seen[1][k]["count"], e["count"]) << k;
    EXPECT_EQ(seen[1][k]["log2_histogram"], e["log2_histogram"]) << k;
  }
}

}  // namespace
}  // namespace mantissa
