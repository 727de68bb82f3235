// The memory tools: activation recomputation (the same training, bit for bit, with less memory),
// the one-step memory profile behind `mantissa memory` (by category, by layer, liveness, JSON and
// HTML), and the IPU guide's story at small scale: a ResNet on CIFAR-shaped data whose 32.32 run
// exceeds a budget, and whose 16.16 run fits with recomputation.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/train.h"

namespace mantissa {
namespace {

std::vector<float> values(const std::vector<nn::Module::NamedTensor>& ts) {
  std::vector<float> v;
  for (auto& t : ts) {
    const std::vector<float> x = t.tensor->to_float_vector();
    v.insert(v.end(), x.begin(), x.end());
  }
  return v;
}

TEST(Recompute, TrainsBitForBitAsWithoutIt) {
  for (const std::string precision : {"32-true", "16-mixed"}) {
    train::TrainConfig c = testing::small_run("resnet18", 64);
    c.batch_size = 8;
    c.max_steps = 2;
    c.precision = precision;
    train::Trainer plain(c);
    const train::TrainResult a = plain.run();
    c.recompute = true;
    train::Trainer again(c);
    const train::TrainResult b = again.run();
    EXPECT_EQ(a.step_losses, b.step_losses) << precision;
    EXPECT_EQ(values(plain.model().named_parameters()), values(again.model().named_parameters()))
        << precision;
    // BatchNorm's running statistics are updated once per step, not again when recomputed.
    EXPECT_EQ(values(plain.model().named_buffers()), values(again.model().named_buffers()))
        << precision;
  }
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.recompute = true;
  EXPECT_NE(
      testing::error_of([&] { train::Trainer t(c); }).find("lenet5 has no blocks to recompute"),
      std::string::npos);
}

TEST(Recompute, ReplaysDropoutMasksAndGivesTheSameGradients) {
  auto make = [] {
    nn::InitStreams init(3);
    auto seq = std::make_shared<nn::Sequential>();
    seq->add(std::make_shared<nn::Linear>(8, 16, init));
    seq->add(std::make_shared<nn::Dropout>(init, 0.5));
    seq->add(std::make_shared<nn::Linear>(16, 4, init));
    return seq;
  };
  const Tensor x = Tensor::from_floats(std::vector<float>(24, 0.5f), {3, 8});
  std::vector<std::vector<float>> grads;
  for (bool recompute : {false, true}) {
    auto seq = make();
    seq->set_recompute(recompute);
    nn::set_random_context({7, 1});
    (*seq)(x);  // an earlier call in the step: the replay must not reuse its mask
    seq->zero_grad();
    autograd::backward(ops::sum(ops::mul((*seq)(x), (*seq)(x))));
    grads.push_back({});
    for (auto& p : seq->named_parameters()) {
      const std::vector<float> g = p.tensor->grad().to_float_vector();
      grads.back().insert(grads.back().end(), g.begin(), g.end());
    }
  }
  EXPECT_EQ(grads[0], grads[1]);
}

TEST(MemoryProfile, ReportsCategoriesLayersAndLivenessOfOneStep) {
  train::TrainConfig c = testing::small_run("resnet18", 64);
  c.batch_size = 8;
  c.threads = 2;
  std::vector<train::StepMemory> runs;
  for (const std::string p : {"32-true", "16-true"}) {
    c.precision = p;
    runs.push_back(train::profile_step(c));
  }
  for (const train::StepMemory& r : runs) {
    size_t sum = 0;
    for (size_t b : r.at_peak) sum += b;
    EXPECT_EQ(sum, r.peak_total);
    EXPECT_GT(r.at_peak[static_cast<size_t>(MemoryCategory::optimizer_state)], 0u)
        << "the measured step is the second: the optimizer's state exists";
    size_t layers = 0;
    bool conv = false;
    for (const train::LayerMemory& l : r.layers) {
      layers += l.total;
      conv = conv || l.layer == "layer1.0.conv1";
    }
    EXPECT_EQ(layers, r.peak_total) << "the layers at the peak add up to it";
    EXPECT_TRUE(conv);
    std::set<std::string> phases;
    size_t top = 0;
    for (const train::MemoryPoint& p : r.timeline) {
      phases.insert(p.phase);
      top = std::max(top, p.total);
    }
    // The updates run in the backward pass (TrainConfig::update_in_backward): nothing is
    // allocated in the optimizer phase.
    EXPECT_TRUE(phases.count("forward") && phases.count("backward"));
    EXPECT_EQ(top, r.peak_total);
    EXPECT_TRUE(r.fits);
    // The peak is reached by an allocation, made while a layer ran (the backward pass of one of
    // ResNet's convolutions, as it happens), and the timeline holds that point.
    EXPECT_EQ(r.peak.total, r.peak_total);
    EXPECT_GT(r.peak.delta, 0);
    EXPECT_FALSE(r.peak.owner.empty());
    EXPECT_EQ(r.peak.module.rfind("layer", 0), 0u) << r.peak.module;
    bool listed = false;
    for (const train::MemoryPoint& p : r.timeline)
      listed = listed || (p.event == r.peak.event && p.module == r.peak.module &&
                          p.owner == r.peak.owner && p.delta == r.peak.delta);
    EXPECT_TRUE(listed);
  }
  // The 16-bit model holds a bit more than half (the normalization layers' FP32 staging).
  EXPECT_LT(static_cast<double>(runs[1].peak_total), 0.6 * static_cast<double>(runs[0].peak_total));
  const auto at = [&](int run, MemoryCategory cat) {
    return static_cast<double>(runs[static_cast<size_t>(run)].at_peak[static_cast<size_t>(cat)]);
  };
  EXPECT_EQ(2 * at(1, MemoryCategory::optimizer_state), at(0, MemoryCategory::optimizer_state));
  // Parameters halve but for BatchNorm's running statistics, which stay FP32.
  EXPECT_NEAR(2 * at(1, MemoryCategory::parameters) / at(0, MemoryCategory::parameters), 1.0, 2e-3);

  // The ordinary step keeps every gradient until the optimizer phase: a higher peak.
  c.precision = "32-true";
  c.update_in_backward = false;
  const train::StepMemory ordinary = train::profile_step(c);
  bool optimizer_phase = false;
  for (const train::MemoryPoint& p : ordinary.timeline)
    optimizer_phase = optimizer_phase || p.phase == "optimizer";
  EXPECT_TRUE(optimizer_phase);
  EXPECT_GT(ordinary.peak_total, runs[0].peak_total);
  c.update_in_backward = true;

  const nlohmann::json j = nlohmann::json::parse(train::memory_json(c, runs));
  ASSERT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["runs"][1]["precision"], "16-true");
  EXPECT_EQ(j["runs"][0]["peak_total_bytes"].get<size_t>(), runs[0].peak_total);
  EXPECT_FALSE(j["runs"][0]["timeline"].empty());
  const nlohmann::json& last = j["runs"][0]["timeline"].back();
  EXPECT_TRUE(last.contains("delta") && last.contains("owner") && last.contains("module") &&
              last.contains("category"));
  const std::string text = train::memory_text(runs);
  EXPECT_NE(text.find("peak of 16-true reached in the backward of " + runs[1].peak.module),
            std::string::npos)
      << text;
  const std::string html = train::memory_html(c, runs);
  // The liveness charts say and mark what reached each peak.
  EXPECT_NE(html.find("peak reached in the backward of " + runs[1].peak.module), std::string::npos);
  EXPECT_NE(html.find("<circle"), std::string::npos);
  size_t svgs = 0;
  for (size_t at = html.find("<svg"); at != std::string::npos; at = html.find("<svg", at + 1))
    ++svgs;
  EXPECT_EQ(svgs, 3u);  // categories, and the liveness of each run
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos) << "self-contained: nothing to fetch";
  EXPECT_NE(train::memory_text(runs).find("ratio to 32-true: 16-true"), std::string::npos);
}

