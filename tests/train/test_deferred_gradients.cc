// Gradients kept as what computes them under loss scaling (optim::Optimizer::defer_gradients):
// the same step and the same skips as the stored gradients, bit for bit, for linear and
// convolution weights; an overflow in the last gradient the backward pass produces, or in a
// deferred one, changes nothing; and the trainer's 16-bit step with dynamic loss scaling holds no
// linear weight gradient whole (mantissa memory's peak), nor ResNet's largest convolution ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"
#include "support/tensors.h"
#include "support/train.h"

namespace mantissa {
namespace {

// Normal values of standard deviation `scale` around `mean`.
Tensor random(const Shape& shape, uint32_t seed, float scale = 0.1f, float mean = 0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, scale);
  return testing::tensor_of(shape, [&] { return dist(gen); });
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

// What a run of scaled steps leaves: the parameters, the optimizer state, which steps were
// skipped, the final scale, and whether a deferrable gradient was stored.
struct ScaledRun {
  std::vector<std::vector<float>> params, state;
  std::vector<bool> skipped;
  double scale = 0;
  bool kept = false;
};

// The deferred run against the stored one: the same skips, scale, parameters and state, bit for
// bit, with the deferrable gradients not stored; enough steps applied, and with FP16 gradients
// the first step's overflow (and skip) tested.
void expect_same_training(const ScaledRun& stored, const ScaledRun& deferred, DType dtype,
                          const std::string& at) {
  EXPECT_TRUE(stored.kept) << at;
  EXPECT_FALSE(deferred.kept) << at << ": a deferred gradient is not stored";
  EXPECT_EQ(deferred.skipped, stored.skipped) << at;
  EXPECT_EQ(deferred.scale, stored.scale) << at;
  EXPECT_EQ(deferred.params, stored.params) << at;
  EXPECT_EQ(deferred.state, stored.state) << at;
  int applied = 0;
  for (bool skipped : stored.skipped) applied += skipped ? 0 : 1;
  EXPECT_GE(applied, 3) << at;
  if (dtype == DType::f16) {
    EXPECT_TRUE(stored.skipped[0]) << at << ": the overflow is tested";
  }
}

// A trained model's parameters, flattened in registration order.
std::vector<float> flat_parameters(nn::Module& model) {
  std::vector<float> all;
  for (auto& p : model.named_parameters()) {
    const auto v = p.tensor->to_float_vector();
    all.insert(all.end(), v.begin(), v.end());
  }
  return all;
}

// One scaled step whose only overflow is in the gradient of `overflowing`, stored or deferred:
// `installed` deferrals installed and `deferred` gradients left deferred by the backward pass when
// deferring; the step is skipped naming that gradient, every parameter keeps its bits, and the
// scale halves to `halved`.
void expect_skipped_for(optim::Optimizer& opt, double init_scale,
                        const std::function<Tensor()>& loss_of,
                        const std::function<std::vector<std::vector<float>>()>& params, bool defer,
                        size_t installed, size_t deferred, const std::string& overflowing,
                        double halved) {
  amp::LossScalerOptions lo;
  lo.init_scale = init_scale;
  amp::LossScaler scaler(lo);
  const std::vector<std::vector<float>> before = params();
  amp::ScaledStep scaled(&scaler);
  const Tensor loss = loss_of();
  if (defer) {
    EXPECT_EQ(opt.defer_gradients(), installed);
  }
  autograd::backward(scaled.scale_loss(loss));
  EXPECT_EQ(opt.deferred_gradients(), defer ? deferred : 0u);
  const optim::StepReport r = scaled.step(opt, {});
  EXPECT_TRUE(r.skipped) << defer;
  EXPECT_EQ(r.nonfinite, std::vector<std::string>{overflowing}) << defer;
  EXPECT_EQ(params(), before) << defer;
  EXPECT_EQ(scaler.scale(), halved) << defer;
}

TEST(DeferredGradients, StepAsTheStoredGradientsBitForBit) {
  const Tensor x = random({8, 2100}, 4, 1.0);
  // "master": f16 parameters with FP32 masters (what --half-modules stores in O2); "sr": with
  // stochastic rounding.
  for (const std::string kind :
       {"sgd", "adam", "adamw", "adamw-f16-state", "adamw-master", "adamw-f16-sr"}) {
    const DType dtype = kind == "sgd" || kind == "adam" ? DType::f32 : DType::f16;
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
      ScaledRun r;
      for (int step = 0; step < 12; ++step)
        r.skipped.push_back(scaled_step(m, scaler, xin, defer, &r.kept).skipped);
      r.params = m.params();
      r.state = state_values(*m.opt);
      r.scale = scaler.scale();
      return r;
    };
    expect_same_training(run(false), run(true), dtype, kind);
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

// linear_weight_grad_bound bounds every value the parts give (and is not loose by more than the
// rows' sum allows), and is infinite when an operand is not finite or a value could overflow.
TEST(DeferredGradients, TheLinearWeightGradientBoundHoldsEveryPart) {
  for (const DType out : {DType::f32, DType::f16, DType::bf16}) {
    for (const float magnitude : {0.1f, 30.0f}) {
      const Tensor g = random({12, 30}, 11, magnitude), x = random({12, 3000}, 12, magnitude);
      const double bound = kernels::linear_weight_grad_bound(g, x.to(DType::f16), out);
      double largest = 0;
      bool finite = true;
      kernels::linear_weight_grad_parts(
          g, x.to(DType::f16), out, [&](int64_t, int64_t n, const void* v, DType dt) {
            std::vector<float> f(static_cast<size_t>(n));
            convert(v, dt, f.data(), DType::f32, static_cast<size_t>(n));
            for (float e : f) {
              finite = finite && std::isfinite(e);
              if (std::isfinite(e)) largest = std::max(largest, static_cast<double>(std::fabs(e)));
            }
          });
      if (out == DType::f16 && magnitude > 1) {
        // 12 rows' amaxes near 100 (3 sigma) by near 100: a bound past FP16's 65504.
        EXPECT_TRUE(std::isinf(bound)) << dtype_name(out) << " " << magnitude;
        continue;
      }
      ASSERT_TRUE(std::isfinite(bound)) << dtype_name(out) << " " << magnitude;
      EXPECT_TRUE(finite);
      EXPECT_GE(bound, largest) << dtype_name(out) << " " << magnitude;
      // Each row's amax product is at most (5 sigma)^2: the sum of 12 of them.
      EXPECT_LE(bound, 12 * 25.0 * magnitude * magnitude) << dtype_name(out);
    }
  }
  const Tensor g = random({4, 8}, 13), x = random({4, 2048}, 14);
  for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<float> xv = x.to_float_vector();
    xv[3 * 2048 + 100] = bad;
    EXPECT_TRUE(std::isinf(
        kernels::linear_weight_grad_bound(g, Tensor::from_floats(xv, {4, 2048}), DType::f32)));
    std::vector<float> gv = g.to_float_vector();
    gv[7] = bad;
    EXPECT_TRUE(std::isinf(
        kernels::linear_weight_grad_bound(Tensor::from_floats(gv, {4, 8}), x, DType::bf16)));
  }
}

// An overflow in the deferred gradient itself skips the step: loss = sum(linear(x * a, w, b))
// scaled by 4096 gives w the gradient 4096 * (the sum of 8 rows of x * a), past FP16's range,
// while a's (w is tiny) and b's (8 * 4096) stay finite.
TEST(DeferredGradients, AnOverflowInTheDeferredGradientSkipsTheStep) {
  for (const bool defer : {false, true}) {
    Tensor a = random({2100}, 21, 0.01f, 1.0f).to(DType::f16),
           w = random({24, 2100}, 22, 1e-4f).to(DType::f16), b = random({24}, 23).to(DType::f16);
    for (Tensor* t : {&a, &w, &b}) t->set_requires_grad(true);
    optim::Sgd opt({{"a", &a}, {"w", &w}, {"b", &b}}, optim::SgdOptions{});
    const Tensor x = random({8, 2100}, 24, 20.0f).to(DType::f16);
    expect_skipped_for(
        opt, 4096, [&] { return ops::sum(ops::linear(ops::mul(x, a), w, b)); },
        [&] {
          return values({&a, &w, &b});
        },
        defer, 3, 1, "w", 2048.0);
  }
}

// A deferred gradient whose bound proves it finite is computed once, for the update; without a
// bound, with clipping (which needs the norm) or where the unscaled values could overflow, twice.
// The parameter's update is the same bits every way.
TEST(DeferredGradients, AFiniteBoundSkipsTheCheckPass) {
  struct Case {
    double bound;
    float grad_scale;
    double max_grad_norm;
    DType dtype;
    int produced;  // calls of the producer
  };
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<Case> cases = {
      {2.0, 0.5f, 0, DType::f32, 1},         {inf, 0.5f, 0, DType::f32, 2},
      {2.0, 0.5f, 100, DType::f32, 2},       {2.0, 1e38f, 0, DType::f32, 2},
      {2.0, 0.5f, 0, DType::f16, 1},         {65000, 0.5f, 0, DType::f16, 2},
      {std::nan(""), 0.5f, 0, DType::f32, 2}};
  std::vector<float> first;
  for (const Case& c : cases) {
    Tensor w = Tensor::from_floats(std::vector<float>(64, 1.0f), {4, 16}).to(c.dtype);
    w.set_requires_grad(true);
    optim::SgdOptions o;
    o.lr = 0.125;
    optim::Sgd opt({{"w", &w}}, o);
    ASSERT_EQ(opt.defer_gradients(), 1u);
    int produced = 0;
    std::vector<float> values(64);
    for (size_t j = 0; j < values.size(); ++j) values[j] = static_cast<float>(j) / 64;
    w.autograd_meta()->defer_grad_parts(
        [&](const GradPartConsumer& consume) {
          ++produced;
          std::vector<char> part(values.size() * dtype_size(c.dtype));
          convert(values.data(), DType::f32, part.data(), c.dtype, values.size());
          consume(0, 64, part.data(), c.dtype);
        },
        c.bound);
    optim::StepOptions so;
    so.grad_scale = c.grad_scale;
    so.max_grad_norm = c.max_grad_norm;
    so.skip_nonfinite = true;
    const optim::StepReport r = opt.step(so);
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(produced, c.produced) << c.bound << " " << c.grad_scale << " " << c.max_grad_norm;
    EXPECT_EQ(r.grad_norm.has_value(), c.produced == 2);
    if (c.grad_scale == 0.5f && c.max_grad_norm == 0) {
      if (first.empty()) first = w.to_float_vector();
      EXPECT_EQ(w.to_float_vector(), first) << c.bound << " " << dtype_name(c.dtype);
    }
  }
}

// h = relu(conv(x * a, w1)), y = conv(h, w2, b2), loss = sum(y * y): w1's and w2's gradients are
// kept as their producers (dy and x hold at most half the gradients' bytes), a's and b2's are
// stored, and a's is the last one produced. w2's values have standard deviation w2_scale.
struct ConvModel {
  Tensor a, w1, w2, b2;
  std::unique_ptr<optim::Optimizer> opt;
  ConvModel(const std::string& kind, DType dtype, float w2_scale = 0.1f) {
    a = random({1, 16, 1, 1}, 31, 0.01f, 1.0f).to(dtype);
    w1 = random({32, 16, 3, 3}, 32).to(dtype);
    w2 = random({32, 32, 3, 3}, 33, w2_scale).to(dtype);
    b2 = random({32}, 34).to(dtype);
    for (Tensor* t : {&a, &w1, &w2, &b2}) t->set_requires_grad(true);
    const optim::ParamList params{{"a", &a}, {"w1", &w1}, {"w2", &w2}, {"b2", &b2}};
    if (kind == "sgd") {
      optim::SgdOptions o;
      o.lr = 1e-4, o.momentum = 0.9, o.weight_decay = 0.01;
      opt = std::make_unique<optim::Sgd>(params, o);
    } else {
      optim::AdamOptions o;
      o.lr = 1e-4, o.weight_decay = 0.01;
      opt = std::make_unique<optim::Adam>(params, o, true);
    }
  }
  ConvModel(const ConvModel&) = delete;
  Tensor output(const Tensor& x) const {
    kernels::Conv2dParams same;
    same.pad_h = same.pad_w = 1;
    const Tensor h = ops::relu(ops::conv2d(ops::mul(x, a), w1, Tensor(), same));
    return ops::conv2d(h, w2, b2, same);
  }
  Tensor loss(const Tensor& x) const {
    const Tensor y = output(x);
    return ops::sum(ops::mul(y, y));
  }
  std::vector<std::vector<float>> params() const { return values({&a, &w1, &w2, &b2}); }
};

TEST(DeferredGradients, ConvolutionWeightGradientsStepAsTheStoredOnesBitForBit) {
  const Tensor x = random({2, 16, 4, 4}, 35, 1.0);
  for (const std::string kind : {"sgd", "adamw"})
    for (const DType dtype : {DType::f32, DType::f16}) {
      auto run = [&](bool defer) {
        ConvModel m(kind, dtype);
        amp::LossScalerOptions so;
        so.init_scale = dtype == DType::f16 ? 256.0 : 1024.0;
        so.growth_interval = 2;
        amp::LossScaler scaler(so);
        const Tensor xin = x.to(dtype);
        ScaledRun r;
        for (int step = 0; step < 10; ++step) {
          amp::ScaledStep scaled(&scaler);
          const Tensor loss = m.loss(xin);
          if (defer) {
            EXPECT_EQ(m.opt->defer_gradients(), 4u);
          }
          autograd::backward(scaled.scale_loss(loss));
          r.kept = m.w1.grad().defined() || m.w2.grad().defined();
          EXPECT_EQ(m.opt->deferred_gradients(), defer ? 2u : 0u) << "w1's and w2's";
          r.skipped.push_back(scaled.step(*m.opt, {}).skipped);
          m.opt->zero_grad();
        }
        r.params = m.params();
        r.state = state_values(*m.opt);
        r.scale = scaler.scale();
        return r;
      };
      expect_same_training(run(false), run(true), dtype,
                           kind + " " + std::string(dtype_name(dtype)));
    }
}

// conv2d_weight_grad_bound bounds every value of the weight gradient (and not loosely), for an
// FP32 input read as f16 too; infinite when an operand is not finite, when the input read as f16
// overflows, or when a value could overflow the output's type.
TEST(DeferredGradients, TheConvolutionWeightGradientBoundHoldsEveryValue) {
  kernels::Conv2dParams p;
  p.pad_h = p.pad_w = 1;
  p.stride_h = 2;
  for (const DType out : {DType::f32, DType::f16, DType::bf16})
    for (const float magnitude : {0.1f, 30.0f}) {
      const Tensor x = random({3, 8, 9, 10}, 36, magnitude);
      const Tensor dy = random({3, 6, 5, 10}, 37, magnitude);
      for (const DType read_x : {DType::f32, DType::f16}) {
        const double bound = kernels::conv2d_weight_grad_bound(dy, x, out, read_x);
        const Tensor dw = kernels::conv2d_backward_weight(dy, x, {6, 8, 3, 3}, p, out,
                                                          kernels::Partials::kF32, read_x);
        double largest = 0;
        bool finite = true;
        for (const float v : dw.to_float_vector()) {
          finite = finite && std::isfinite(v);
          largest = std::max(largest, static_cast<double>(std::fabs(v)));
        }
        const std::string at = std::string(dtype_name(out)) + " " + std::to_string(magnitude);
        if (out == DType::f16 && magnitude > 1) {
          // 3 images of 50 positions by amaxes near 100 (3 sigma): a bound past FP16's 65504.
          EXPECT_TRUE(std::isinf(bound)) << at;
          continue;
        }
        ASSERT_TRUE(std::isfinite(bound)) << at;
        EXPECT_TRUE(finite) << at;
        EXPECT_GE(bound, largest) << at;
        // Each image's amax product is at most (5 sigma)^2 over 50 positions.
        EXPECT_LE(bound, 3 * 50 * 25.0 * magnitude * magnitude) << at;
      }
    }
  // A 3x3 stride-1 layer of 16 channels each way (Winograd's weight gradient), where the bound
  // is tight: x and dy one value everywhere (1 - 3 2^-24: each sum of its products rounds up), so
  // that the center tap's exact sum is the bound's product and only the widening covers the
  // roundings; and random values.
  kernels::Conv2dParams w3;
  w3.pad_h = w3.pad_w = 1;
  for (const float spread : {0.0f, 0.5f})
    for (const DType out : {DType::f32, DType::bf16}) {
      const Tensor x = random({5, 16, 12, 16}, 40, spread, 1.0f - 0x3p-24f);
      const Tensor dy = random({5, 16, 12, 16}, 41, spread, 1.0f - 0x3p-24f);
      const double bound = kernels::conv2d_weight_grad_bound(dy, x, out);
      const Tensor dw = kernels::conv2d_backward_weight(dy, x, {16, 16, 3, 3}, w3, out);
      double largest = 0;
      for (const float v : dw.to_float_vector())
        largest = std::max(largest, static_cast<double>(std::fabs(v)));
      EXPECT_GE(bound, largest) << "winograd, spread " << spread << ", " << dtype_name(out);
      EXPECT_LE(bound, 1.01 * 5 * 192 * (1 + 6 * spread) * (1 + 6 * spread));
    }
  const Tensor x = random({2, 4, 6, 6}, 38), dy = random({2, 5, 6, 6}, 39);
  for (const float bad : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<float> xv = x.to_float_vector(), gv = dy.to_float_vector();
    xv[100] = bad;
    gv[200] = bad;
    EXPECT_TRUE(std::isinf(
        kernels::conv2d_weight_grad_bound(dy, Tensor::from_floats(xv, x.shape()), DType::f32)));
    EXPECT_TRUE(std::isinf(
        kernels::conv2d_weight_grad_bound(Tensor::from_floats(gv, dy.shape()), x, DType::f32)));
  }
  std::vector<float> big = x.to_float_vector();
  big[7] = 70000.0f;  // finite in FP32, inf read as f16
  const Tensor xb = Tensor::from_floats(big, x.shape());
  EXPECT_TRUE(std::isfinite(kernels::conv2d_weight_grad_bound(dy, xb, DType::f32)));
  EXPECT_TRUE(std::isinf(kernels::conv2d_weight_grad_bound(dy, xb, DType::f32, DType::f16)));
}

// An overflow in a deferred convolution weight gradient alone skips the step: loss =
// sum(conv(h, w2, b2)) scaled by 1024 gives w2 the gradient 1024 * (the sum of h over 32
// positions), past FP16's range, while b2's (1024 * 32) and, w2 being tiny, w1's and a's stay
// finite. With the bound the check pass cannot be skipped (the bound is infinite).
TEST(DeferredGradients, AnOverflowInADeferredConvolutionGradientSkipsTheStep) {
  for (const bool defer : {false, true}) {
    ConvModel m("sgd", DType::f16, 1e-5f);
    const Tensor x = random({2, 16, 4, 4}, 40, 30.0f).to(DType::f16);
    expect_skipped_for(
        *m.opt, 1024, [&] { return ops::sum(m.output(x)); }, [&] { return m.params(); }, defer, 4,
        2, "w2", 512.0);
  }
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
    EXPECT_EQ(flat_parameters(deferred_run.model()), flat_parameters(ordinary_run.model()))
        << precision;
    EXPECT_LT(deferred.memory.peak_of(MemoryCategory::gradients),
              ordinary.memory.peak_of(MemoryCategory::gradients))
        << precision;
  }
}

// ResNet-18 in 16-mixed: its 512-channel convolutions' weight gradients are kept as their
// producers (batch 16, 2x2 planes: 192 KiB of dy and x against 9 MiB of FP32 gradient each): the
// same losses, skips and weights as the ordinary step, with fewer gradient bytes at the peak.
TEST(DeferredGradients, TrainerKeepsResNetConvolutionGradientsAsProducers) {
  train::TrainConfig c = testing::small_run("resnet18", 64);
  c.max_steps = 6;
  c.precision = "16-mixed";
  c.loss_scale_init = 4194304.0;  // 2^22: overflows the 16-bit activation gradients at first
  c.update_in_backward = false;
  train::Trainer ordinary_run(c);
  const train::TrainResult ordinary = ordinary_run.run();
  c.update_in_backward = true;
  train::Trainer deferred_run(c);
  const train::TrainResult deferred = deferred_run.run();
  EXPECT_EQ(deferred.step_losses, ordinary.step_losses);
  EXPECT_EQ(deferred.skipped, ordinary.skipped);
  EXPECT_FALSE(ordinary.skipped.empty()) << "the skip is tested";
  EXPECT_LT(ordinary.skipped.size(), 6u) << "so are the updates";
  EXPECT_EQ(flat_parameters(deferred_run.model()), flat_parameters(ordinary_run.model()));
  // Three 9 MiB gradients of layer4 not kept.
  EXPECT_LT(static_cast<double>(deferred.memory.peak_of(MemoryCategory::gradients)),
            static_cast<double>(ordinary.memory.peak_of(MemoryCategory::gradients)) - 20e6);
}

// mantissa memory's figures for the tutorial CNN at batch 12: 16-true with dynamic loss scaling
// holds at most 55% of 32-true's peak (it held 66% while every gradient was kept until the step).
TEST(DeferredGradients, SixteenTrueWithDynamicScalingPeakAtMost55Percent) {
  train::TrainConfig c = testing::tutorial_cnn_batch_12();
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
