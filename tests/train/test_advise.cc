// The precision advisor (train/advise.h): a layer whose outputs overflow FP16 but not BF16 is
// named and kept in FP32, and the recommendation trains like FP32 where the naive precision
// fails; updates lost in BF16 ask for --kahan; the built-in models at their defaults get a clean
// bill for 16-mixed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;

// tutorial-cnn at 24x24 with conv2's weights scaled by `factor`: its outputs (and the ReLU's
// after it) reach ~10^5, past FP16's 65504; the GroupNorm after them brings them back to order 1,
// so FP32 trains as before.
std::string scaled_conv2(const testing::TempDir& dir, double factor) {
  train::TrainConfig c = testing::small_run("tutorial-cnn", 64);
  auto model = nn::make_model("tutorial-cnn", {.in_channels = 1, .image_size = 24, .seed = 0});
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (auto& p : model->named_parameters())
    tensors.emplace_back(p.name, p.name == "conv2.weight"
                                     ? ops::mul_scalar(*p.tensor, factor).detach()
                                     : p.tensor->clone());
  const std::string path = dir.file("scaled.safetensors");
  io::save_safetensors(path, tensors);
  return path;
}

train::AdviseConfig small_advice(const std::string& model, const std::string& precision) {
  train::AdviseConfig a;
  a.train = testing::small_run(model, 64);
  a.train.precision = precision;
  a.steps = 4;
  return a;
}

const train::LayerAdvice& layer(const train::Advice& a, const std::string& name) {
  auto it = std::find_if(a.layers.begin(), a.layers.end(),
                         [&](const train::LayerAdvice& l) { return l.name == name; });
  EXPECT_NE(it, a.layers.end()) << name;
  return *it;
}

TEST(Advise, NamesTheLayerWhoseOutputsOverflowFp16AndVerifiesTheFix) {
  testing::TempDir dir;
  train::AdviseConfig a = small_advice("tutorial-cnn", "16-mixed");
  a.train.init_from = scaled_conv2(dir, 524288);
  a.verify = 6;
  const train::Advice advice = train::advise(a);
  EXPECT_GT(layer(advice, "conv2").activations.overflow, 0.01) << train::advice_text(advice);
  EXPECT_EQ(layer(advice, "conv1").activations.overflow, 0);
  EXPECT_EQ(layer(advice, "fc1").activations.overflow, 0);
  const train::Recommendation& r = advice.recommendation;
  // The overflow is named, and BF16 recommended: keeping conv2 in FP32 would not do, as the
  // model's functional ReLU after it runs in FP16.
  EXPECT_TRUE(r.keep_fp32.empty());
  EXPECT_EQ(r.precision, "bf16-mixed");
  EXPECT_EQ(r.half_type, "bf16");
  EXPECT_EQ(r.loss_scaling, "none");
  EXPECT_FALSE(r.clean);
  EXPECT_NE(r.reasons[0].find("conv2: "), std::string::npos) << r.reasons[0];
  EXPECT_NE(r.command.find("--precision bf16-mixed"), std::string::npos) << r.command;
  // In BF16 nothing overflows.
  train::AdviseConfig b = a;
  b.train.precision = "bf16-mixed";
  const train::Advice in_bf16 = train::advise(b);
  EXPECT_EQ(layer(in_bf16, "conv2").activations.overflow, 0);
  EXPECT_TRUE(in_bf16.recommendation.keep_fp32.empty());
  EXPECT_TRUE(in_bf16.recommendation.clean);

  const train::Verification v = train::verify(a, advice);
  ASSERT_EQ(v.runs.size(), 3u);
  const train::VerifyRun &fp32 = v.runs[0], &rec = v.runs[1], &naive = v.runs[2];
  ASSERT_TRUE(fp32.failure.empty()) << fp32.failure;
  ASSERT_TRUE(rec.failure.empty()) << rec.failure;
  EXPECT_EQ(rec.losses.size(), 6u);
  EXPECT_LT(rec.gap, 0.01);
  EXPECT_EQ(rec.skipped, 0);
  // The naive run's forward pass overflows: its loss is not finite at the first step.
  EXPECT_NE(naive.failure.find("the loss became nan at step 1"), std::string::npos)
      << naive.failure << train::advice_text(advice, &v);
  EXPECT_TRUE(naive.losses.empty());
}

