// Every setting acts or is refused: a setting that acts only together with another (an Adam option
// under SGD, a loss-scale option without a dynamic scale, stochastic rounding with nothing 16-bit
// to round, ...) is refused by train::resolve() naming both, and accepted once the other is set.
// And the settings that once parsed without acting now act: per-module precision on the models'
// shared ReLU, and a numerics report's suggested loss scale as the initial scale.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;
using Edit = std::function<void(train::TrainConfig&)>;

// A setting refused on its own (`refusal` is part of the message) and accepted with `enable`.
struct Case {
  const char* what;
  Edit set;
  std::string refusal;
  Edit enable;
};

void check(const Case& k) {
  SCOPED_TRACE(k.what);
  train::TrainConfig c;  // the defaults: tutorial-cnn, AdamW, 32-true
  k.set(c);
  const std::string refused = error_of([&] { train::validate(c); });
  EXPECT_NE(refused.find(k.refusal), std::string::npos) << refused;
  EXPECT_NE(refused.find("HINT"), std::string::npos) << "a refusal says how to fix it";
  k.enable(c);
  EXPECT_EQ(error_of([&] { train::validate(c); }), "");
}

TEST(Settings, OptimizerOptionsOfAnotherOptimizerAreRefused) {
  const Edit sgd = [](auto& c) { c.optimizer = "sgd"; };
  const Edit adam = [](auto& c) { c.optimizer = "adam"; };
  const Edit momentum = [](auto& c) { c.momentum = 0.9; };
  const Case cases[] = {
      {"beta1 under SGD", [&](auto& c) { sgd(c), c.beta1 = 0.8; },
       "--beta1 applies to Adam and AdamW, not to --optimizer sgd", adam},
      {"beta2 under SGD", [&](auto& c) { sgd(c), c.beta2 = 0.99; },
       "--beta2 applies to Adam and AdamW", adam},
      {"eps under SGD", [&](auto& c) { sgd(c), c.eps = 1e-6; }, "--eps applies to Adam", adam},
      {"no bias correction under SGD", [&](auto& c) { sgd(c), c.bias_correction = false; },
       "--no-bias-correction applies to Adam", adam},
      {"nesterov under AdamW", [](auto& c) { c.nesterov = true; },
       "--nesterov applies to SGD, not to --optimizer adamw",
       [&](auto& c) { sgd(c), momentum(c); }},
      {"nesterov without momentum", [&](auto& c) { sgd(c), c.nesterov = true; },
       "--nesterov needs SGD momentum", momentum},
      {"first moment type of SGD without momentum",
       [&](auto& c) { sgd(c), c.first_moment_type = "bf16"; },
       "--first-moment-type sets the type of SGD's momentum buffer, and --momentum 0 keeps none",
       momentum},
      {"second moment type under SGD", [&](auto& c) { sgd(c), c.second_moment_type = "bf16"; },
       "--second-moment-type sets the type of Adam's exp_avg_sq, and --optimizer sgd keeps no "
       "second moment",
       adam},
  };
  for (const Case& k : cases) check(k);
}

TEST(Settings, ScheduleAndPipelineOptionsWithoutTheirModeAreRefused) {
  const Case cases[] = {
      {"step size of a constant schedule", [](auto& c) { c.lr_step_size = 10; },
       "--lr-step-size applies to --lr-schedule step, not constant",
       [](auto& c) { c.lr_schedule = "step"; }},
      {"gamma of a cosine schedule",
       [](auto& c) {
         c.lr_schedule = "cosine";
         c.lr_gamma = 0.5;
       },
       "--lr-gamma applies to --lr-schedule step, not cosine",
       [](auto& c) { c.lr_schedule = "step"; }},
      {"reduction without accumulation", [](auto& c) { c.accumulation_reduction = "running"; },
       "--accumulation-reduction running combines the micro-batches of a step, and "
       "--gradient-accumulation is 1",
       [](auto& c) { c.gradient_accumulation = 2; }},
      {"output mode of one-step calls", [](auto& c) { c.output_mode = "all"; },
       "--output-mode all chooses among the steps of a call, and --device-iterations is 1",
       [](auto& c) { c.device_iterations = 2; }},
      {"return period of another output mode",
       [](auto& c) {
         c.device_iterations = 4;
         c.output_return_period = 2;
       },
       "--output-return-period applies to --output-mode every, not final",
       [](auto& c) { c.output_mode = "every"; }},
      {"asynchronous loader without prefetching",
       [](auto& c) {
         c.async_loader = true;
         c.prefetch = 0;
       },
       "--async-dataloader with --prefetch 0 lets the workers make nothing ahead",
       [](auto& c) { c.prefetch = 1; }},
      {"prefetch without the asynchronous loader", [](auto& c) { c.prefetch = 4; },
       "--prefetch applies to the asynchronous loader", [](auto& c) { c.async_loader = true; }},
      {"workers without the asynchronous loader", [](auto& c) { c.workers = 3; },
       "TrainConfig::workers applies to the asynchronous loader",
       [](auto& c) { c.async_loader = true; }},
  };
  for (const Case& k : cases) check(k);
}

