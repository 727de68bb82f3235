// What a resume compares with the checkpoint: the settings a bit-exact continuation needs (data
// order, precision settings, the stochastic-rounding seed) are refused when they differ, naming the
// recorded and the given value and the flag that resumes it; the settings a resume may change on
// purpose (learning rate, optimizer options, ...) are accepted and named in one printed line.
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;
using Edit = std::function<void(train::TrainConfig&)>;

train::TrainConfig base() {
  train::TrainConfig c = testing::small_run("lenet5", 64);
  c.max_steps = 2;
  return c;
}

// The checkpoint of `c` after its steps, in `dir`.
std::string checkpoint(const testing::TempDir& dir, train::TrainConfig c) {
  c.save = dir.file("part.safetensors");
  train::Trainer(c).run();
  return c.save;
}

// The error of resuming `path` with `c` edited ("" when it resumes).
std::string resume_error(train::TrainConfig c, const std::string& path, const Edit& edit) {
  c.resume = path;
  c.max_steps = 0;  // to the end of --epochs: past the checkpoint's step
  edit(c);
  return error_of([&] { train::Trainer t(c); });
}

TEST(ResumeChecks, WhatTheDataOrderDependsOnMustMatch) {
  const testing::TempDir dir;
  const train::TrainConfig c = base();
  const std::string path = checkpoint(dir, c);
  struct Case {
    Edit edit;
    std::string message, hint;
  };
  const Case cases[] = {
      {[](auto& r) { r.seed = 5; }, "was trained with --seed 0, not 5", "pass --seed 0"},
      {[](auto& r) { r.synthetic_size = 128; }, "was trained with --synthetic-size 64, not 128",
       "pass --synthetic-size 64"},
      {[](auto& r) { r.train_limit = 32; }, "was trained with --train-limit 0, not 32",
       "drop --train-limit"},
      {[](auto& r) { r.shuffle = false; }, "was trained with shuffling true, not false",
       "drop --no-shuffle"},
      {[](auto& r) { r.augment = true; }, "was trained with augmentation false, not true",
       "drop --augment"},
      {[](auto& r) { r.eight_bit_io = true; }, "was trained with --eight-bit-io false, not true",
       "drop --eight-bit-io"},
  };
  for (const Case& k : cases) {
    const std::string e = resume_error(c, path, k.edit);
    EXPECT_NE(e.find(path + " " + k.message), std::string::npos) << e;
    EXPECT_NE(e.find("a bit-exact continuation needs the same batches"), std::string::npos) << e;
    EXPECT_NE(e.find(k.hint), std::string::npos) << e;
  }
  // The batch size: what must match is the global batch (ranks x batch x accumulation), which a
  // resume on another number of ranks may keep with another --batch-size.
  const std::string batch = resume_error(c, path, [](auto& r) { r.batch_size = 8; });
  EXPECT_NE(batch.find(path + " was trained with a global batch of 16 (1 rank x --batch-size 16 x "
                              "--gradient-accumulation 1), not 8"),
            std::string::npos)
      << batch;
  // A limited run resumed without its limit: the flag to pass names the value.
  train::TrainConfig limited = c;
  limited.train_limit = 48;
  const testing::TempDir dir2;
  const std::string e =
      resume_error(limited, checkpoint(dir2, limited), [](auto& r) { r.train_limit = 0; });
  EXPECT_NE(e.find("--train-limit 48, not 0"), std::string::npos) << e;
  EXPECT_NE(e.find("pass --train-limit 48 to resume it"), std::string::npos) << e;
}

TEST(ResumeChecks, ThePrecisionSettingsMustMatch) {
  const testing::TempDir dir;
  train::TrainConfig c = base();
  c.precision = "16-mixed";
  const std::string path = checkpoint(dir, c);
  // Each differs from the checkpoint's precision line in a setting the mode's name does not show
  // (before, the scaler's options were taken from the checkpoint whatever the flags said).
  for (const Edit& edit : {Edit([](auto& r) { r.partials = "fp16"; }),
                           Edit([](auto& r) { r.loss_scale_growth_interval = 100; }),
                           Edit([](auto& r) { r.loss_scaling = "1024"; }),
                           Edit([](auto& r) { r.accum_type = "bf16"; }),
                           Edit([](auto& r) { r.first_moment_type = "bf16"; }),
                           Edit([](auto& r) { r.keep_fp32 = {"fc3"}; })}) {
    const std::string e = resume_error(c, path, edit);
    EXPECT_NE(e.find(path + " was trained with the precision settings 'precision 16-mixed: "),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("resume with the precision flags of the original run"), std::string::npos)
        << e;
  }
  EXPECT_EQ(resume_error(c, path, [](auto&) {}), "");
}