// The hands-on guide's path at small scale (ResNet-18 for its ResNet-101, batch 16 for 64):
// 32.32 with gradient accumulation 3 runs out of memory; half precision halves most of it; with
// recomputation it fits.
TEST(MemoryProfile, TheGuidesStoryOutOfMemoryInFp32FitsInHalfWithRecomputation) {
  train::TrainConfig c = testing::small_run("resnet18", 64);
  c.image_size = 32;  // CIFAR's
  c.batch_size = 16;
  c.gradient_accumulation = 3;
  c.threads = 2;  // the GEMM's per-thread workspace is part of the figure
  c.memory_budget = "132MiB";
  c.precision = "32.32";
  const train::StepMemory fp32 = train::profile_step(c);
  c.precision = "16.16";
  const train::StepMemory half = train::profile_step(c);
  c.recompute = true;
  const train::StepMemory half_rc = train::profile_step(c);
  EXPECT_FALSE(fp32.fits);
  EXPECT_NE(fp32.oom_report.find("of the 132.00 MiB budget"), std::string::npos) << fp32.oom_report;
  EXPECT_NE(fp32.oom_report.find("largest holders by layer"), std::string::npos) << fp32.oom_report;
  EXPECT_FALSE(half.fits) << half.peak_total;
  EXPECT_TRUE(half_rc.fits) << half_rc.peak_total;
  EXPECT_LE(half_rc.peak_total, size_t{132} << 20);
  // (profile_step ran the trainer itself under the budget, for two optimizer steps.)
  EXPECT_FALSE(default_memory_tracker().budget().has_value()) << "the budget ends with the run";
}

