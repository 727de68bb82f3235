// Kahan-compensated 16-bit parameters (Optimizer::enable_kahan, --kahan): updates far below half
// an ulp move the weights as FP32 weights move, every optimizer's compensated update against a
// scalar reference bit for bit (the AVX2 Adam loop included; MANTISSA_SIMD=scalar runs these
// tests again on the portable loops), ZeRO shards, the state in checkpoints and resumes, memory,
// and the combinations that are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "mantissa/io/safetensors.h"
#include "mantissa/mantissa.h"
#include "mantissa/optim/optim_kernels.h"
#include "mantissa/train/memory_report.h"
#include "support/errors.h"
#include "support/files.h"
#include "support/train.h"

namespace mantissa {
namespace {

using testing::error_of;

float round_to(float x, DType t) {
  return t == DType::f16    ? static_cast<float>(f16(x))
         : t == DType::bf16 ? static_cast<float>(bf16(x))
                            : x;
}

// The optimizers and settings under test, each with its per-element FP32 update as the
// optimizer defines it (PyTorch's formulas), for the scalar reference.
struct OptCase {
  std::string name;
  std::function<std::unique_ptr<optim::Optimizer>(optim::ParamList)> make;
  // p, g (as stored), state m, v; step t from 1: updates p, m, v in FP32.
  std::function<void(float& p, float g, float& m, float& v, int t)> element;
};

// Learning rates times lr_scale.
std::vector<OptCase> cases(double lr_scale = 1) {
  std::vector<OptCase> out;
  auto sgd = [lr_scale](const std::string& name, double lr, double momentum, double wd,
                        bool nesterov) {
    optim::SgdOptions o;
    o.lr = lr * lr_scale;
    o.momentum = momentum;
    o.weight_decay = wd;
    o.nesterov = nesterov;
    OptCase c;
    c.name = name;
    c.make = [o](optim::ParamList p) { return std::make_unique<optim::Sgd>(std::move(p), o); };
    c.element = [o](float& p, float g, float& m, float&, int t) {
      const float lr = static_cast<float>(o.lr), mom = static_cast<float>(o.momentum);
      float d = g;
      if (o.weight_decay != 0) d = d + static_cast<float>(o.weight_decay) * p;
      if (o.momentum != 0) {
        m = t == 1 ? d : m * mom + 1.0f * d;
        d = o.nesterov ? d + mom * m : m;
      }
      p = p + (-lr) * d;
    };
    return c;
  };
  // Steps of 1e-4 to 3e-4 (gradients 0.1 to 0.3; momentum 0.9 multiplies them by 10).
  out.push_back(sgd("sgd", 1e-3, 0, 0, false));
  out.push_back(sgd("sgd-momentum", 1e-4, 0.9, 0, false));
  out.push_back(sgd("sgd-nesterov-wd", 1e-4, 0.9, 0.01, true));
  auto adam = [lr_scale](const std::string& name, double lr, double wd, bool decoupled) {
    optim::AdamOptions o;
    o.lr = lr * lr_scale;
    o.weight_decay = wd;
    OptCase c;
    c.name = name;
    c.make = [o, decoupled](optim::ParamList p) {
      return std::make_unique<optim::Adam>(std::move(p), o, decoupled);
    };
    c.element = [o, decoupled](float& p, float g, float& m, float& v, int t) {
      const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
      optim::detail::AdamScalars s{};
      s.b1 = static_cast<float>(o.beta1);
      s.b2 = static_cast<float>(o.beta2);
      s.one_minus_b1 = static_cast<float>(1 - o.beta1);
      s.one_minus_b2 = static_cast<float>(1 - o.beta2);
      s.step_size = static_cast<float>(o.lr / bc1);
      s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
      s.eps = static_cast<float>(o.eps);
      s.wd = static_cast<float>(o.weight_decay);
      s.decay = static_cast<float>(1 - o.lr * o.weight_decay);
      s.decoupled = decoupled;
      optim::detail::adam_element(p, g, m, v, s);
    };
    return c;
  };
  // Steps of about lr (the gradients barely change).
  out.push_back(adam("adam", 2e-4, 0, false));
  out.push_back(adam("adam-l2", 2e-4, 0.01, false));
  out.push_back(adam("adamw", 2e-4, 0.1, true));
  return out;
}

// Weights of magnitude 1 to 1.9, both signs; n leaves a SIMD tail.
std::vector<float> start_weights(size_t n) {
  std::vector<float> w(n);
  for (size_t i = 0; i < n; ++i)
    w[i] = (i % 2 ? -1.0f : 1.0f) * (1.0f + 0.9f * static_cast<float>((i * 37) % 101) / 101.0f);
  return w;
}

// The gradient of element i at step t: magnitudes 0.1 to 0.3 (a drift the weights follow).
float grad_at(size_t i, int t) {
  return 0.2f + 0.1f * static_cast<float>(std::sin(0.7 * static_cast<double>(i) + 0.01 * t));
}

struct Trained {
  std::vector<float> w;            // the parameter after the steps
  std::vector<std::vector<float>>  // and after each step
      trace;
};

// `steps` steps of the case on a parameter of dtype t (Kahan when asked), gradients given in t;
// the start weights rounded to `start` (t when unset: an FP32 run then starts where a 16-bit
// one does).
Trained run_case(const OptCase& k, DType t, bool kahan, int steps, size_t n = 1003,
                 std::optional<DType> start = std::nullopt) {
  Tensor w =
      Tensor::from_floats(start_weights(n), {static_cast<int64_t>(n)}, start.value_or(t)).to(t);
  w.set_requires_grad(true);
  auto opt = k.make({{"w", &w}});
  if (kahan) opt->enable_kahan();
  Trained r;
  for (int s = 1; s <= steps; ++s) {
    std::vector<float> g(n);
    for (size_t i = 0; i < n; ++i) g[i] = grad_at(i, s);
    w.set_grad(Tensor::from_floats(g, {static_cast<int64_t>(n)}, t));
    opt->step();
    r.trace.push_back(w.to_float_vector());
  }
  r.w = w.to_float_vector();
  return r;
}

TEST(Kahan, UpdatesFarBelowHalfAnUlpMoveTheWeightsAsFp32Does) {
  // Weights of magnitude 1 to 1.9 have an ulp of 2^-7 in BF16, 2^-10 in FP16 (half that just
  // below 1). Every step changes them by 1e-4 to 3e-4 in BF16 (learning rates / 8 in FP16: 1.25e-5
  // to 3.75e-5), at most a twelfth of half an ulp, for 300 steps. Round to nearest never moves
  // them. With Kahan compensation every weight stays within 0.75 ulp of the FP32 run's (from the
  // same start) after every step, while those move by at least 4 ulps. Half an ulp is the 16-bit
  // weight's own rounding; the rest is the compensation's rounding, which accumulates (seen: at
  // most 0.60 ulp in BF16, 0.51 in FP16).
  const int steps = 300;
  for (DType t : {DType::bf16, DType::f16}) {
    const double unit = t == DType::bf16 ? 0x1p-7 : 0x1p-10;  // the ulp in [1, 2)
    for (const OptCase& k : cases(t == DType::bf16 ? 1 : 0.125)) {
      const Trained rne = run_case(k, t, false, steps), kahan = run_case(k, t, true, steps),
                    fp32 = run_case(k, DType::f32, false, steps, 1003, t);
      const std::vector<float> w0 =
          Tensor::from_floats(start_weights(1003), {1003}, t).to_float_vector();
      EXPECT_EQ(rne.w, w0) << k.name << " " << dtype_name(t);
      double moved = 1e9, worst = 0;
      for (int s = 0; s < steps; ++s)
        for (size_t i = 0; i < w0.size(); ++i) {
          // The ulp of the larger of the two: where they straddle a power of 2 the 16-bit weight
          // lies on the coarser grid.
          const double w32 = fp32.trace[s][i], wk = kahan.trace[s][i];
          const double ulp = std::ldexp(unit, std::ilogb(std::max(std::fabs(w32), std::fabs(wk))));
          worst = std::max(worst, std::fabs(wk - w32) / ulp);
          if (s == steps - 1) moved = std::min(moved, std::fabs(w32 - w0[i]) / ulp);
        }
      EXPECT_LE(worst, 0.75) << k.name << " " << dtype_name(t);
      EXPECT_GE(moved, 4.0) << k.name << " " << dtype_name(t);
    }
  }
}

TEST(Kahan, EveryOptimizerEqualsAScalarReferenceBitForBit) {
  // The compensated update as documented: d = w1 - w (w1 the FP32 update of w), u = c + d,
  // w' = round(w + u), c' = round(u - (w' - w)), round to nearest even into the parameter's type.
  // n spans several threads' ranges and a SIMD tail; 40,000 elements, 2 threads.
  set_num_threads(2);
  const size_t n = 40003;
  const int steps = 4;
  for (const OptCase& k : cases()) {
    for (DType t : {DType::bf16, DType::f16}) {
      const Trained got = run_case(k, t, true, steps, n);
      std::vector<float> w =
          Tensor::from_floats(start_weights(n), {static_cast<int64_t>(n)}, t).to_float_vector();
      std::vector<float> c(n, 0), m(n, 0), v(n, 0);
      for (int s = 1; s <= steps; ++s)
        for (size_t i = 0; i < n; ++i) {
          float w1 = w[i];
          k.element(w1, round_to(grad_at(i, s), t), m[i], v[i], s);
          const float u = c[i] + (w1 - w[i]);
          const float wn = round_to(w[i] + u, t);
          c[i] = round_to(u - (wn - w[i]), t);
          w[i] = wn;
        }
      EXPECT_EQ(got.w, w) << k.name << " " << dtype_name(t);
    }
  }
  set_num_threads(0);
}

TEST(Kahan, ShardsTogetherEqualOneOptimizerAndCheckpointTheirParts) {
  for (const OptCase& k : cases()) {
    const int64_t n = 1003;
    Tensor whole = Tensor::from_floats(start_weights(n), {n}, DType::bf16),
           parts = Tensor::from_floats(start_weights(n), {n}, DType::bf16);
    whole.set_requires_grad(true);
    parts.set_requires_grad(true);
    auto one = k.make({{"w", &whole}});
    auto s0 = k.make({{"w", &parts}}), s1 = k.make({{"w", &parts}});
    for (auto* o : {one.get(), s0.get(), s1.get()}) o->enable_kahan();
    s0->set_shards({{0, 400}});
    s1->set_shards({{400, n}});
    for (int s = 1; s <= 20; ++s) {
      std::vector<float> g(n);
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_at(i, s);
      whole.set_grad(Tensor::from_floats(g, {n}, DType::bf16));
      parts.set_grad(Tensor::from_floats(g, {n}, DType::bf16));
      one->step();
      s0->step();
      s1->step();
    }
    ASSERT_EQ(parts.to_float_vector(), whole.to_float_vector()) << k.name;
    EXPECT_EQ(s0->state_bytes() + s1->state_bytes(), one->state_bytes()) << k.name;
    std::map<std::string, Tensor> saved;
    for (const auto& [name, t] : one->state_tensors()) saved[name] = t;
    ASSERT_TRUE(saved.count("w.kahan")) << k.name;
    EXPECT_EQ(saved.at("w.kahan").dtype(), DType::bf16);
    // The shards' compensation is the whole's, part by part (nonzero: it holds what rounding left).
    const std::vector<float> c = saved.at("w.kahan").to_float_vector();
    size_t nonzero = 0;
    for (float x : c) nonzero += x != 0;
    EXPECT_GT(nonzero, c.size() / 2) << k.name;
    for (const auto& [shard, r] : {std::pair{s0.get(), optim::ElementRange{0, 400}},
                                   std::pair{s1.get(), optim::ElementRange{400, n}}}) {
      for (const auto& [name, t] : shard->state_tensors()) {
        if (name == "w.kahan") {
          EXPECT_EQ(t.shape(), (Shape{r.size()}));
          EXPECT_EQ(t.to_float_vector(),
                    std::vector<float>(c.begin() + r.begin, c.begin() + r.end));
        }
      }
      // Whole tensors load into a shard as its part.
      Tensor q = Tensor::from_floats(start_weights(n), {n}, DType::bf16);
      auto loaded = k.make({{"w", &q}});
      loaded->enable_kahan();
      loaded->set_shards({r});
      loaded->load_state(saved, one->steps(), "test");
      for (const auto& [name, t] : loaded->state_tensors()) {
        if (name == "w.kahan") {
          EXPECT_EQ(t.to_float_vector(),
                    std::vector<float>(c.begin() + r.begin, c.begin() + r.end));
        }
      }
    }
  }
}

TEST(Kahan, OptimizerStateResumesBitForBitAndMismatchesAreRefused) {
  for (const OptCase& k : cases()) {
    const int64_t n = 1003;
    Tensor a = Tensor::from_floats(start_weights(n), {n}, DType::bf16);
    a.set_requires_grad(true);
    auto full = k.make({{"w", &a}});
    full->enable_kahan();
    std::map<std::string, Tensor> at5;
    Tensor w5;
    for (int s = 1; s <= 10; ++s) {
      std::vector<float> g(n);
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_at(i, s);
      a.set_grad(Tensor::from_floats(g, {n}, DType::bf16));
      full->step();
      if (s == 5) {
        for (const auto& [name, t] : full->state_tensors()) at5[name] = t.clone();
        w5 = a.clone();
      }
    }
    Tensor b = w5.clone();
    b.set_requires_grad(true);
    auto resumed = k.make({{"w", &b}});
    resumed->enable_kahan();
    resumed->load_state(at5, 5, "test");
    for (int s = 6; s <= 10; ++s) {
      std::vector<float> g(n);
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad_at(i, s);
      b.set_grad(Tensor::from_floats(g, {n}, DType::bf16));
      resumed->step();
    }
    EXPECT_EQ(b.to_float_vector(), a.to_float_vector()) << k.name;
    // Without --kahan the compensation has nowhere to go; with it, a state without one is refused.
    Tensor d = w5.clone();
    auto plain = k.make({{"w", &d}});
    EXPECT_NE(error_of([&] { plain->load_state(at5, 5, "ck"); }).find("resume with --kahan"),
              std::string::npos);
    std::map<std::string, Tensor> without = at5;
    without.erase("w.kahan");
    auto comp = k.make({{"w", &d}});
    comp->enable_kahan();
    EXPECT_NE(error_of([&] { comp->load_state(without, 5, "ck"); }).find("no Kahan compensation"),
              std::string::npos);
  }
}

TEST(Kahan, MasterWeightsAndStochasticRoundingAreRefused) {
  Tensor w = Tensor::from_floats(start_weights(8), {8}, DType::bf16);
  w.set_requires_grad(true);
  optim::Sgd a({{"w", &w}}, {});
  a.enable_kahan();
  EXPECT_NE(error_of([&] { a.enable_master_weights(); }).find("master weights"), std::string::npos);
  EXPECT_NE(error_of([&] { a.set_stochastic_rounding(1); }).find("stochastic rounding"),
            std::string::npos);
  optim::Sgd b({{"w", &w}}, {});
  b.enable_master_weights();
  EXPECT_NE(error_of([&] { b.enable_kahan(); }).find("master weights"), std::string::npos);
  optim::Sgd c({{"w", &w}}, {});
  c.set_stochastic_rounding(1);
  EXPECT_NE(error_of([&] { c.enable_kahan(); }).find("stochastic rounding"), std::string::npos);

  // The flag: modes with FP32 parameters or master weights, and with --stochastic-rounding.
  for (const char* p : {"32-true", "16-mixed", "bf16-mixed", "16.32"}) {
    amp::PrecisionChoices ch;
    ch.precision = p;
    ch.kahan = true;
    EXPECT_NE(error_of([&] { amp::resolve_precision(ch, 0); }).find("whose parameters are FP32"),
              std::string::npos)
        << p;
  }
  amp::PrecisionChoices o2;
  o2.precision = "O2";
  o2.kahan = true;
  EXPECT_NE(error_of([&] { amp::resolve_precision(o2, 0); }).find("whose parameters are FP32"),
            std::string::npos);
  amp::PrecisionChoices sr;
  sr.precision = "bf16-true";
  sr.kahan = true;
  sr.stochastic_rounding = true;
  EXPECT_NE(error_of([&] { amp::resolve_precision(sr, 0); }).find("--stochastic-rounding"),
            std::string::npos);
  for (const char* p : {"bf16-true", "16-true", "16.16", "O3"}) {
    amp::PrecisionChoices ok;
    ok.precision = p;
    ok.kahan = true;
    EXPECT_TRUE(amp::resolve_precision(ok, 0).kahan) << p;
  }
}

train::TrainConfig kahan_run() {
  train::TrainConfig c = testing::small_run("tutorial-cnn", 192);
  c.precision = "bf16-true";
  c.kahan = true;
  return c;
}

TEST(Kahan, TrainerResumesBitForBitAndChecksTheFlag) {
  testing::TempDir dir;
  train::TrainConfig c = kahan_run();
  c.epochs = 2;
  c.save = dir.file("full.safetensors");
  const train::TrainResult rf = train::Trainer(c).run();

  train::TrainConfig a = c;
  a.max_steps = 7;
  a.save = dir.file("part.safetensors");
  train::Trainer(a).run();
  // The compensation is in the checkpoint, in the parameters' type, and not all zero.
  const auto part = io::load_safetensors(dir.file("part.safetensors"));
  size_t comps = 0, nonzero = 0;
  for (const auto& [name, t] : part.tensors)
    if (name.size() > 6 && name.substr(name.size() - 6) == ".kahan") {
      ++comps;
      EXPECT_EQ(t.dtype(), DType::bf16) << name;
      for (float x : t.to_float_vector()) nonzero += x != 0;
    }
  EXPECT_GT(comps, 0u);
  EXPECT_GT(nonzero, 0u);

  train::TrainConfig b = c;
  b.resume = dir.file("part.safetensors");
  b.save = dir.file("resumed.safetensors");
  const train::TrainResult rr = train::Trainer(b).run();
  EXPECT_EQ(rr.step_losses, rf.step_losses);
  const auto fa = io::load_safetensors(dir.file("full.safetensors"));
  const auto fb = io::load_safetensors(dir.file("resumed.safetensors"));
  for (auto& [name, t] : fa.tensors)
    EXPECT_EQ(t.to_float_vector(), fb.tensors.at(name).to_float_vector()) << name;

  // The same run without --kahan differs (the compensation changes the weights), and cannot
  // resume the checkpoint; nor can --kahan resume one made without it.
  train::TrainConfig plain = c;
  plain.kahan = false;
  plain.save = dir.file("plain.safetensors");
  EXPECT_NE(train::Trainer(plain).run().step_losses, rf.step_losses);
  plain.resume = dir.file("part.safetensors");
  plain.save.clear();
  EXPECT_NE(error_of([&] { train::Trainer x(plain); }).find("--kahan"), std::string::npos);
  train::TrainConfig plain_part = c;
  plain_part.kahan = false;
  plain_part.max_steps = 7;
  plain_part.save = dir.file("plain_part.safetensors");
  train::Trainer(plain_part).run();
  train::TrainConfig k = c;
  k.resume = dir.file("plain_part.safetensors");
  k.save.clear();
  EXPECT_NE(error_of([&] { train::Trainer x(k); }).find("no Kahan compensation"),
            std::string::npos);
}

TEST(Kahan, MemoryCountsTheCompensationAsOptimizerState) {
  // 2 bytes a BF16 parameter: the state of SGD without momentum is the compensation alone.
  train::TrainConfig c = kahan_run();
  c.optimizer = "sgd";
  c.max_steps = 1;
  train::Trainer t(c);
  t.run();
  int64_t numel = 0;
  for (const auto& p : t.optimizer().params()) numel += p.tensor->numel();
  EXPECT_EQ(t.optimizer().state_bytes(), static_cast<size_t>(numel) * 2);
  c.kahan = false;
  train::Trainer u(c);
  u.run();
  EXPECT_EQ(u.optimizer().state_bytes(), 0u);
  // mantissa memory's per-parameter figures include it.
  c.kahan = true;
  const train::StepMemory m = train::profile_step(c);
  for (const train::ParamMemory& p : m.params) EXPECT_EQ(p.state_bytes_per_element, 2u);
}

}  // namespace
}  // namespace mantissa
