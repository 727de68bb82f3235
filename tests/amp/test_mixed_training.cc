// Mixed and half precision end to end: the fused optimizer step (unscale, overflow check, clip,
// update, rounding), FP32 master weights, stochastic rounding, gradient underflow and loss
// scaling, and every precision mode through the trainer (learning, memory, resume).
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "mantissa/optim/optim_kernels.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;

// A leaf parameter with fixed values.
std::unique_ptr<Tensor> make_param(const std::vector<float>& v, const Shape& s, DType t) {
  auto p = std::make_unique<Tensor>(Tensor::from_floats(v, s, t));
  p->set_requires_grad(true);
  return p;
}

std::vector<float> ramp(size_t n, float a, float b) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = a + b * static_cast<float>((i * 37) % 101) / 101.0f;
  return v;
}

// ---- The fused step ----

TEST(FusedStep, UnscaleAndClipEqualPyTorchsSeparatePasses) {
  const std::vector<float> w0 = ramp(3000, -1, 2), g0 = ramp(3000, -0.5f, 1);
  const float S = 1024;
  for (const char* opt : {"sgd", "adamw"}) {
    // Reference: gradients unscaled in place, clipped in place, then a plain step.
    auto pa = make_param(w0, {3000}, DType::f32);
    Tensor ga = Tensor::from_floats(g0, {3000}, DType::f32);
    optim::ParamList la{{"w", pa.get()}};
    auto pb = make_param(w0, {3000}, DType::f32);
    optim::ParamList lb{{"w", pb.get()}};
    auto make = [&](const optim::ParamList& l) -> std::unique_ptr<optim::Optimizer> {
      if (std::string(opt) == "sgd") {
        optim::SgdOptions o;
        o.lr = 0.1;
        o.momentum = 0.9;
        return std::make_unique<optim::Sgd>(l, o);
      }
      return std::make_unique<optim::Adam>(l, optim::AdamOptions{}, true);
    };
    auto oa = make(la), ob = make(lb);
    for (int step = 0; step < 3; ++step) {
      // Scaled gradients, as backward of S * loss leaves them.
      const Tensor scaled = ops::mul_scalar(ga, S);
      std::vector<float> unscaled = scaled.to_float_vector();
      for (float& u : unscaled) u = u * (1.0f / S);
      pa->autograd_meta()->grad = std::make_unique<Tensor>(Tensor::from_floats(unscaled, {3000}));
      optim::clip_grad_norm(la, 1.0);
      oa->step();
      pb->autograd_meta()->grad = std::make_unique<Tensor>(scaled.clone());
      optim::StepOptions so;
      so.grad_scale = 1.0f / S;
      so.max_grad_norm = 1.0;
      so.skip_nonfinite = true;
      const optim::StepReport r = ob->step(so);
      EXPECT_FALSE(r.skipped);
      ASSERT_TRUE(r.grad_norm);
      EXPECT_NEAR(*r.grad_norm, optim::grad_norm(lb) / S, 1e-3 * *r.grad_norm);
      EXPECT_EQ(pa->to_float_vector(), pb->to_float_vector()) << opt << " step " << step;
    }
  }
}

TEST(FusedStep, AnInfOrNanGradientSkipsTheWholeStepAndNamesTheParameter) {
  auto a = make_param({1, 2, 3}, {3}, DType::f32);
  auto b = make_param({4, 5}, {2}, DType::f16);
  optim::ParamList l{{"a", a.get()}, {"b", b.get()}};
  optim::Adam adam(l, optim::AdamOptions{}, false);
  a->autograd_meta()->grad =
      std::make_unique<Tensor>(Tensor::from_floats({1, 1, 1}, {3}, DType::f32));
  b->autograd_meta()->grad =
      std::make_unique<Tensor>(Tensor::from_floats({1, INFINITY}, {2}, DType::f16));
  optim::StepOptions so;
  so.skip_nonfinite = true;
  const optim::StepReport r = adam.step(so);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.nonfinite, (std::vector<std::string>{"b"}));
  EXPECT_EQ(adam.steps(), 0);
  EXPECT_EQ(a->to_float_vector(), (std::vector<float>{1, 2, 3}));
  EXPECT_TRUE(adam.state_tensors().empty());  // no state created by a skipped step
  // A finite gradient whose square overflows FP32 is not an overflow.
  b->autograd_meta()->grad =
      std::make_unique<Tensor>(Tensor::from_floats({60000, 1}, {2}, DType::f16));
  so.grad_scale = 1e35f;
  EXPECT_TRUE(adam.step(so).skipped);  // 60000 * 1e35 overflows FP32: skipped
  so.grad_scale = 1;
  a->autograd_meta()->grad =
      std::make_unique<Tensor>(Tensor::from_floats({3e19f, 0, 0}, {3}, DType::f32));
  EXPECT_FALSE(adam.step(so).skipped);
}