TEST(Settings, ReportEvaluationDataAndModelOptionsWithoutTheirSubjectAreRefused) {
  const testing::TempDir dir;
  const std::string report = dir.file("n.json");
  const Case cases[] = {
      {"numerics interval without a report", [](auto& c) { c.numerics_every = 10; },
       "--numerics-every applies to --numerics-report, which is not given",
       [&](auto& c) { c.numerics_report = report; }},
      {"evaluation batch without evaluation",
       [](auto& c) {
         c.evaluate = false;
         c.eval_batch_size = 64;
       },
       "--eval-batch-size applies to the evaluation, which --no-eval skips",
       [](auto& c) { c.evaluate = true; }},
      {"test limit without evaluation",
       [](auto& c) {
         c.evaluate = false;
         c.test_limit = 100;
       },
       "--test-limit applies to the evaluation", [](auto& c) { c.evaluate = true; }},
      {"autocast log without automatic casting", [](auto& c) { c.autocast_log = true; },
       "--autocast-log logs automatic casting, which --precision 32-true does not use",
       [](auto& c) { c.precision = "16-mixed"; }},
      {"ImageNet stem of a model without one", [](auto& c) { c.imagenet_stem = true; },
       "--imagenet-stem chooses a ResNet's stem, and --model is tutorial-cnn",
       [](auto& c) { c.model = "resnet18"; }},
      {"synthetic size of a dataset read from files", [](auto& c) { c.synthetic_size = 100; },
       "--synthetic-size sizes the synthetic dataset, and --dataset is fashion-mnist",
       [](auto& c) { c.dataset = "synthetic"; }},
      {"data directory of the synthetic dataset",
       [](auto& c) {
         c.dataset = "synthetic";
         c.data_dir = "/data";
       },
       "--data-dir locates a dataset's files, and --dataset synthetic has none",
       [](auto& c) { c.dataset = "mnist"; }},
  };
  for (const Case& k : cases) check(k);
}

TEST(Settings, LossScaleOptionsWithoutADynamicScaleAreRefused) {
  const Edit dynamic = [](auto& c) { c.loss_scaling = "dynamic"; };
  const Case cases[] = {
      {"minimum in a mode without scaling",
       [](auto& c) {
         c.precision = "bf16-mixed";
         c.loss_scale_min = 1;
       },
       "--loss-scale-min applies to loss scaling, which --precision bf16-mixed does not use",
       dynamic},
      {"hysteresis in 32-true", [](auto& c) { c.loss_scale_hysteresis = 2; },
       "--loss-scale-hysteresis applies to loss scaling, which --precision 32-true does not use",
       dynamic},
      {"initial scale with scaling turned off",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scaling = "none";
         c.loss_scale_init = 1024;
       },
       "--loss-scale-init applies to loss scaling, which --loss-scaling none turns off", dynamic},
      {"initial scale beside a static scale",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scaling = "1024";
         c.loss_scale_init = 4096;
       },
       "--loss-scale-init applies to a dynamic loss scale, and --loss-scaling 1024 is a static one",
       dynamic},
      {"growth interval of a static scale",
       [](auto& c) {
         c.precision = "O2";
         c.loss_scaling = "512";
         c.loss_scale_growth_interval = 100;
       },
       "--loss-scale-growth-interval applies to a dynamic loss scale", dynamic},
      {"maximum of a static scale",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scaling = "512";
         c.loss_scale_max = 4096;
       },
       "--loss-scale-max applies to a dynamic loss scale", dynamic},
      {"initial scale above the maximum",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scale_init = 1e6;
         c.loss_scale_max = 1024;
       },
       "--loss-scale-init 1e+06 is above --loss-scale-max 1024",
       [](auto& c) { c.loss_scale_init = 512; }},
      {"initial scale below the minimum",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scale_init = 0.5;
         c.loss_scale_min = 1;
       },
       "--loss-scale-init 0.5 is below --loss-scale-min 1", [](auto& c) { c.loss_scale_init = 2; }},
      {"initial scale given twice",
       [](auto& c) {
         c.precision = "16-mixed";
         c.loss_scale_init = 1024;
         c.loss_scale_init_report = "n.json";
       },
       "--loss-scale-init is given twice", [](auto& c) { c.loss_scale_init_report.clear(); }},
  };
  for (const Case& k : cases) check(k);
  // The default start of a dynamic scale may be clamped: that is what a cap is for.
  train::TrainConfig capped;
  capped.precision = "16-mixed";
  capped.loss_scale_max = 1024;
  EXPECT_EQ(train::resolve(capped).precision.loss_scaling->max_scale, 1024.0);
}

