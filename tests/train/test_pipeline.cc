// The IPU guide's pipeline levers through the trainer: gradient accumulation (equivalent to a
// larger batch; the running mean that cannot overflow 16-bit accumulators), device iterations and
// their output modes, 8-bit input normalized by the model, the asynchronous loader (same run for
// any number of workers), and a clean stop on request (Ctrl-C) that resumes bit-exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <streambuf>
#include <string>
#include <thread>

#include "mantissa/mantissa.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"
#include "train/report_page.h"

namespace mantissa {
namespace {

using testing::error_of;

std::vector<float> parameters(train::Trainer& t) {
  std::vector<float> v;
  for (auto& p : t.model().named_parameters()) {
    const std::vector<float> x = p.tensor->to_float_vector();
    v.insert(v.end(), x.begin(), x.end());
  }
  return v;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    scale = std::max(scale, std::fabs(double(a[i])));
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])) / scale);
  return worst;
}

// tutorial-cnn normalizes per image (group norm): no batch statistics, so N micro-batches of B
// are one batch of N*B up to the order of the sums.
TEST(GradientAccumulation, EqualsOneBatchNTimesLarger) {
  train::TrainConfig big = testing::small_run("tutorial-cnn", 256);
  big.optimizer = "sgd";
  big.lr = 0.05;
  big.batch_size = 64;
  big.max_steps = 3;
  train::Trainer tb(big);
  const train::TrainResult rb = tb.run();
  const std::vector<float> pb = parameters(tb);
  for (const std::string reduction : {"mean", "running", "sum"}) {
    train::TrainConfig c = big;
    c.batch_size = 16;
    c.gradient_accumulation = 4;
    c.accumulation_reduction = reduction;
    if (reduction == "sum") c.lr = big.lr / 4;  // the sum is 4x the mean gradient
    train::Trainer t(c);
    const train::TrainResult r = t.run();
    ASSERT_EQ(r.step_losses.size(), 3u) << reduction;
    for (size_t s = 0; s < 3; ++s)
      EXPECT_NEAR(r.step_losses[s], rb.step_losses[s], 2e-5 * std::fabs(rb.step_losses[s]))
          << reduction << " step " << s;
    EXPECT_LT(max_rel_diff(parameters(t), pb), 1e-5) << reduction;
    EXPECT_EQ(r.epochs[0].steps, 3);
  }
}

// With FP16 gradient accumulators, the summed gradients of N micro-batches overflow where each
// micro-batch's gradient (and so their running mean) does not.
TEST(GradientAccumulation, RunningMeanCannotOverflowSixteenBitAccumulators) {
  auto skipped = [](const std::string& reduction, double scale) {
    train::TrainConfig c = testing::small_run("lenet5", 256);
    c.precision = "16-mixed";
    c.accum_type = "fp16";
    c.optimizer = "sgd";
    c.lr = 0.01;
    c.gradient_accumulation = 4;
    c.accumulation_reduction = reduction;
    c.loss_scaling = std::to_string(scale);  // static: an overflow skips the step
    c.max_steps = 1;
    train::Trainer t(c);
    return t.run().skipped_steps;
  };
  // The largest power-of-two scale at which the running mean has no overflow.
  double scale = 1;
  while (scale < 1e12 && skipped("running", scale * 2) == 0) scale *= 2;
  ASSERT_LT(scale, 1e12) << "gradients never overflowed";
  ASSERT_GT(scale, 1) << "no room to test";
  EXPECT_EQ(skipped("running", scale), 0);
  EXPECT_EQ(skipped("mean", scale), 1) << "the sum of 4 micro-batch gradients at scale " << scale;
  EXPECT_EQ(skipped("sum", scale), 1);
}

