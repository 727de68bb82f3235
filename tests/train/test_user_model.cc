// A user-defined model and an in-memory dataset through the trainer: learning in 32-true and
// 16-mixed, bit-exact resume, the levers and reports, the fields only built-in models use
// refused, and checkpoints that refuse to resume into another model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"
#include "train/report_page.h"

namespace mantissa {
namespace {

using testing::error_of;
using testing::UserMlp;

constexpr int64_t kFeatures = 8, kClasses = 4;

std::shared_ptr<UserMlp> user_model(int64_t width = 16, const std::string& type = "UserMlp") {
  return std::make_shared<UserMlp>(kFeatures, width, kClasses, 0, type);
}

train::TrainConfig user_run(const std::string& precision) {
  train::TrainConfig c;
  c.precision = precision;
  c.batch_size = 32;
  c.lr = 3e-3;
  c.epochs = 3;
  c.progress = false;
  return c;
}

struct UserRun {
  train::TrainResult result;
  std::vector<std::pair<std::string, std::vector<float>>> saved;  // the checkpoint, if any
};

UserRun train_user(const train::TrainConfig& c,
                   std::shared_ptr<nn::Classifier> model = user_model(), bool with_test = true,
                   std::ostream* out = nullptr) {
  auto train_data = testing::blobs(512, kFeatures, kClasses, 1);
  auto test_data = with_test ? testing::blobs(128, kFeatures, kClasses, 2) : nullptr;
  train::Trainer t(c, std::move(model), train_data, test_data, {out, nullptr});
  UserRun r;
  r.result = t.run();
  if (!c.save.empty())
    for (auto& [name, tensor] : io::load_safetensors(c.save).tensors)
      r.saved.emplace_back(name, tensor.to_float_vector());
  return r;
}

TEST(UserModel, LearnsInFp32AndMixedPrecisionAndResumesBitExactly) {
  for (const std::string p : {"32-true", "16-mixed"}) {
    const testing::TempDir dir;
    train::TrainConfig c = user_run(p);
    c.save = dir.file("whole.safetensors");
    std::ostringstream out;
    const UserRun whole = train_user(c, user_model(), true, &out);
    const train::TrainResult& r = whole.result;
    ASSERT_EQ(r.step_losses.size(), 3u * 16) << p;  // 512 / 32 steps an epoch
    EXPECT_LT(r.step_losses.back(), 0.5 * r.step_losses.front()) << p;
    ASSERT_TRUE(r.test_accuracy.has_value()) << p;
    EXPECT_GT(*r.test_accuracy, 0.9) << p;
    EXPECT_EQ(r.test_examples, 128) << p;
    EXPECT_EQ(r.loss_scale.has_value(), p == "16-mixed") << p;
    EXPECT_NE(out.str().find("precision " + p + ": parameters f32"), std::string::npos) << p;
    EXPECT_NE(out.str().find("test accuracy: "), std::string::npos) << p;

    // 21 steps (mid-epoch), then resumed to the end: the same losses and tensors, bit for bit.
    c.max_steps = 21;
    c.save = dir.file("part.safetensors");
    train_user(c);
    c.max_steps = 0;
    c.resume = dir.file("part.safetensors");
    c.save = dir.file("resumed.safetensors");
    const UserRun resumed = train_user(c);
    EXPECT_EQ(resumed.result.step_losses, r.step_losses) << p;
    EXPECT_EQ(resumed.saved, whole.saved) << p;
    const io::SafetensorsFile f = io::load_safetensors(dir.file("resumed.safetensors"));
    EXPECT_EQ(f.metadata.at("model"), "UserMlp");
    EXPECT_EQ(f.metadata.at("dataset"), "blobs");
    EXPECT_TRUE(f.contains("block.0.weight"));  // the layer norm, under its module path
    EXPECT_TRUE(f.contains("optimizer.output.weight.exp_avg"));
  }
}

TEST(UserModel, GetsTheLeversAndReports) {
  const testing::TempDir dir;
  train::TrainConfig c = user_run("16-mixed");
  c.max_steps = 6;
  c.gradient_accumulation = 2;
  c.accumulation_reduction = "running";
  c.device_iterations = 3;
  c.output_mode = "all";
  c.recompute = true;
  c.async_loader = true;
  c.workers = 2;
  c.numerics_report = dir.file("numerics.json");
  c.metrics_json = dir.file("metrics.json");
  c.report = dir.file("report.html");
  c.profile = true;
  c.memory_budget = "64MiB";
  std::ostringstream out;
  const train::TrainResult r = train_user(c, user_model(), true, &out).result;
  EXPECT_EQ(r.steps, 6);
  EXPECT_EQ(r.calls, 2);
  EXPECT_EQ(r.profiled_steps, 6);
  bool recomputed = false;
  for (const ProfileRow& row : r.profile) recomputed = recomputed || row.phase == "recompute";
  EXPECT_TRUE(recomputed) << "the block runs again in the backward pass";
  EXPECT_GT(r.memory.peak_of(MemoryCategory::optimizer_state), 0u);
  EXPECT_NE(out.str().find("numerics report: "), std::string::npos) << out.str();
  std::ifstream in(c.metrics_json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["config"]["model"], "UserMlp");
  EXPECT_EQ(j["config"]["dataset"], "blobs");
  EXPECT_TRUE(j["config"]["image_size"].is_null());
  EXPECT_EQ(j["step_losses"].size(), 6u);
  const std::string page = testing::read_text(c.report);
  EXPECT_EQ(testing::report_data(page), j);
  EXPECT_NE(page.find("<h1>Training: UserMlp on blobs, 16-mixed</h1>"), std::string::npos);

  // O2 reads the layer norm's weights (a normalization layer by its property) in FP32 and the
  // rest of the FP32 parameters as 16-bit, training to the end.
  train::TrainConfig o2 = user_run("O2");
  auto model = user_model();
  train::Trainer t(o2, model, testing::blobs(64, kFeatures, kClasses, 1), nullptr);
  const Tensor& norm_w = *model->submodule("block.0").named_parameters()[0].tensor;
  const Tensor& fc_w = *model->submodule("block.1").named_parameters()[0].tensor;
  EXPECT_EQ(norm_w.dtype(), DType::f32);
  EXPECT_FALSE(norm_w.autograd_meta()->read_as.has_value());
  EXPECT_EQ(fc_w.dtype(), DType::f32);
  EXPECT_EQ(fc_w.autograd_meta()->read_as, DType::f16);
  const train::TrainResult ro2 = t.run();
  ASSERT_FALSE(ro2.step_losses.empty());
  EXPECT_TRUE(std::isfinite(ro2.step_losses.back()));
}

// A user's model whose loss() breaks its contract (one FP32 value) is named, not trained into a
// misleading autograd error or silently skipped steps.
class SixteenBitLoss : public UserMlp {
 public:
  explicit SixteenBitLoss(bool whole) : UserMlp(kFeatures, 16, kClasses, 0), whole_(whole) {}
  Tensor loss(const Tensor& output, const Tensor& labels) const override {
    const Tensor l = UserMlp::loss(output, labels);
    return whole_ ? ops::cast(output, DType::f16) : ops::cast(l, DType::f16);
  }