TEST(FusedStep, MasterWeightsKeepUpdatesThatA16BitWeightWouldLose) {
  // Weight 1.0 in FP16 (spacing 2^-10 above 1): SGD steps of 1e-4 vanish in the 16-bit weight
  // but add up in the FP32 master.
  auto with = make_param(std::vector<float>(64, 1.0f), {64}, DType::f16);
  auto without = make_param(std::vector<float>(64, 1.0f), {64}, DType::f16);
  optim::SgdOptions o;
  o.lr = 1e-4;
  optim::Sgd a({{"w", with.get()}}, o), b({{"w", without.get()}}, o);
  a.enable_master_weights();
  EXPECT_EQ(default_memory_tracker().stats().current_of(MemoryCategory::master_weights) >= 256,
            true);
  for (int i = 0; i < 100; ++i) {
    for (Tensor* p : {with.get(), without.get()})
      p->autograd_meta()->grad = std::make_unique<Tensor>(Tensor::full({64}, -1.0, DType::f16));
    a.step();
    b.step();
  }
  EXPECT_EQ(without->to_float_vector()[0], 1.0f);
  // 1 + 100 * 1e-4 = 1.01, rounded to FP16 from the master.
  EXPECT_EQ(with->to_float_vector()[0], static_cast<float>(f16(1.01f)));
  bool has_master = false;
  for (auto& [name, t] : a.state_tensors()) has_master = has_master || name == "w.master";
  EXPECT_TRUE(has_master);
}

// Every storage combination the modes use (and all-FP32, the staged path's SIMD loop), with a
// length that leaves a SIMD tail.
struct AdamCase {
  DType p, g, m, v;
  bool master;
};
const AdamCase kAdamCases[] = {{DType::f16, DType::f16, DType::f16, DType::bf16, false},
                               {DType::bf16, DType::bf16, DType::bf16, DType::bf16, false},
                               {DType::f16, DType::f16, DType::f32, DType::f32, true},
                               {DType::f32, DType::f32, DType::f16, DType::bf16, false},
                               {DType::f32, DType::bf16, DType::f32, DType::f32, false},
                               {DType::f32, DType::f32, DType::f32, DType::f32, false}};

// Where rounding happens: the update computed in FP32 from the stored values by the engine's own
// element function (adam_element), each result rounded to nearest even when it is stored, and
// nowhere else. This checks the 16-bit kernels' loads, stores and rounding points bit for bit, not
// the formula (the element function is the engine's; the next test checks the formula).
TEST(FusedStep, SixteenBitAdamRoundsOnlyWhereItStoresBitForBit) {
  for (const AdamCase& k : kAdamCases) {
    const int64_t n = 1003;
    const std::vector<float> w0 = ramp(n, -1, 2);
    auto w = make_param(w0, {n}, k.p);
    optim::AdamOptions o;
    o.lr = 0.01;
    o.weight_decay = 0.1;
    optim::Adam adam({{"w", w.get()}}, o, true, {k.m, k.v});
    if (k.master) adam.enable_master_weights();
    auto round = [](float x, DType t) {
      return t == DType::f16    ? static_cast<float>(f16(x))
             : t == DType::bf16 ? static_cast<float>(bf16(x))
                                : x;
    };
    std::vector<float> p(w->to_float_vector()), master(w->to_float_vector()), m(n, 0), v(n, 0);
    for (int step = 1; step <= 3; ++step) {
      const std::vector<float> g0 = ramp(n, -0.3f * static_cast<float>(step), 0.5f);
      w->autograd_meta()->grad = std::make_unique<Tensor>(Tensor::from_floats(g0, {n}, k.g));
      optim::StepOptions so;
      so.grad_scale = 0.5f;
      adam.step(so);
      const double bc1 = 1 - std::pow(0.9, step), bc2 = 1 - std::pow(0.999, step);
      optim::detail::AdamScalars sc{};
      sc.b1 = 0.9f;
      sc.b2 = 0.999f;
      sc.one_minus_b1 = static_cast<float>(1 - 0.9);
      sc.one_minus_b2 = static_cast<float>(1 - 0.999);
      sc.step_size = static_cast<float>(0.01 / bc1);
      sc.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      sc.eps = 1e-8f;
      sc.wd = 0.1f;
      sc.decay = static_cast<float>(1 - 0.01 * 0.1);
      sc.decoupled = true;
      sc.unscale = 0.5f;
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        float pi = k.master ? master[i] : p[i];
        adam_element(pi, round(g0[i], k.g), m[i], v[i], sc);
        m[i] = round(m[i], k.m);
        v[i] = round(v[i], k.v);
        master[i] = pi;
        p[i] = round(pi, k.p);
      }
    }
    EXPECT_EQ(w->to_float_vector(), p) << dtype_name(k.p) << " " << dtype_name(k.m);
    size_t states = 0;
    for (auto& [name, t] : adam.state_tensors()) {
      const std::vector<float>& want = name == "w.exp_avg"      ? m
                                       : name == "w.exp_avg_sq" ? v
                                                                : master;
      EXPECT_EQ(t.to_float_vector(), want) << name << " " << dtype_name(k.p);
      ++states;
    }
    EXPECT_EQ(states, k.master ? 3u : 2u) << "exp_avg, exp_avg_sq and the master if any";
  }
}