// An allocation refused outside the configuration's --memory-budget (here a budget the process
// set before, standing in for the system refusing one) is the error itself, with exit status 3:
// there is no unlimited run to measure what the step needs.
TEST(MemoryProfile, AnAllocationRefusedWithoutABudgetOfItsOwnIsTheError) {
  train::TrainConfig c = testing::small_run("lenet5", 64);
  const size_t before = default_memory_tracker().stats().current_total;
  default_memory_tracker().set_budget(size_t{64} << 10);
  bool out_of_memory = false;
  try {
    train::profile_step(c);
  } catch (const OutOfMemoryError& e) {
    out_of_memory = true;
    EXPECT_TRUE(e.over_budget());
  }
  default_memory_tracker().set_budget(std::nullopt);
  EXPECT_TRUE(out_of_memory);
  EXPECT_EQ(default_memory_tracker().stats().current_total, before) << "the step's memory freed";
}

// The mixed modes read each FP32 weight of linear and conv2d as its 16-bit copy without keeping
// one for the backward pass, so on the tutorial CNN at batch 12 they hold less than 32-true at
// the peak (94.2%; a kept f16 copy of fc1's weight adds 8 MiB, 13% of 32-true's 59.2 MiB), and
// what they save for the backward pass is 16-bit (the activations' own peak). O2 likewise reads
// its FP32 masters as its 16-bit model (91.9%; with the 16-bit model stored beside the masters,
// 106.7%).
TEST(MemoryProfile, MixedModesHoldLessThanFp32WithoutSavedWeightCopies) {
  train::TrainConfig c = testing::tutorial_cnn_batch_12();
  const train::StepMemory fp32 = train::profile_step(c);
  for (const std::string precision : {"16-mixed", "bf16-mixed", "O2"}) {
    c.precision = precision;
    const train::StepMemory mixed = train::profile_step(c);
    EXPECT_LE(static_cast<double>(mixed.peak_total), 0.97 * static_cast<double>(fp32.peak_total))
        << precision;
    EXPECT_LT(
        static_cast<double>(mixed.category_peaks[static_cast<size_t>(MemoryCategory::activations)]),
        0.75 * static_cast<double>(
                   fp32.category_peaks[static_cast<size_t>(MemoryCategory::activations)]))
        << precision;
  }
}

// The true modes hold at most half of 32-true's peak on the tutorial CNN at batch 12 on one thread
// and at batch 64 on two (49.9% at both), within what does not halve: the max-pooling offsets (2
// bits an output in every mode, 161 KB beyond half at batch 64) and the GEMM's packing panels
// (FP32 in every mode; at batch 64 32-true's peak is in fc1's weight gradient, which packs a
// 262 KB panel of its input on each thread, and 16-true reads its 16-bit input in place: on one
// thread that is 138 KB below half, less than the offsets, and the ratio is 50.03%). Each of
// these took it above 50%: large GEMMs' panels held until the thread's next GEMM (fc1's forward
// panels in fc1's backward, 50.3% at batch 64), the FP32 panel of fc1's 16-bit input in its
// weight gradient at batch 64 (100 rows, widened before two blocks of rows could read it in
// place), the FP32 staging of fc1's 16-bit input gradient (2 x 48 KiB on two threads), byte
// offsets for the pooling; and above 50.5%: the FP32 copy of a 16-bit input in linear's forward
// and weight gradient (2 MB), conv2's FP32 staging of all 12 images (3.1 MiB), i32 plane indices
// for the pooling, a ReLU backward beside the gradient it reads, saved tensors kept until the end
// of the backward pass.
TEST(MemoryProfile, TrueModesHoldHalfOfFp32) {
  for (int batch : {12, 64}) {
    std::vector<train::TrainConfig> c(3, testing::tutorial_cnn_batch_12());
    for (train::TrainConfig& one : c) {
      one.batch_size = batch;
      one.threads = batch == 12 ? 1 : 2;
    }
    c[1].precision = "16-true";
    c[2].precision = "bf16-true";
    const std::vector<train::StepMemory> m = train::profile_steps(c);
    EXPECT_LE(m[1].peak_total, m[0].peak_total / 2) << "16-true, batch " << batch;
    EXPECT_LE(m[2].peak_total, m[0].peak_total / 2) << "bf16-true, batch " << batch;
  }
}

// profile_steps (`mantissa memory`) measures each step from what a fresh process holds: what an
// earlier measurement left in the GEMM's per-thread buffers (a small GEMM's stay for the next
// call: 16-true's buffers for converting 16-bit operands, which 32-true never asks for) is
// released first, so the same configuration measures the same bytes whatever ran before it. (Run
// alone, as ctest runs it: in one process with the tests above, their larger buffers would hide a
// step that kept 16-true's.)
TEST(MemoryProfile, AStepsFiguresDoNotDependOnWhatWasMeasuredBefore) {
  std::vector<train::TrainConfig> c(3, testing::tutorial_cnn_batch_12());
  for (train::TrainConfig& one : c)
    one.batch_size = 16;  // 16-true's buffers there outgrow 32-true's (at 12 they do not)
  c[1].precision = "16-true";
  const std::vector<train::StepMemory> m = train::profile_steps(c);
  EXPECT_EQ(m[2].peak_total, m[0].peak_total);
  EXPECT_EQ(m[2].category_peaks, m[0].category_peaks);
}

}  // namespace
}  // namespace mantissa