TEST(Settings, PrecisionOptionsWithNothingToActOnAreRefused) {
  const testing::TempDir dir;
  const std::string lower = dir.file("lower.txt");
  std::ofstream(lower) << "linear\n";
  // Stochastic rounding in each mode that keeps parameters and state in FP32, and the three ways
  // to give it something 16-bit to round.
  for (const std::string mode : {"32-true", "16-mixed", "bf16-mixed", "16.32"}) {
    for (const Edit& enable : {Edit([](auto& c) { c.half_modules = {"fc2"}; }),
                               Edit([](auto& c) { c.first_moment_type = "bf16"; }),
                               Edit([](auto& c) { c.second_moment_type = "fp16"; })})
      check({"stochastic rounding in FP32 parameters and state",
             [&](auto& c) {
               c.precision = mode;
               c.stochastic_rounding = true;
             },
             "--stochastic-rounding has nothing to round: --precision " + mode +
                 " keeps the parameters and the optimizer state in FP32",
             enable});
  }
  const Case cases[] = {
      {"stochastic outputs without 16-bit outputs",
       [](auto& c) {
         c.precision = "16.32";
         c.stochastic_outputs = true;
       },
       "--stochastic-outputs needs 16-bit op outputs, and --precision 16.32 has none",
       [](auto& c) { c.half_modules = {"conv1"}; }},
      {"op list without automatic casting",
       [&](auto& c) {
         c.precision = "16-true";
         c.autocast_lower_list = lower;
       },
       "--autocast-lower-list applies to automatic casting, which --precision 16-true does not "
       "use",
       [](auto& c) { c.precision = "16-mixed"; }},
      {"fp32 op list without automatic casting", [&](auto& c) { c.autocast_fp32_list = lower; },
       "--autocast-fp32-list applies to automatic casting, which --precision 32-true",
       [](auto& c) { c.precision = "bf16-mixed"; }},
      {"FP32 modules in an FP32 mode", [](auto& c) { c.keep_fp32 = {"norm"}; },
       "--keep-fp32 changes nothing: --precision 32-true runs every module in FP32",
       [](auto& c) { c.precision = "16-true"; }},
      {"16-bit modules in a 16-bit mode",
       [](auto& c) {
         c.precision = "bf16-true";
         c.half_modules = {"fc1"};
       },
       "--half-modules changes nothing: --precision bf16-true runs every module in bf16",
       [](auto& c) { c.precision = "O2"; }},
  };
  for (const Case& k : cases) check(k);
  // A part of a subtree overridden the other way acts.
  train::TrainConfig nested;
  nested.model = "resnet18";
  nested.half_modules = {"layer1"};
  nested.keep_fp32 = {"layer1.0.bn1"};
  EXPECT_EQ(error_of([&] { train::validate(nested); }), "");
}

// The models call the ReLU module they register (as their PyTorch originals do), so a precision
// set on it acts: in 16-mixed its outputs are f16 (autocast lowers relu) unless --keep-fp32 relu
// runs it in FP32.
TEST(Settings, KeepFp32OnTheModelsReluRunsItInFp32) {
  for (const std::string model : {"tutorial-cnn", "lenet5", "resnet18"}) {
    std::string dtype[2];
    for (bool keep : {false, true}) {
      const testing::TempDir dir;
      train::TrainConfig c = testing::small_run(model, 32);
      c.precision = "16-mixed";
      c.max_steps = 1;
      c.batch_size = 8;
      if (keep) c.keep_fp32 = {"relu"};
      c.numerics_report = dir.file("n.json");
      train::Trainer(c).run();
      std::ifstream in(c.numerics_report);
      const nlohmann::json j = nlohmann::json::parse(in);
      for (const auto& e : j["entries"])
        if (e["layer"] == "relu" && e["kind"] == "activation") dtype[keep] = e["dtype"];
    }
    EXPECT_EQ(dtype[0], "f16") << model << ": the ReLU module runs";
    EXPECT_EQ(dtype[1], "f32") << model << ": --keep-fp32 relu";
  }
}