// One unit in the last place of `t` at the magnitude of x (subnormal spacing below the normals).
double ulp_of(double x, DType t) {
  const int min_exp = t == DType::f16 ? -14 : -126;
  const int mantissa = t == DType::f16 ? 10 : t == DType::bf16 ? 7 : 23;
  if (x == 0) return std::ldexp(1.0, min_exp - mantissa);
  int e = 0;
  std::frexp(x, &e);  // |x| = f 2^e, f in [0.5, 1): the binade's exponent is e - 1
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mantissa);
}

// The formula: each step, from the values the optimizer has stored, PyTorch 1.13's AdamW written
// out here in FP64 (decoupled decay, the moments, both bias corrections, eps outside the square
// root). The optimizer computes in FP32 and rounds into the storage type: each result is within a
// few FP32 roundings of the terms it sums (8 x 2^-24 of their magnitudes: a difference of nearly
// equal terms keeps the terms' error) plus one unit in the last place of its storage type. An
// error in the formula (a missing bias correction, eps inside the root, decay applied twice) moves
// results by orders of magnitude more.
TEST(FusedStep, AdamFollowsPyTorchsFormulaInEveryStorageType) {
  const double lr = 0.01, wd = 0.1, b1 = 0.9, b2 = 0.999, eps = 1e-8, unscale = 0.5;
  for (const AdamCase& k : kAdamCases) {
    const int64_t n = 1003;
    auto w = make_param(ramp(n, -1, 2), {n}, k.p);
    optim::AdamOptions o;
    o.lr = lr;
    o.weight_decay = wd;
    optim::Adam adam({{"w", w.get()}}, o, true, {k.m, k.v});
    if (k.master) adam.enable_master_weights();
    auto state = [&](const std::string& name) {
      for (auto& [s, t] : adam.state_tensors())
        if (s == name) return t.to_float_vector();
      return std::vector<float>(static_cast<size_t>(n), 0.0f);  // before the first step: zeros
    };
    for (int step = 1; step <= 3; ++step) {
      const std::vector<float> p0 = k.master ? state("w.master") : w->to_float_vector();
      const std::vector<float> m0 = state("w.exp_avg"), v0 = state("w.exp_avg_sq");
      const std::vector<float> g0 = ramp(n, -0.3f * static_cast<float>(step), 0.5f);
      w->autograd_meta()->grad = std::make_unique<Tensor>(Tensor::from_floats(g0, {n}, k.g));
      const std::vector<float> g = w->grad().to_float_vector();  // as stored
      optim::StepOptions so;
      so.grad_scale = static_cast<float>(unscale);
      adam.step(so);
      const std::vector<float> p1 = k.master ? state("w.master") : w->to_float_vector();
      const std::vector<float> m1 = state("w.exp_avg"), v1 = state("w.exp_avg_sq");
      const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
      const DType pt = k.master ? DType::f32 : k.p;
      double worst = 0;  // |got - want| / allowed
      std::string where;
      auto compare = [&](const char* what, size_t i, float got, double want, double terms,
                         DType t) {
        const double allowed = ulp_of(want, t) + 8 * 0x1p-24 * terms;
        if (std::fabs(got - want) / allowed > worst) {
          worst = std::fabs(got - want) / allowed;
          where = std::string(what) + "[" + std::to_string(i) + "]: got " + std::to_string(got) +
                  ", PyTorch's formula " + std::to_string(want);
        }
      };
      for (size_t i = 0; i < static_cast<size_t>(n); ++i) {
        const double grad = g[i] * unscale;
        const double m = b1 * m0[i] + (1 - b1) * grad;
        const double v = b2 * v0[i] + (1 - b2) * grad * grad;
        const double decayed = p0[i] * (1 - lr * wd),
                     update = lr / bc1 * m / (std::sqrt(v / bc2) + eps);
        compare("exp_avg", i, m1[i], m, std::fabs(b1 * m0[i]) + std::fabs((1 - b1) * grad), k.m);
        compare("exp_avg_sq", i, v1[i], v, b2 * v0[i] + (1 - b2) * grad * grad, k.v);
        compare(k.master ? "master" : "w", i, p1[i], decayed - update,
                std::fabs(decayed) + std::fabs(update), pt);
      }
      EXPECT_LE(worst, 1.0) << dtype_name(k.p) << "/" << dtype_name(k.m) << "/" << dtype_name(k.v)
                            << " step " << step << ": " << where;
    }
  }
}