 private:
  bool whole_;
};

TEST(UserModel, ALossThatIsNotOneFp32ValueIsRefused) {
  train::TrainConfig c = user_run("16-mixed");
  c.max_steps = 2;
  for (const bool whole : {false, true}) {
    const std::string e = error_of([&] { train_user(c, std::make_shared<SixteenBitLoss>(whole)); });
    EXPECT_NE(e.find(whole ? "the model's loss() returned f16 (32, 4), not the one-element f32 "
                             "tensor the trainer takes"
                           : "the model's loss() returned f16 (), not the one-element f32"),
              std::string::npos)
        << e;
  }
}

// The precision's parameter type applies to a user's model whatever type it arrives in: a model
// made 16-bit before training in 32-true or 16-mixed trains FP32 parameters (the settings line
// says so), so updates smaller than a 16-bit step are not lost.
TEST(UserModel, AModelArrivingIn16BitsTrainsInTheModesParameterType) {
  for (const char* precision : {"32-true", "16-mixed"}) {
    train::TrainConfig c = user_run(precision);
    c.max_steps = 2;
    auto model = user_model();
    model->half();
    train::Trainer t(c, model, testing::blobs(128, kFeatures, kClasses, 1), nullptr);
    for (const nn::Module::NamedTensor& p : t.model().named_parameters())
      EXPECT_EQ(p.tensor->dtype(), DType::f32) << precision << " " << p.name;
    t.run();
  }
}

// A Trainer runs once; a second run() would return the first run's figures and train nothing.
// And a call of the training step names a batch without images or labels.
TEST(UserModel, ASecondRunAndAnEmptyBatchAreRefused) {
  train::TrainConfig c = user_run("32-true");
  c.max_steps = 2;
  train::Trainer t(c, user_model(), testing::blobs(128, kFeatures, kClasses, 1), nullptr);
  EXPECT_EQ(t.run().steps, 2);
  const std::string e = error_of([&] { t.run(); });
  EXPECT_NE(e.find("this Trainer has run already (to step 2): a second run() would train nothing"),
            std::string::npos)
      << e;
  data::Batch empty;
  EXPECT_NE(error_of([&] { t.call({empty}); }).find("got batch 0 without images"),
            std::string::npos);
  data::Batch no_labels;
  no_labels.images = Tensor::zeros({2, kFeatures}, DType::f32);
  EXPECT_NE(error_of([&] { t.call({no_labels}); }).find("got batch 0 without labels"),
            std::string::npos);
}

TEST(UserModel, WithoutATestSetTheRunIsNotEvaluated) {
  train::TrainConfig c = user_run("32-true");
  c.max_steps = 2;
  std::ostringstream out;
  const train::TrainResult r = train_user(c, user_model(), false, &out).result;
  EXPECT_FALSE(r.test_accuracy.has_value());
  EXPECT_EQ(out.str().find("test accuracy"), std::string::npos);
}

TEST(UserModel, FieldsOfTheBuiltInModelsAreRefused) {
  auto set = [](auto edit) {
    train::TrainConfig c = user_run("32-true");
    edit(c);
    return error_of([&] { train_user(c); });
  };
  EXPECT_NE(set([](auto& c) { c.model = "lenet5"; }).find("TrainConfig::model names a built-in"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.dataset = "mnist"; }).find("TrainConfig::dataset"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.data_dir = "/data"; }).find("TrainConfig::data_dir"),
            std::string::npos);
  const std::string size = set([](auto& c) { c.image_size = 32; });
  EXPECT_NE(size.find("TrainConfig::image_size"), std::string::npos) << size;
  EXPECT_NE(size.find("ExampleSource::get"), std::string::npos) << size;
  EXPECT_NE(set([](auto& c) { c.imagenet_stem = true; }).find("TrainConfig::imagenet_stem"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.train_limit = 10; }).find("TrainConfig::train_limit"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.test_limit = 10; }).find("TrainConfig::test_limit"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.augment = true; }).find("TrainConfig::augment"), std::string::npos);
  EXPECT_NE(set([](auto& c) { c.synthetic_size = 10; }).find("TrainConfig::synthetic_size"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) { c.eight_bit_io = true; }).find("TrainConfig::eight_bit_io"),
            std::string::npos);
  // The rest of the configuration is checked as for a built-in model.
  EXPECT_NE(set([](auto& c) { c.precision = "fp8"; }).find("unknown precision 'fp8'"),
            std::string::npos);
  EXPECT_NE(set([](auto& c) {
              c.precision = "16-true";
              c.keep_fp32 = {"blok"};
            }).find("blok"),
            std::string::npos);
  // A model without blocks cannot be recomputed.
  train::TrainConfig c = user_run("32-true");
  c.recompute = true;
  nn::ModelConfig mc;
  mc.image_size = 16;
  const std::string e = error_of([&] { train_user(c, nn::make_model("lenet5", mc)); });
  EXPECT_NE(e.find("LeNet5 has no blocks to recompute"), std::string::npos) << e;
  EXPECT_NE(e.find("recompute_blocks()"), std::string::npos) << e;
}