TEST(Advise, UpdatesLostInBf16AskForKahan) {
  train::AdviseConfig a = small_advice("lenet5", "bf16-true");
  a.train.lr = 1e-6;
  const train::Advice advice = train::advise(a);
  EXPECT_TRUE(advice.parameters_16bit);
  EXPECT_GT(*layer(advice, "fc1").updates_lost, 0.9);
  EXPECT_TRUE(advice.recommendation.kahan);
  EXPECT_NE(advice.recommendation.command.find("--kahan"), std::string::npos);
  // At the default learning rate most updates move BF16 weights: no compensation needed.
  // At the default learning rate fewer are lost (AdamW's weight decay and the updates of
  // weights whose gradient is near zero still are).
  const train::Advice at_default = train::advise(small_advice("lenet5", "bf16-true"));
  EXPECT_LT(*layer(at_default, "fc1").updates_lost, 0.5);
  // Under 16-mixed the FP32 master weights keep every update, whatever the learning rate.
  train::AdviseConfig m = a;
  m.train.precision = "bf16-mixed";
  EXPECT_FALSE(train::advise(m).recommendation.kahan);
  // The recommended run is the target with --kahan, and --verify runs it.
  const train::TrainConfig rc = train::recommended_config(a.train, advice.recommendation);
  EXPECT_TRUE(rc.kahan);
  EXPECT_EQ(rc.precision, "bf16-true");
  a.verify = 2;
  const train::Verification v = train::verify(a, advice);
  ASSERT_FALSE(v.runs.empty());
}

TEST(Advise, DefaultModelsGetACleanBillFor16Mixed) {
  for (const char* model : {"tutorial-cnn", "lenet5", "resnet18"}) {
    train::AdviseConfig a = small_advice(model, "16-mixed");
    a.train.batch_size = 8;
    const train::Advice advice = train::advise(a);
    const train::Recommendation& r = advice.recommendation;
    EXPECT_TRUE(r.clean) << model << ": " << train::advice_text(advice);
    EXPECT_TRUE(r.keep_fp32.empty()) << model;
    EXPECT_EQ(r.half_type, "fp16") << model;
    EXPECT_EQ(r.loss_scaling, "dynamic") << model;
    ASSERT_TRUE(advice.loss_scale_min && advice.loss_scale_max) << model;
    EXPECT_LE(*advice.loss_scale_min, *advice.loss_scale_max) << model;
  }
}

TEST(Advise, JsonFollowsTheLayout) {
  const train::Advice advice = train::advise(small_advice("lenet5", "16-mixed"));
  const nlohmann::json j = nlohmann::json::parse(train::advice_json(advice));
  EXPECT_EQ(j["precision"], "16-mixed");
  ASSERT_GE(j["layers"].size(), 5u);
  const nlohmann::json& fc1 = j["layers"][2];
  EXPECT_EQ(fc1["name"], "fc1");
  for (const char* part : {"weights", "activations", "gradients"})
    for (const char* key : {"overflow", "underflow", "subnormal"})
      EXPECT_TRUE(fc1[part][key].is_number()) << part << "." << key;
  EXPECT_TRUE(fc1["updates_lost"].is_number());
  EXPECT_TRUE(j["layers"].back()["weights"].is_null());  // flatten has no parameters
  EXPECT_LT(j["loss_scale"]["min"].get<double>(), j["loss_scale"]["max"].get<double>());
  const nlohmann::json& r = j["recommendation"];
  EXPECT_TRUE(r["keep_fp32"].is_array());
  EXPECT_EQ(r["loss_scaling"], "dynamic");
  EXPECT_EQ(r["half_type"], "fp16");
  EXPECT_EQ(r["command"],
            "mantissa train --model lenet5 --dataset synthetic --image-size 16 "
            "--synthetic-size 64 --batch-size 16 --precision 16-mixed --loss-scaling dynamic");
}

TEST(Advise, RecommendationBecomesATrainConfig) {
  train::TrainConfig base = testing::small_run("lenet5", 64);
  base.precision = "16-mixed";
  train::Recommendation r;
  r.precision = "bf16-mixed";
  r.half_type = "bf16";
  r.keep_fp32 = {"fc1"};
  r.loss_scaling = "none";
  train::TrainConfig c = train::recommended_config(base, r);
  EXPECT_EQ(c.precision, "bf16-mixed");
  EXPECT_EQ(c.half_type, "");
  EXPECT_EQ(c.keep_fp32, std::vector<std::string>{"fc1"});
  EXPECT_EQ(c.loss_scaling, "none");
  EXPECT_NO_THROW(train::validate(c));
  // The modes whose name does not fix the 16-bit type take --half-type.
  base.precision = "O2";
  r.precision = "O2";
  c = train::recommended_config(base, r);
  EXPECT_EQ(c.half_type, "bf16");
  EXPECT_NO_THROW(train::validate(c));
}

TEST(Advise, RefusesWhatItCannotAdvise) {
  train::AdviseConfig a = small_advice("lenet5", "32-true");
  EXPECT_THROW(train::advise(a), Error);
  a.train.precision = "fp17";
  EXPECT_THROW(train::advise(a), Error);
  for (const char* fp8 : {"fp8-hybrid", "fp8-e4m3"}) {
    a.train.precision = fp8;
    EXPECT_NE(error_of([&] {
                train::advise(a);
              }).find("computes in FP8, which the advisor does not model"),
              std::string::npos)
        << fp8;
  }
  a.train.precision = "16-mixed";
  a.steps = 0;
  EXPECT_THROW(train::advise(a), Error);
  a.steps = 2;
  a.train.keep_fp32 = {"fc1"};
  EXPECT_THROW(train::advise(a), Error);
}

}  // namespace
}  // namespace mantissa