// ---- Stochastic rounding ----

// Fits w (16-bit, initial 1.0) to targets 0.5 * x with updates below half a unit in the last
// place of the weights; returns the losses.
std::vector<double> sub_ulp_training(std::optional<uint64_t> sr_seed, int threads,
                                     std::vector<float>* final_weights = nullptr) {
  set_num_threads(threads);
  const int64_t n = 4096;  // enough elements to use both threads
  auto w = make_param(std::vector<float>(static_cast<size_t>(n), 1.0f), {n}, DType::f16);
  optim::SgdOptions o;
  o.lr = 2e-4;  // |update| = lr * |grad| <= 2e-4 * 1 < 2^-11 = half an FP16 ulp above 1
  optim::Sgd sgd({{"w", w.get()}}, o);
  sgd.set_stochastic_rounding(sr_seed);
  const Tensor x = Tensor::full({n}, 1.0, DType::f16);
  std::vector<double> losses;
  for (int step = 0; step < 150; ++step) {
    // loss = mean((w * x - 0.5 x)^2) / 2: gradient w - 0.5 per element (times 1/n from mean,
    // undone by summing instead).
    const Tensor diff = ops::sub(ops::mul(*w, x), ops::mul_scalar(x, 0.5));
    const Tensor loss = ops::mul_scalar(ops::sum(ops::mul(diff, diff), {}, false, {DType::f32}),
                                        0.5 / static_cast<double>(n));
    losses.push_back(loss.item());
    autograd::backward(ops::mul_scalar(loss, static_cast<double>(n)));
    sgd.step();
    sgd.zero_grad();
  }
  if (final_weights) *final_weights = w->to_float_vector();
  set_num_threads(0);
  return losses;
}

TEST(StochasticRounding, KeepsLearningWhereRoundToNearestStalls) {
  const std::vector<double> rne = sub_ulp_training(std::nullopt, 2);
  const std::vector<double> sr = sub_ulp_training(42, 2);
  // Round to nearest: every update is lost, the loss never moves.
  EXPECT_EQ(rne.front(), rne.back());
  // Stochastic rounding: the expected weight follows the exact trajectory, w - 0.5 shrinking by
  // (1 - 2e-4) per step: after 150 steps the loss is (1 - 2e-4)^300 = 0.94 of the first.
  EXPECT_LT(sr.back(), sr.front() * 0.97);
  EXPECT_NEAR(sr.back() / sr.front(), std::pow(1 - 2e-4, 300), 0.01);
}