TEST(UserModel, ACheckpointResumesOnlyIntoItsModel) {
  const testing::TempDir dir;
  train::TrainConfig c = user_run("32-true");
  c.max_steps = 2;
  c.save = dir.file("user.safetensors");
  train_user(c);
  train::TrainConfig again = c;
  again.save.clear();
  again.resume = c.save;
  // The same type with other shapes: the first tensor that does not fit is named.
  std::string e = error_of([&] { train_user(again, user_model(24)); });
  EXPECT_NE(e.find("tensor 'input.weight' has shape (16, 8) but the model's is (24, 8)"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("resume into the model the checkpoint was saved from"), std::string::npos) << e;
  // Another type.
  e = error_of([&] { train_user(again, user_model(16, "OtherMlp")); });
  EXPECT_NE(e.find("is a checkpoint of UserMlp, not of OtherMlp"), std::string::npos) << e;
  // A built-in model, either way round; and `mantissa eval` cannot rebuild it.
  train::TrainConfig builtin = testing::small_run("lenet5", 64);
  builtin.resume = c.save;
  e = error_of([&] { train::Trainer t(builtin); });
  EXPECT_NE(e.find("is a checkpoint of a user-defined model (UserMlp), not of lenet5"),
            std::string::npos)
      << e;
  e = error_of([&] { train::evaluate_checkpoint(c.save, "synthetic", "", 0, 8); });
  EXPECT_NE(e.find("holds a user-defined model (UserMlp)"), std::string::npos) << e;
  builtin.resume.clear();
  builtin.max_steps = 1;
  builtin.save = dir.file("lenet.safetensors");
  train::Trainer(builtin).run();
  again.resume = builtin.save;
  e = error_of([&] { train_user(again); });
  EXPECT_NE(e.find("is a checkpoint of the built-in model lenet5, not of UserMlp"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace mantissa
