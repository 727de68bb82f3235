// Gradients kept as what computes them under loss scaling (optim::Optimizer::defer_gradients):
// the same step and the same skips as the stored gradients, bit for bit; an overflow in the last
// gradient the backward pass produces changes nothing; and the trainer's 16-bit step with dynamic
// loss scaling holds no linear weight gradient whole (mantissa memory's peak).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"
#include "support/train.h"

namespace mantissa {
namespace {

// Normal values of standard deviation `scale` around `mean`.
Tensor random(const Shape& shape, uint32_t seed, float scale = 0.1f, float mean = 0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, scale);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  for (float& e : v) e = dist(gen);
  return Tensor::from_floats(v, shape);
}

std::vector<std::vector<float>> values(const std::vector<const Tensor*>& ts) {
  std::vector<std::vector<float>> v;
  for (const Tensor* t : ts) v.push_back(t->to_float_vector());
  return v;
}

std::vector<std::vector<float>> state_values(const optim::Optimizer& opt) {
  std::vector<std::vector<float>> v;
  for (auto& [name, t] : opt.state_tensors()) v.push_back(t.to_float_vector());
  return v;
}

// h = x * a (a per-feature scale), y = linear(h, w, b), loss = sum(y * y): w's gradient comes
// from linear's parts (deferred), a's and b's are stored, and a's is the last one produced.
struct Model {
  Tensor a, w, b;
  std::unique_ptr<optim::Optimizer> opt;
  // kind: sgd, adam, adamw, adamw-f16-state (FP16 moments), or adamw-<anything> (AdamW).
  Model(const std::string& kind, DType dtype) {
    a = random({2100}, 1, 0.01f, 1.0f).to(dtype);
    w = random({24, 2100}, 2).to(dtype);
    b = random({24}, 3).to(dtype);
    for (Tensor* t : {&a, &w, &b}) t->set_requires_grad(true);
    const optim::ParamList params{{"a", &a}, {"w", &w}, {"b", &b}};
    if (kind == "sgd") {
      optim::SgdOptions o;
      o.lr = 0.01, o.momentum = 0.9, o.weight_decay = 0.01;
      opt = std::make_unique<optim::Sgd>(params, o);
    } else {
      optim::AdamOptions o;
      o.weight_decay = 0.01;
      const bool half_state = kind == "adamw-f16-state";
      opt = std::make_unique<optim::Adam>(
          params, o, kind != "adam",
          half_state ? optim::StateTypes{DType::f16, DType::f16} : optim::StateTypes{});
    }
  }
  Model(const Model&) = delete;  // the optimizer holds the parameters' addresses
  Tensor loss(const Tensor& x) const {
    const Tensor y = ops::linear(ops::mul(x, a), w, b);
    return ops::sum(ops::mul(y, y));
  }
  std::vector<std::vector<float>> params() const { return values({&a, &w, &b}); }
};

// One step as the trainer takes it under loss scaling.
optim::StepReport scaled_step(Model& m, amp::LossScaler& scaler, const Tensor& x, bool defer,
                              bool* w_grad_kept) {
  amp::ScaledStep scaled(&scaler);
  const Tensor loss = m.loss(x);
  if (defer) {
    EXPECT_EQ(m.opt->defer_gradients(), 3u);
  }
  autograd::backward(scaled.scale_loss(loss));
  if (w_grad_kept) *w_grad_kept = m.w.grad().defined();
  if (defer) {
    EXPECT_EQ(m.opt->deferred_gradients(), 1u) << "w's gradient, from linear's parts";
  }
  const optim::StepReport r = scaled.step(*m.opt, {});
  EXPECT_EQ(m.opt->deferred_gradients(), 0u) << "the step takes the deferred gradients";
  m.opt->zero_grad();
  return r;
}

TEST(DeferredGradients, StepAsTheStoredGradientsBitForBit) {
  const Tensor x = random({8, 2100}, 4, 1.0);
  // "master": f16 parameters with FP32 masters (O2's layout); "sr": with stochastic rounding.
  for (const std::string kind :
       {"sgd", "adam", "adamw", "adamw-f16-state", "adamw-master", "adamw-f16-sr"}) {
    const DType dtype = kind == "sgd" || kind == "adam" ? DType::f32 : DType::f16;
    struct Run {
      std::vector<std::vector<float>> params, state;
      std::vector<bool> skipped;
      double scale = 0;
      bool w_grad_kept = false;
    };
    auto run = [&](bool defer) {
      Model m(kind, dtype);
      if (kind == "adamw-master") m.opt->enable_master_weights();
      if (kind == "adamw-f16-sr") m.opt->set_stochastic_rounding(7);
      // 2^14 overflows the FP16 gradients at first: the scale backs off over skipped steps,
      // then clean steps apply (and it grows again every second one).
      amp::LossScalerOptions so;
      so.init_scale = dtype == DType::f16 ? 16384.0 : 65536.0;
      so.growth_interval = 2;
      amp::LossScaler scaler(so);
      const Tensor xin = x.to(dtype);
      Run r;
      for (int step = 0; step < 12; ++step)
        r.skipped.push_back(scaled_step(m, scaler, xin, defer, &r.w_grad_kept).skipped);
      r.params = m.params();
      r.state = state_values(*m.opt);
      r.scale = scaler.scale();
      return r;
    };
    const Run stored = run(false), deferred = run(true);
    EXPECT_TRUE(stored.w_grad_kept) << kind;
    EXPECT_FALSE(deferred.w_grad_kept) << kind << ": a deferred gradient is not stored";
    EXPECT_EQ(deferred.skipped, stored.skipped) << kind;
    EXPECT_EQ(deferred.scale, stored.scale) << kind;
    EXPECT_EQ(deferred.params, stored.params) << kind;
    EXPECT_EQ(deferred.state, stored.state) << kind;
    int applied = 0;
    for (bool s : stored.skipped) applied += s ? 0 : 1;
    EXPECT_GE(applied, 3) << kind;
    if (dtype == DType::f16) {
      EXPECT_TRUE(stored.skipped[0]) << kind << ": the overflow is tested";
    }
  }
}

// The skip decides before anything changes: the last gradient the backward pass produces (a's,
// from the first op) overflows, after w's was deferred and b's stored, and every parameter and
// state buffer keeps its bits.
TEST(DeferredGradients, AnOverflowInTheLastGradientLeavesEverythingUnchanged) {
  for (const std::string kind : {"sgd", "adamw", "adamw-master"}) {
    Model m(kind, DType::f16);
    if (kind == "adamw-master") m.opt->enable_master_weights();
    amp::LossScalerOptions so;
    so.init_scale = 16;
    amp::LossScaler scaler(so);
    // A clean step first, so that the state exists.
    const Tensor small = random({4, 2100}, 5, 1.0).to(DType::f16);
    ASSERT_FALSE(scaled_step(m, scaler, small, true, nullptr).skipped) << kind;
    m.a.copy_from(Tensor::full({2100}, 1e-4, DType::f16));
    const auto params = m.params();
    const auto state = state_values(*m.opt);
    const int64_t steps = m.opt->steps();
    // Inputs of 20,000 with a = 1e-4: h = x a and w's gradient stay finite in FP16; a's
    // gradient, summed over x times the gradient of h, does not.
    const Tensor huge = Tensor::full({4, 2100}, 20000.0, DType::f16);
    {
      amp::ScaledStep scaled(&scaler);
      const Tensor loss = m.loss(huge);
      m.opt->defer_gradients();
      autograd::backward(scaled.scale_loss(loss));
      ASSERT_EQ(m.opt->deferred_gradients(), 1u) << kind;
      bool a_finite = true, b_finite = true;
      for (float v : m.a.grad().to_float_vector()) a_finite = a_finite && std::isfinite(v);
      for (float v : m.b.grad().to_float_vector()) b_finite = b_finite && std::isfinite(v);
      ASSERT_FALSE(a_finite) << kind << ": the last gradient overflows";
      ASSERT_TRUE(b_finite) << kind;
      const optim::StepReport r = scaled.step(*m.opt, {});
      EXPECT_TRUE(r.skipped) << kind;
      EXPECT_EQ(r.nonfinite, std::vector<std::string>{"a"}) << kind << ": w's gradient is finite";
      m.opt->zero_grad();
    }
    EXPECT_EQ(m.params(), params) << kind;
    EXPECT_EQ(state_values(*m.opt), state) << kind;
    EXPECT_EQ(m.opt->steps(), steps) << kind;
    EXPECT_EQ(scaler.scale(), 8) << kind;
  }
}

// A weight used twice gets two gradients: stored, not deferred (as for updates in the backward
// pass); and a deferral not taken by a step is dropped by zero_grad().
TEST(DeferredGradients, SharedWeightsAreStoredAndZeroGradDrops) {
  Model m("adamw", DType::f32);
  const Tensor x = random({4, 2100}, 6, 1.0);
  m.opt->defer_gradients();
  const Tensor h = ops::mul(x, m.a);
  autograd::backward(ops::sum(ops::add(ops::linear(h, m.w), ops::linear(h, m.w))));
  EXPECT_EQ(m.opt->deferred_gradients(), 0u);
  EXPECT_TRUE(m.w.grad().defined());
  m.opt->zero_grad();
  m.opt->defer_gradients();
  autograd::backward(m.loss(x));
  EXPECT_EQ(m.opt->deferred_gradients(), 1u);
  m.opt->zero_grad();
  EXPECT_EQ(m.opt->deferred_gradients(), 0u);
  EXPECT_FALSE(m.w.autograd_meta()->defer_grad_parts) << "the hooks go with them";
}

// The trainer defers under loss scaling: the same losses, skips and weights as the ordinary
// step (which keeps every gradient), with fewer gradient bytes at the peak.
TEST(DeferredGradients, TrainerTrainsAsTheOrdinaryStepWithLessMemory) {
  for (const std::string precision : {"16-true", "16-mixed", "O2"}) {
    train::TrainConfig c = testing::small_run("tutorial-cnn", 96);
    c.max_steps = 10;
    c.precision = precision;
    c.loss_scaling = "dynamic";
    // The first steps overflow and are skipped (16-mixed's weight gradients are FP32: only a
    // larger scale overflows its 16-bit activation gradients).
    c.loss_scale_init = precision == "16-mixed" ? 16777216.0 : 524288.0;
    c.update_in_backward = false;
    train::Trainer ordinary_run(c);
    const train::TrainResult ordinary = ordinary_run.run();
    c.update_in_backward = true;
    train::Trainer deferred_run(c);
    const train::TrainResult deferred = deferred_run.run();
    EXPECT_EQ(deferred.step_losses, ordinary.step_losses) << precision;
    EXPECT_EQ(deferred.skipped, ordinary.skipped) << precision;
    EXPECT_FALSE(ordinary.skipped.empty()) << precision << ": the skip is tested";
    EXPECT_LT(ordinary.skipped.size(), 8u) << precision << ": so are the updates";
    std::vector<float> a, b;
    for (auto& p : ordinary_run.model().named_parameters()) {
      const auto v = p.tensor->to_float_vector();
      a.insert(a.end(), v.begin(), v.end());
    }
    for (auto& p : deferred_run.model().named_parameters()) {
      const auto v = p.tensor->to_float_vector();
      b.insert(b.end(), v.begin(), v.end());
    }
    EXPECT_EQ(a, b) << precision;
    EXPECT_LT(deferred.memory.peak_of(MemoryCategory::gradients),
              ordinary.memory.peak_of(MemoryCategory::gradients))
        << precision;
  }
}

// mantissa memory's figures for the tutorial CNN at batch 12: 16-true with dynamic loss scaling
// holds at most 55% of 32-true's peak (it held 66% while every gradient was kept until the step).
TEST(DeferredGradients, SixteenTrueWithDynamicScalingPeakAtMost55Percent) {
  train::TrainConfig c = testing::small_run("tutorial-cnn", 64);
  c.image_size = 0;  // the model's own 128x128
  c.batch_size = 12;
  c.threads = 1;
  c.precision = "32-true";
  const train::StepMemory fp32 = train::profile_step(c);
  c.precision = "16-true";
  c.loss_scaling = "dynamic";
  const train::StepMemory scaled = train::profile_step(c);
  EXPECT_LE(static_cast<double>(scaled.peak_total), 0.55 * static_cast<double>(fp32.peak_total));
  c.update_in_backward = false;  // every gradient kept until the step
  const train::StepMemory kept = train::profile_step(c);
  EXPECT_GT(static_cast<double>(kept.peak_total), 0.6 * static_cast<double>(fp32.peak_total));
}

}  // namespace
}  // namespace mantissa