// --kahan and --stochastic-rounding act on 16-bit parameters (and state): when --keep-fp32 takes
// back every parameter of a 16-bit mode, they are refused, not announced and ignored.
TEST(Settings, KahanAndStochasticRoundingNeedSixteenBitValuesLeft) {
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.precision = "bf16-true";
  c.max_steps = 1;
  c.keep_fp32 = {"conv1", "conv2", "fc1", "fc2", "fc3"};
  c.kahan = true;
  std::string e = error_of([&] { train::Trainer t(c); });
  EXPECT_NE(e.find("--kahan has nothing to compensate: --keep-fp32 keeps every parameter"),
            std::string::npos)
      << e;
  c.kahan = false;
  c.stochastic_rounding = true;
  train::Trainer(c).run();  // bf16-true's optimizer state is BF16: that is rounded
  c.first_moment_type = c.second_moment_type = "fp32";
  e = error_of([&] { train::Trainer t(c); });
  EXPECT_NE(e.find("--stochastic-rounding has nothing to round: --keep-fp32 keeps every"),
            std::string::npos)
      << e;
  c.keep_fp32 = {"conv1"};  // the rest stays BF16
  train::Trainer(c).run();
  c.stochastic_rounding = false;
  c.kahan = true;
  train::Trainer(c).run();
}

// `--loss-scale-init from:FILE`: the numerics report of one run starts the loss scale of the next.
TEST(Settings, TheNumericsReportsSuggestedScaleStartsTheLossScale) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.precision = "16-mixed";
  c.max_steps = 2;
  c.numerics_report = dir.file("n.json");
  train::Trainer(c).run();
  std::ifstream in(c.numerics_report);
  const double suggested = nlohmann::json::parse(in)["suggested_loss_scale"]["scale"];
  ASSERT_NE(suggested, 65536.0) << "the test needs a suggestion other than the default start";

  train::TrainConfig next = testing::small_run("lenet5", 64);
  next.precision = "16-mixed";
  next.max_steps = 1;
  next.loss_scale_init_report = c.numerics_report;
  std::ostringstream out;
  train::Trainer t(next, {&out, nullptr});
  const train::TrainResult r = t.run();
  ASSERT_TRUE(r.loss_scale.has_value());
  EXPECT_EQ(*r.loss_scale, suggested);
  EXPECT_TRUE(r.loss_scale_history.empty()) << "the scale started there, not moved there";
  std::ostringstream initial;
  initial << "loss scaling dynamic (initial " << suggested << ",";
  EXPECT_NE(out.str().find(initial.str()), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("initial loss scale from numerics report " + c.numerics_report),
            std::string::npos)
      << out.str();

  // Files that are not reports are named.
  auto refused = [&](const std::string& path) {
    train::TrainConfig b = next;
    b.loss_scale_init_report = path;
    return error_of([&] { train::validate(b); });
  };
  EXPECT_NE(refused(dir.file("absent.json"))
                .find("cannot find --loss-scale-init numerics report " + dir.file("absent.json")),
            std::string::npos);
  // Not regular files: refused without being read (a FIFO is not waited on).
  std::filesystem::create_directory(dir.file("dir.json"));
  EXPECT_NE(refused(dir.file("dir.json")).find("is a directory, not a regular file"),
            std::string::npos);
  ASSERT_EQ(::mkfifo(dir.file("fifo.json").c_str(), 0600), 0);
  EXPECT_NE(refused(dir.file("fifo.json")).find("FIFO"), std::string::npos);
  std::ofstream(dir.file("text.json")) << "not json";
  EXPECT_NE(refused(dir.file("text.json")).find("the file is not JSON"), std::string::npos);
  std::ofstream(dir.file("other.json")) << R"({"suggested_loss_scale": {"scale": "big"}})";
  EXPECT_NE(refused(dir.file("other.json")).find("no number at suggested_loss_scale.scale"),
            std::string::npos);
  std::ofstream(dir.file("zero.json")) << R"({"suggested_loss_scale": {"scale": 0}})";
  EXPECT_NE(refused(dir.file("zero.json")).find("is not a positive number"), std::string::npos);
  // A scale whose inverse (or itself) is not finite in FP32 would skip every step.
  for (const char* v : {"1e300", "1e-300"}) {
    std::ofstream(dir.file("far.json")) << R"({"suggested_loss_scale": {"scale": )" << v << "}}";
    EXPECT_NE(refused(dir.file("far.json")).find("is outside the range of a loss scale"),
              std::string::npos)
        << v;
  }
}

}  // namespace
}  // namespace mantissa