// The op lists are compared as they were read from their files: another name of the same file
// resumes, the same file with other ops in it is refused.
TEST(ResumeChecks, TheOpListsAreComparedAsRead) {
  const testing::TempDir dir;
  train::TrainConfig c = base();
  c.precision = "16-mixed";
  c.autocast_lower_list = dir.file("ops.txt");
  testing::write_raw(c.autocast_lower_list, "conv2d\n");
  const std::string path = checkpoint(dir, c);
  EXPECT_EQ(
      resume_error(c, path, [&](auto& r) { r.autocast_lower_list = dir.path() + "/./ops.txt"; }),
      "");
  testing::write_raw(dir.file("copy.txt"), "# the same list\nconv2d\n");
  EXPECT_EQ(resume_error(c, path, [&](auto& r) { r.autocast_lower_list = dir.file("copy.txt"); }),
            "");
  testing::write_raw(c.autocast_lower_list, "conv2d\nlinear\n");
  const std::string e = resume_error(c, path, [](auto&) {});
  EXPECT_NE(
      e.find(path + " was trained with the lower-precision op list conv2d, not linear,conv2d"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("resume with op-list files that list the ops of the original run"),
            std::string::npos)
      << e;
  // A damaged record of the lists is refused as such.
  io::SafetensorsFile f = io::load_safetensors(path);
  std::vector<std::pair<std::string, Tensor>> tensors(f.tensors.begin(), f.tensors.end());
  f.metadata["autocast_op_lists"] = R"({"lower-precision": ["no_such_op"], "fp32": []})";
  const std::string damaged = dir.file("damaged.safetensors");
  io::save_safetensors(damaged, tensors, f.metadata);
  const std::string d = resume_error(c, damaged, [](auto&) {});
  EXPECT_NE(d.find("metadata 'autocast_op_lists' is not a policy's lists"), std::string::npos) << d;
  EXPECT_NE(d.find("the file is damaged"), std::string::npos) << d;
}

// A run whose loss scale started from a numerics report resumes with the same initial scale
// however it is given (the report by another path, or the value itself); the scale is what is
// compared, not the report's file name.
TEST(ResumeChecks, AnInitialScaleFromAReportIsComparedByValue) {
  const testing::TempDir dir;
  train::TrainConfig c = base();
  c.precision = "16-mixed";
  const std::string report = dir.file("n.json");
  testing::write_raw(report, R"({"suggested_loss_scale": {"scale": 131072}})");
  c.loss_scale_init_report = report;
  const std::string path = checkpoint(dir, c);
  EXPECT_EQ(resume_error(c, path, [](auto&) {}), "");
  EXPECT_EQ(
      resume_error(c, path, [&](auto& r) { r.loss_scale_init_report = dir.path() + "/./n.json"; }),
      "");
  EXPECT_EQ(resume_error(c, path,
                         [](auto& r) {
                           r.loss_scale_init_report.clear();
                           r.loss_scale_init = 131072;
                         }),
            "");
  const std::string e = resume_error(c, path, [](auto& r) {
    r.loss_scale_init_report.clear();
    r.loss_scale_init = 1024;
  });
  EXPECT_NE(e.find("(initial 131072,"), std::string::npos) << e;
  EXPECT_NE(e.find("(initial 1024,"), std::string::npos) << e;
}

TEST(ResumeChecks, TheStochasticRoundingSeedIsReadBack) {
  const testing::TempDir dir;
  train::TrainConfig c = base();
  c.precision = "16-true";
  c.stochastic_rounding = true;
  const std::string path = checkpoint(dir, c);
  io::SafetensorsFile f = io::load_safetensors(path);
  const std::string recorded = f.metadata.at("stochastic_rounding_seed");
  EXPECT_EQ(resume_error(c, path, [](auto&) {}), "");
  // The seed in the file, not the run's, is what the writes used: a different one is refused.
  f.metadata["stochastic_rounding_seed"] = "12345";
  std::vector<std::pair<std::string, Tensor>> tensors(f.tensors.begin(), f.tensors.end());
  const std::string tampered = dir.file("tampered.safetensors");
  io::save_safetensors(tampered, tensors, f.metadata);
  const std::string e = resume_error(c, tampered, [](auto&) {});
  EXPECT_NE(e.find(tampered + " was trained with stochastic-rounding seed 12345, not " + recorded),
            std::string::npos)
      << e;
  // Without it in the file, or without it in the run, the two disagree.
  f.metadata.erase("stochastic_rounding_seed");
  f.metadata.erase("precision_settings");  // as an older checkpoint, which does not record it
  io::save_safetensors(tampered, tensors, f.metadata);
  EXPECT_NE(resume_error(c, tampered, [](auto&) {}).find("was trained without stochastic rounding"),
            std::string::npos);
}

TEST(ResumeChecks, ChangedSettingsResumeAndAreNamedInOneLine) {
  const testing::TempDir dir;
  train::TrainConfig c = base();
  c.lr_schedule = "cosine";
  c.epochs = 2;
  c.save = dir.file("part.safetensors");
  train::Trainer(c).run();

  auto resumed_output = [&](const Edit& edit) {
    train::TrainConfig r = c;
    r.save.clear();
    r.resume = c.save;
    r.max_steps = 3;
    edit(r);
    std::ostringstream out;
    train::Trainer(r, {&out, nullptr}).run();
    return out.str();
  };
  // The same settings: nothing to say.
  EXPECT_EQ(resumed_output([](auto&) {}).find("change the run"), std::string::npos);
  const std::string out = resumed_output([](auto& r) {
    r.lr = 5e-4;
    r.max_grad_norm = 1;
    r.epochs = 3;  // the cosine schedule spans the epochs
  });
  EXPECT_NE(out.find("resuming " + c.save +
                     " at step 2 with settings that change the run from there: --lr 0.0005 (the "
                     "checkpoint's: 0.001), --max-grad-norm 1 (the checkpoint's: 0), --epochs 3 "
                     "(the checkpoint's: 2)\n"),
            std::string::npos)
      << out;
  // More epochs under a constant schedule only lengthen the run: nothing to say.
  c.lr_schedule = "constant";
  train::Trainer(c).run();
  EXPECT_EQ(resumed_output([](auto& r) { r.epochs = 3; }).find("change the run"),
            std::string::npos);
}

// The same global batch split otherwise (here into micro-batches) resumes, and is named as a
// change: the images of a step are summed in another order.
TEST(ResumeChecks, AnotherSplitOfTheGlobalBatchIsNamed) {
  const testing::TempDir dir;
  const train::TrainConfig c = base();  // batch 16
  const std::string path = checkpoint(dir, c);
  train::TrainConfig r = c;
  r.resume = path;
  r.max_steps = 3;
  r.batch_size = 8;
  r.gradient_accumulation = 2;
  std::ostringstream out;
  train::Trainer t(r, {&out, nullptr});
  EXPECT_NE(out.str().find("resuming " + path +
                           " at step 2 with settings that change the run from there: the global "
                           "batch of 16 as 1 rank x --batch-size 8 x --gradient-accumulation 2 "
                           "(the checkpoint's: 1 rank x --batch-size 16 x "
                           "--gradient-accumulation 1)\n"),
            std::string::npos)
      << out.str();
}

// The steps the loss scaler skipped before a resume are the run's too: the resumed run reports
// the same list as the run that was not stopped.
TEST(ResumeChecks, TheSkippedStepsCoverTheWholeRun) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 256);
  c.precision = "16-mixed";
  c.loss_scale_init = 1073741824.0;  // 2^30: the first steps overflow
  c.loss_scale_growth_interval = 3;
  c.loss_scale_hysteresis = 2;
  c.max_steps = 16;
  const train::TrainResult whole = train::Trainer(c).run();
  train::TrainConfig first = c;
  first.max_steps = 8;
  first.save = dir.file("part.safetensors");
  const train::TrainResult part = train::Trainer(first).run();
  ASSERT_FALSE(part.skipped.empty()) << "the test needs skipped steps before the resume";
  train::TrainConfig rest = c;
  rest.resume = first.save;
  const train::TrainResult resumed = train::Trainer(rest).run();
  EXPECT_EQ(resumed.step_losses, whole.step_losses);
  EXPECT_EQ(resumed.skipped_steps, whole.skipped_steps);
  EXPECT_EQ(resumed.skipped, whole.skipped);
  EXPECT_EQ(static_cast<int64_t>(resumed.skipped.size()), resumed.skipped_steps);
}

TEST(ResumeChecks, AMaxStepsAtOrBelowTheCheckpointsStepIsRefused) {
  const testing::TempDir dir;
  const train::TrainConfig c = base();  // saved at step 2
  const std::string path = checkpoint(dir, c);
  for (const int64_t max_steps : {1, 2}) {
    const std::string e = resume_error(c, path, [&](auto& r) { r.max_steps = max_steps; });
    EXPECT_NE(e.find(path + " is at step 2, and this run's --max-steps " +
                     std::to_string(max_steps) + " ends it at step " + std::to_string(max_steps) +
                     ": the resume would train nothing"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("pass a --max-steps above 2"), std::string::npos) << e;
  }
  EXPECT_EQ(resume_error(c, path, [](auto& r) { r.max_steps = 3; }), "");
}

}  // namespace
}  // namespace mantissa