TEST(DeviceIterations, RunTheSameStepsAndReturnWhatTheOutputModeAsks) {
  train::TrainConfig one = testing::small_run("lenet5", 256);
  one.max_steps = 7;
  const train::TrainResult r1 = train::Trainer(one).run();
  EXPECT_EQ(r1.calls, 7);
  auto mean_of = [&](std::vector<int> steps) {
    double s = 0;
    for (int k : steps) s += r1.step_losses[static_cast<size_t>(k - 1)];
    return s / static_cast<double>(steps.size());
  };
  struct Case {
    std::string mode;
    int64_t period;
    std::vector<int> returned;  // 1-based steps whose outputs come back
  };
  for (const Case& k :
       {Case{"all", 1, {1, 2, 3, 4, 5, 6, 7}}, Case{"sum", 1, {1, 2, 3, 4, 5, 6, 7}},
        Case{"final", 1, {3, 6, 7}}, Case{"every", 2, {2, 5}}}) {
    train::TrainConfig c = one;
    c.device_iterations = 3;
    c.output_mode = k.mode;
    c.output_return_period = k.period;
    const train::TrainResult r = train::Trainer(c).run();
    EXPECT_EQ(r.step_losses, r1.step_losses) << k.mode << ": the same steps, bit for bit";
    EXPECT_EQ(r.calls, 3) << k.mode;  // 3 + 3 + 1 steps
    // Each call's time is shared by its steps: three equal times, three more, then one.
    ASSERT_EQ(r.step_seconds.size(), 7u) << k.mode;
    EXPECT_EQ(r.step_seconds[0], r.step_seconds[2]) << k.mode;
    EXPECT_EQ(r.step_seconds[3], r.step_seconds[5]) << k.mode;
    ASSERT_EQ(r.epochs.size(), 1u);
    EXPECT_NEAR(r.epochs[0].loss, mean_of(k.returned), 1e-6) << k.mode;
    EXPECT_EQ(r.epochs[0].steps, 7);
  }
  train::TrainConfig bad = one;
  bad.device_iterations = 2;
  bad.output_mode = "every";
  bad.output_return_period = 3;
  EXPECT_NE(
      error_of([&] { train::validate(bad); }).find("must lie in [1, --device-iterations = 2]"),
      std::string::npos);
  bad.output_mode = "last";
  EXPECT_NE(error_of([&] { train::validate(bad); }).find("use all, sum, final or every"),
            std::string::npos);
}

TEST(EightBitIo, NormalizingInTheModelGivesTheSameRunWithAQuarterOfTheBytes) {
  // Synthetic images are made at the model's size: no resize, so the u8 batches hold the exact
  // pixels and the model's normalization reproduces the loader's floats bit for bit.
  for (const std::string precision : {"32-true", "16-true"}) {
    train::TrainConfig c = testing::small_run("lenet5", 256);
    c.precision = precision;
    c.max_steps = 4;
    const train::TrainResult plain = train::Trainer(c).run();
    c.eight_bit_io = true;
    const train::TrainResult bytes = train::Trainer(c).run();
    EXPECT_EQ(bytes.step_losses, plain.step_losses) << precision;
    const int64_t labels = 4 * 16 * 8, pixels = 4 * 16 * 1 * 16 * 16;  // 4 batches of 16, 1 channel
    EXPECT_EQ(bytes.input_bytes, pixels + labels);
    EXPECT_EQ(plain.input_bytes, pixels * (precision == "32-true" ? 4 : 2) + labels);
  }
}

TEST(EightBitIo, TheInputOpNormalizesPerChannelAndRejectsBadInput) {
  Tensor x = Tensor::empty({1, 2, 1, 2}, DType::u8);
  uint8_t* p = static_cast<uint8_t*>(x.data_ptr());
  p[0] = 0, p[1] = 255, p[2] = 51, p[3] = 128;
  const Tensor y = ops::normalize_input(x, {0.5f, 0.25f}, {0.5f, 2.0f}, DType::f32);
  const std::vector<float> v = y.to_float_vector();
  EXPECT_EQ(v[0], (0 / 255.0f - 0.5f) / 0.5f);
  EXPECT_EQ(v[1], (255 / 255.0f - 0.5f) / 0.5f);
  EXPECT_EQ(v[2], (51 / 255.0f - 0.25f) / 2.0f);
  EXPECT_EQ(v[3], (128 / 255.0f - 0.25f) / 2.0f);
  EXPECT_EQ(ops::normalize_input(x, {0.5f}, {0.5f}, DType::bf16).dtype(), DType::bf16);
  EXPECT_NE(error_of([&] {
              ops::normalize_input(y, {0.5f}, {0.5f}, DType::f32);
            }).find("takes u8 images (N, C, H, W), not f32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::normalize_input(x, {0.5f, 0.5f, 0.5f}, {1, 1, 1}, DType::f32);
            }).find("3 means and 3 std values for 2 channels"),
            std::string::npos);
  auto model = nn::make_model("lenet5", {});
  Tensor img = Tensor::zeros({1, 1, 32, 32}, DType::u8);
  EXPECT_NE(error_of([&] { (*model)(img); }).find("got u8 images but has no input normalization"),
            std::string::npos);
}