TEST(StochasticRounding, IsReproducibleAndIndependentOfThreads) {
  std::vector<float> a, b, c;
  sub_ulp_training(7, 1, &a);
  sub_ulp_training(7, 2, &b);
  sub_ulp_training(8, 2, &c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

// ---- Underflow and loss scaling ----

struct UnderflowRun {
  double zero_fraction_first_step = 0;  // of the weight's gradient, before unscaling
  bool weights_moved = false;
  double first_loss = 0, last_loss = 0;
  int64_t skipped = 0;
};

// A linear model in 16-mixed (FP32 weights, FP16 activations and activation gradients) whose loss
// is tiny: the FP16 gradient of the output flushes to zero unless the loss is scaled.
UnderflowRun underflow_run(std::optional<amp::LossScalerOptions> scaling) {
  const int64_t B = 64, I = 8, O = 4;
  auto w = make_param(ramp(static_cast<size_t>(O * I), -0.5f, 1), {O, I}, DType::f32);
  const std::vector<float> w0 = w->to_float_vector();
  const Tensor x = Tensor::from_floats(ramp(static_cast<size_t>(B * I), -1, 2), {B, I});
  const Tensor t = Tensor::from_floats(ramp(static_cast<size_t>(B * O), -1, 2), {B, O});
  optim::AdamOptions ao;
  ao.lr = 1e-2;
  ao.eps = 1e-30;  // gradients are ~1e-10: Adam is scale invariant once eps is out of the way
  optim::Adam adam({{"w", w.get()}}, ao, false);
  std::optional<amp::LossScaler> scaler;
  if (scaling) scaler.emplace(*scaling);
  ops::AutocastPolicy policy;
  UnderflowRun r;
  for (int step = 0; step < 60; ++step) {
    amp::ScaledStep scaled(scaler ? &*scaler : nullptr);
    Tensor loss;
    {
      ops::AutocastScope autocast(DType::f16, policy);
      const Tensor y = ops::linear(x, *w);  // f16
      const Tensor d = ops::sub(y, t);      // promoted to f32
      loss = ops::mul_scalar(ops::mean(ops::mul(d, d)), 1e-7);
    }
    if (step == 0) r.first_loss = loss.item() * 1e7;
    r.last_loss = loss.item() * 1e7;
    autograd::backward(scaled.scale_loss(loss));
    if (step == 0) {
      const std::vector<float> g = w->grad().to_float_vector();
      int64_t zeros = 0;
      for (float v : g) zeros += v == 0;
      r.zero_fraction_first_step = static_cast<double>(zeros) / static_cast<double>(g.size());
    }
    scaled.step(adam, {});
    adam.zero_grad();
  }
  r.weights_moved = w->to_float_vector() != w0;
  r.skipped = scaler ? scaler->skipped_steps() : 0;
  return r;
}

TEST(LossScaling, FP16GradientsFlushToZeroWithoutItAndTrainWithIt) {
  const UnderflowRun none = underflow_run(std::nullopt);
  EXPECT_EQ(none.zero_fraction_first_step, 1.0);
  EXPECT_FALSE(none.weights_moved);
  EXPECT_EQ(none.first_loss, none.last_loss);

  const UnderflowRun fixed = underflow_run(amp::parse_loss_scaling("1048576"));  // 2^20
  EXPECT_LT(fixed.zero_fraction_first_step, 0.05);
  EXPECT_TRUE(fixed.weights_moved);
  EXPECT_LT(fixed.last_loss, 0.5 * fixed.first_loss);
  EXPECT_EQ(fixed.skipped, 0);

  amp::LossScalerOptions dyn;  // GradScaler's defaults: 2^16 is enough here
  const UnderflowRun dynamic = underflow_run(dyn);
  EXPECT_LT(dynamic.zero_fraction_first_step, 0.05);
  EXPECT_TRUE(dynamic.weights_moved);
  EXPECT_LT(dynamic.last_loss, 0.5 * dynamic.first_loss);
}

TEST(LossScaling, DynamicBacksOffFromAnOverflowingScale) {
  amp::LossScalerOptions big;
  big.init_scale = std::ldexp(1.0, 50);  // FP16 activation gradients overflow at this scale
  const UnderflowRun r = underflow_run(big);
  EXPECT_GT(r.skipped, 0);
  EXPECT_LT(r.last_loss, 0.5 * r.first_loss);
}

// ---- Every mode through the trainer ----

train::TrainConfig small(const std::string& precision, const std::string& model = "tutorial-cnn") {
  train::TrainConfig c = testing::small_run(model, 192);
  c.precision = precision;
  return c;
}

TEST(PrecisionTraining, EveryModeLearns) {
  for (const std::string& p : amp::precision_names()) {
    train::TrainConfig c = small(p);
    c.epochs = 3;
    c.evaluate = true;
    c.test_limit = 48;
    train::Trainer t(c);
    const train::TrainResult r = t.run();
    ASSERT_EQ(r.step_losses.size(), 36u) << p;
    for (float l : r.step_losses) ASSERT_TRUE(std::isfinite(l)) << p;
    double first = 0, last = 0;
    for (int i = 0; i < 6; ++i) {
      first += r.step_losses[static_cast<size_t>(i)];
      last += r.step_losses[r.step_losses.size() - 1 - static_cast<size_t>(i)];
    }
    EXPECT_LT(last, 0.8 * first) << p;
    EXPECT_GT(*r.test_accuracy, 0.3) << p;
    const amp::PrecisionMode m = t.precision();
    EXPECT_EQ(t.model().named_parameters()[0].tensor->dtype(), m.param_dtype) << p;
    EXPECT_EQ(r.loss_scale.has_value(), m.loss_scaling.has_value()) << p;
  }
}

// O2's 16-bit model is its FP32 masters read as 16-bit: no 16-bit copy and no master copies are
// held, the gradients outside the normalization layers are 16-bit, the input arrives in 16 bits.
TEST(PrecisionTraining, O2HoldsItsFp32MastersAndNoSixteenBitCopy) {
  default_memory_tracker().reset_peaks();
  train::Trainer t(small("O2"));
  const Tensor& norm_w = *t.model().submodule("norm").named_parameters()[0].tensor;
  const Tensor& fc1_w = *t.model().submodule("fc1").named_parameters()[0].tensor;
  EXPECT_EQ(norm_w.dtype(), DType::f32);
  EXPECT_FALSE(norm_w.autograd_meta()->read_as.has_value());
  EXPECT_EQ(fc1_w.dtype(), DType::f32);
  EXPECT_EQ(fc1_w.autograd_meta()->read_as, DType::f16);
  const train::TrainResult r = t.run();
  ASSERT_FALSE(r.step_losses.empty());
  EXPECT_TRUE(std::isfinite(r.step_losses.back()));
  const MemoryStats m = default_memory_tracker().stats();
  EXPECT_EQ(m.peak_of(MemoryCategory::master_weights), 0u);
  // 4 bytes a parameter, once.
  size_t params = 0;
  for (auto& p : t.model().named_parameters()) params += static_cast<size_t>(p.tensor->numel()) * 4;
  EXPECT_EQ(m.peak_of(MemoryCategory::parameters), params);
}

TEST(PrecisionTraining, KeepFp32AndHalfModulesOverrideTheMode) {
  train::TrainConfig c = small("16-true");
  c.keep_fp32 = {"norm", "fc2"};
  train::Trainer t(c);
  EXPECT_EQ(t.model().submodule("norm").named_parameters()[0].tensor->dtype(), DType::f32);
  EXPECT_EQ(t.model().submodule("fc2").named_parameters()[0].tensor->dtype(), DType::f32);
  EXPECT_EQ(t.model().submodule("fc1").named_parameters()[0].tensor->dtype(), DType::f16);
  train::TrainConfig h = small("32-true");
  h.half_modules = {"conv1"};
  train::Trainer t2(h);
  EXPECT_EQ(t2.model().submodule("conv1").named_parameters()[0].tensor->dtype(), DType::f16);
  EXPECT_EQ(t2.model().submodule("conv2").named_parameters()[0].tensor->dtype(), DType::f32);
  t2.run();
  c.keep_fp32 = {"nrom"};
  EXPECT_NE(error_of([&] { train::Trainer bad(c); }).find("nrom"), std::string::npos);
  c.keep_fp32 = {"fc1"};
  c.half_modules = {"fc1"};
  EXPECT_NE(error_of([&] { train::validate(c); }).find("both"), std::string::npos);
}

TEST(PrecisionTraining, StateTypesAccumTypeAndPartialsApply) {
  train::TrainConfig c = small("16-mixed");
  c.first_moment_type = "fp16";
  c.second_moment_type = "bf16";
  c.accum_type = "bf16";
  c.max_steps = 2;
  const train::TrainResult fp32_partials = train::Trainer(c).run();
  c.partials = "fp16";
  train::Trainer t(c);
  const train::TrainResult r = t.run();
  size_t states = 0;
  for (auto& [name, s] : t.optimizer().state_tensors()) {
    EXPECT_EQ(s.dtype(), name.ends_with("exp_avg") ? DType::f16 : DType::bf16) << name;
    ++states;
  }
  EXPECT_EQ(states, 2 * t.model().named_parameters().size()) << "exp_avg and exp_avg_sq of each";
  EXPECT_EQ(t.model().named_parameters()[0].tensor->autograd_meta()->grad_dtype, DType::bf16);
  // FP16 partials reach the matrix ops of the forward pass: the first step's loss (before any
  // update) is computed from sums rounded to FP16 every 16 products, so it differs.
  EXPECT_EQ(t.settings().precision.partials, kernels::Partials::kF16);
  ASSERT_EQ(r.step_losses.size(), 2u);
  ASSERT_EQ(fp32_partials.step_losses.size(), 2u);
  EXPECT_NE(r.step_losses[0], fp32_partials.step_losses[0]);
  for (auto bad : {&train::TrainConfig::accum_type, &train::TrainConfig::first_moment_type,
                   &train::TrainConfig::partials}) {
    train::TrainConfig b = small("16-mixed");
    b.*bad = "fp8";
    EXPECT_NE(error_of([&] { train::validate(b); }).find("fp8"), std::string::npos);
  }
}

// Evaluation computes the training's forward pass under the run's settings, FP16 partials
// included, with op outputs rounded to nearest: the same figures each time, whatever the
// stochastic op outputs of training.
TEST(PrecisionTraining, EvaluationRunsTheTrainingForwardRoundedToNearest) {
  train::Trainer t(small("16-mixed"));
  data::LoaderConfig lc;
  lc.batch_size = 12;
  lc.shuffle = false;
  lc.drop_last = false;
  data::SyntheticConfig sc;
  sc.size = 36;
  sc.image_size = 24;
  data::Loader loader(data::synthetic(sc, false), lc);
  auto loss = [&](kernels::Partials partials, std::optional<uint64_t> stochastic_seed) {
    amp::PrecisionSettings s = t.settings().precision;
    s.partials = partials;
    s.stochastic_outputs_seed = stochastic_seed;
    const train::EvalResult r = train::evaluate_model(t.model(), loader, &s);
    EXPECT_EQ(r.examples, 36);
    return r.loss;
  };
  const double f32_partials = loss(kernels::Partials::kF32, std::nullopt);
  const double f16_partials = loss(kernels::Partials::kF16, std::nullopt);
  EXPECT_NE(f16_partials, f32_partials) << "the FP16 partials reach evaluation's matrix ops";
  EXPECT_EQ(loss(kernels::Partials::kF16, 7), f16_partials) << "outputs rounded to nearest";
  EXPECT_EQ(loss(kernels::Partials::kF16, 8), f16_partials);
}

TEST(PrecisionTraining, AutocastListsAndLogFromTheTrainer) {
  testing::TempDir dir;
  const std::string lower = dir.file("lower.txt");
  std::ofstream(lower) << "linear\n";
  train::TrainConfig c = small("bf16-mixed");
  c.autocast_lower_list = lower;
  c.max_steps = 1;
  train::Trainer t(c);
  EXPECT_EQ(t.autocast_policy().category(ops::OpId::conv2d), ops::AutocastCategory::kFollowInput);
  t.run();
  // The lowered list holds linear alone: both linear layers are cast to bf16, no convolution is.
  std::set<std::string> lowered;
  for (auto& d : t.autocast_log().decisions()) {
    EXPECT_NE(d.op, "conv2d") << ops::to_string(d);
    if (d.category == ops::AutocastCategory::kLowerPrecision) {
      EXPECT_EQ(d.op, "linear") << ops::to_string(d);
      EXPECT_EQ(d.to, DType::bf16) << ops::to_string(d);
      lowered.insert(d.module);
    }
  }
  EXPECT_EQ(lowered, (std::set<std::string>{"fc1", "fc2"}));
  std::ofstream(lower) << "conv9d\n";
  EXPECT_NE(error_of([&] { train::validate(c); }).find("conv9d"), std::string::npos);
}

TEST(PrecisionTraining, HalfTrueHalvesPeakMemory) {
  // 16-true's peak at most 55% of 32-true's (about half: docs/mixed_precision.md), at a test's
  // size.
  for (const std::string model : {"tutorial-cnn", "resnet18"}) {
    size_t peak[2];
    int i = 0;
    for (const char* p : {"32-true", "16-true"}) {
      train::TrainConfig c = small(p, model);
      c.max_steps = 2;
      c.image_size = model == "tutorial-cnn" ? 128 : 32;
      c.batch_size = model == "tutorial-cnn" ? 12 : 8;
      c.synthetic_size = 32;
      train::Trainer t(c);
      peak[i++] = t.run().memory.peak_total;
    }
    EXPECT_LE(static_cast<double>(peak[1]), 0.55 * static_cast<double>(peak[0]))
        << model << ": " << peak[1] << " against " << peak[0];
  }
}

TEST(PrecisionTraining, ResumeIsBitExactWithScalerAndStochasticRounding) {
  testing::TempDir dir;
  for (const char* p : {"16-mixed", "16-true", "O2"}) {
    train::TrainConfig c = small(p);
    c.stochastic_rounding = std::string(p) == "16-true";
    if (std::string(p) != "16-true")
      c.loss_scale_growth_interval = 3;  // the scale changes within the run
    c.epochs = 2;
    c.save = dir.file("full.safetensors");
    train::Trainer full(c);
    const train::TrainResult rf = full.run();

    train::TrainConfig a = c;
    a.max_steps = 7;
    a.save = dir.file("part.safetensors");
    train::Trainer(a).run();
    train::TrainConfig b = c;
    b.resume = dir.file("part.safetensors");
    b.save = dir.file("resumed.safetensors");
    const train::TrainResult rr = train::Trainer(b).run();
    EXPECT_EQ(rr.step_losses, rf.step_losses) << p;
    EXPECT_EQ(rr.loss_scale, rf.loss_scale) << p;
    const auto fa = io::load_safetensors(dir.file("full.safetensors"));
    const auto fb = io::load_safetensors(dir.file("resumed.safetensors"));
    ASSERT_EQ(fa.tensors.size(), fb.tensors.size()) << p;
    ASSERT_GT(fa.tensors.size(), full.model().named_parameters().size()) << "weights and state";
    for (auto& [name, t] : fa.tensors)
      EXPECT_EQ(t.to_float_vector(), fb.tensors.at(name).to_float_vector()) << p << " " << name;
    // Another precision cannot resume it.
    train::TrainConfig other = small("32-true");
    other.resume = dir.file("part.safetensors");
    EXPECT_NE(error_of([&] { train::Trainer x(other); }).find("--precision"), std::string::npos);
  }
}

// A checkpoint of O2 as earlier builds stored it (the model in 16 bits, FP32 masters in the
// optimizer, its own settings line) resumes into this build's O2 (the FP32 parameters are the
// masters) and continues as this build's own checkpoint does, bit for bit. The earlier layout is
// made here from this build's checkpoint: each parameter outside the group norm rounded into the
// model's tensor, its FP32 value moved to "optimizer.<name>.master".
TEST(PrecisionTraining, AnO2CheckpointOfTheSixteenBitLayoutResumes) {
  testing::TempDir dir;
  train::TrainConfig c = small("O2");
  c.max_steps = 4;
  c.save = dir.file("part.safetensors");
  train::Trainer(c).run();
  io::SafetensorsFile f = io::load_safetensors(dir.file("part.safetensors"));
  std::vector<std::pair<std::string, Tensor>> old;
  size_t masters = 0;
  for (auto& [name, t] : f.tensors) {
    const bool weight = name.rfind("optimizer.", 0) != 0 && name.rfind("norm.", 0) != 0;
    old.emplace_back(name, weight ? t.to(DType::f16) : t);
    if (!weight) continue;
    old.emplace_back("optimizer." + name + ".master", t);
    ++masters;
  }
  ASSERT_GT(masters, 3u);
  std::string& line = f.metadata.at("precision_settings");
  const std::string now =
      "parameters f32, read as f16 (normalization layers f32), input f16, "
      "autocast off, master weights f32 (the parameters)";
  ASSERT_EQ(line.find(now), 14u) << line;  // after "precision O2: "
  line.replace(14, now.size(),
               "parameters f16 (normalization layers f32), input f32, autocast off, master "
               "weights f32");
  std::string& count = f.metadata.at("optimizer_state_tensors");
  count = std::to_string(std::stoll(count) + static_cast<long long>(masters));
  io::save_safetensors(dir.file("old.safetensors"), old, f.metadata);

  train::TrainConfig a = small("O2");
  a.max_steps = 8;
  a.resume = dir.file("part.safetensors");
  a.save = dir.file("a.safetensors");
  const train::TrainResult ra = train::Trainer(a).run();
  train::TrainConfig b = a;
  b.resume = dir.file("old.safetensors");
  b.save = dir.file("b.safetensors");
  const train::TrainResult rb = train::Trainer(b).run();
  EXPECT_EQ(rb.step_losses, ra.step_losses);
  const auto fa = io::load_safetensors(dir.file("a.safetensors"));
  const auto fb = io::load_safetensors(dir.file("b.safetensors"));
  ASSERT_EQ(fa.tensors.size(), fb.tensors.size());
  for (auto& [name, t] : fa.tensors)
    EXPECT_EQ(t.to_float_vector(), fb.tensors.at(name).to_float_vector()) << name;
}

TEST(MemoryBudget, PastTheBudgetTrainingStopsWithTheReportAndTheBudgetIsRestored) {
  ASSERT_FALSE(default_memory_tracker().budget());
  // 32-true needs about 59 MiB at its peak, 16-true about 30: a 48 MiB device fits one only.
  train::TrainConfig c = small("32-true");
  c.image_size = 128;
  c.batch_size = 12;
  c.max_steps = 2;
  c.memory_budget = "48MiB";
  std::string report;
  try {
    train::Trainer t(c);
    t.run();
  } catch (const OutOfMemoryError& e) {
    report = e.what();
  }
  EXPECT_NE(report.find("out of memory"), std::string::npos) << report;
  EXPECT_NE(report.find("48.00 MiB budget"), std::string::npos) << report;
  EXPECT_NE(report.find("optimizer_state"), std::string::npos) << report;
  EXPECT_NE(report.find("fc1.weight"), std::string::npos) << report;
  EXPECT_FALSE(default_memory_tracker().budget());  // restored
  c.precision = "16-true";
  train::Trainer t(c);
  EXPECT_EQ(default_memory_tracker().budget(), size_t{48} << 20);
  EXPECT_LE(t.run().memory.peak_total, size_t{48} << 20);
  c.memory_budget = "lots";
  EXPECT_NE(error_of([&] { train::validate(c); }).find("--memory-budget 'lots'"),
            std::string::npos);
}

TEST(PrecisionTraining, MetricsReportTheLossScale) {
  testing::TempDir dir;
  train::TrainConfig c = small("16-mixed");
  c.max_steps = 4;
  c.metrics_json = dir.file("m.json");
  train::Trainer(c).run();
  std::ifstream f(c.metrics_json);
  const nlohmann::json j = nlohmann::json::parse(f);
  ASSERT_TRUE(j.contains("loss_scale"));
  EXPECT_TRUE(j["loss_scale"].contains("final"));
  EXPECT_TRUE(j["loss_scale"].contains("skipped_steps"));
  EXPECT_TRUE(j["loss_scale"]["history"].is_array());
  EXPECT_EQ(j["config"]["precision"], "16-mixed");
  EXPECT_TRUE(j["peak_memory_bytes"].contains("master_weights"));
}

}  // namespace
}  // namespace mantissa