TEST(AsyncLoader, AnyNumberOfWorkersGivesTheSameRun) {
  train::TrainConfig c = testing::small_run("lenet5", 256);
  c.max_steps = 6;
  c.augment = true;  // random crops and flips: made by whichever worker, keyed by position
  const train::TrainResult sync = train::Trainer(c).run();
  for (int workers : {1, 3}) {
    c.async_loader = true;
    c.workers = workers;
    const train::TrainResult r = train::Trainer(c).run();
    ASSERT_EQ(r.step_losses.size(), 6u);
    EXPECT_EQ(r.step_losses, sync.step_losses) << workers << " workers";
  }
}

// A dataset that records the threads its examples are made on.
class ThreadRecordingSource : public data::ExampleSource {
 public:
  explicit ThreadRecordingSource(std::shared_ptr<const data::ExampleSource> inner)
      : inner_(std::move(inner)) {}
  int64_t size() const override { return inner_->size(); }
  Shape example_shape() const override { return inner_->example_shape(); }
  int64_t num_classes() const override { return inner_->num_classes(); }
  int64_t get(int64_t index, float* input) const override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      threads_.insert(std::this_thread::get_id());
    }
    return inner_->get(index, input);
  }
  std::set<std::thread::id> threads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }

 private:
  std::shared_ptr<const data::ExampleSource> inner_;
  mutable std::mutex mu_;
  mutable std::set<std::thread::id> threads_;
};

// What --async-dataloader claims: the batches are made by its workers, off the training thread,
// while without it the training thread makes them itself.
TEST(AsyncLoader, WorkersMakeTheBatchesOffTheTrainingThread) {
  for (int workers : {0, 1, 2}) {
    train::TrainConfig c;
    c.batch_size = 16;
    c.max_steps = 6;
    c.progress = false;
    c.async_loader = workers > 0;
    c.workers = std::max(workers, 1);
    auto data = std::make_shared<ThreadRecordingSource>(testing::blobs(128, 8, 4, 1));
    train::Trainer t(c, std::make_shared<testing::UserMlp>(8, 16, 4, 0), data, nullptr);
    EXPECT_EQ(t.run().steps, 6);
    const std::set<std::thread::id> made_on = data->threads();
    ASSERT_FALSE(made_on.empty());
    if (workers == 0) {
      EXPECT_EQ(made_on, std::set<std::thread::id>{std::this_thread::get_id()});
    } else {
      EXPECT_EQ(made_on.count(std::this_thread::get_id()), 0u) << workers << " workers";
      EXPECT_LE(made_on.size(), static_cast<size_t>(workers));
    }
  }
}

// A stream whose first write asks the trainer to stop, as Ctrl-C does: the progress bar writes
// once the first call of the training step returns.
class StopOnWrite : public std::streambuf {
 protected:
  int overflow(int c) override {
    train::request_stop();
    return c;
  }
};

TEST(Interrupt, StopsAtAStepBoundarySavesAndResumesBitExactly) {
  const testing::TempDir dir;
  train::TrainConfig c = testing::small_run("lenet5", 256);
  c.max_steps = 5;
  c.async_loader = true;
  c.workers = 2;
  const train::TrainResult whole = train::Trainer(c).run();
  ASSERT_FALSE(whole.interrupted);

  c.save = dir.file("ckpt.safetensors");
  c.metrics_json = dir.file("metrics.json");
  c.report = dir.file("report.html");
  c.progress = true;
  c.evaluate = true;
  StopOnWrite stopper;
  std::ostream progress(&stopper);
  std::ostringstream out;
  train::Trainer first(c, {&out, &progress});
  const train::TrainResult part = first.run();
  EXPECT_TRUE(part.interrupted);
  EXPECT_EQ(part.steps, 1);
  EXPECT_FALSE(part.test_accuracy.has_value()) << "no evaluation after an interrupt";
  EXPECT_NE(out.str().find("interrupted at step 1, checkpoint saved to " + c.save),
            std::string::npos)
      << out.str();
  std::ifstream in(c.metrics_json);
  const nlohmann::json metrics = nlohmann::json::parse(in);
  EXPECT_TRUE(metrics["interrupted"].get<bool>());
  const std::string page = testing::read_text(c.report);
  EXPECT_EQ(testing::report_data(page), metrics) << "the report is written with the metrics";
  EXPECT_NE(page.find("1 (interrupted) in 1 epoch"), std::string::npos);

  c.resume = c.save;
  c.progress = false;
  c.evaluate = false;
  const train::TrainResult rest = train::Trainer(c).run();  // the stopped run cleared the request
  EXPECT_FALSE(rest.interrupted);
  EXPECT_EQ(rest.step_losses, whole.step_losses);

  train::TrainConfig other = c;
  other.gradient_accumulation = 2;
  EXPECT_NE(error_of([&] {
              train::Trainer t(other);
            }).find("was trained with --gradient-accumulation 1, not 2"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa
