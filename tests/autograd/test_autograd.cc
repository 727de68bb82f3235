// The autograd engine: accumulation, graph shapes, no-grad scope, saved tensors, errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <tuple>

#include "mantissa/autograd/autograd.h"
#include "mantissa/mantissa.h"
#include "mantissa/ops/ops.h"
#include "support/errors.h"

namespace mantissa {
namespace {

Tensor leaf(std::vector<float> v, Shape s, DType t = DType::f32) {
  Tensor x = Tensor::from_floats(v, s, t);
  x.set_requires_grad(true);
  return x;
}

using testing::error_of;

TEST(Autograd, SharedSubexpressionsSumTheirGradients) {
  // y = sum(x * x + 3x): dy/dx = 2x + 3
  Tensor x = leaf({1, -2, 0.5}, {3});
  Tensor y = ops::sum(ops::add(ops::mul(x, x), ops::mul_scalar(x, 3.0)));
  EXPECT_FLOAT_EQ(static_cast<float>(y.item()), 1 + 4 + 0.25f + 3 * (1 - 2 + 0.5f));
  autograd::backward(y);
  EXPECT_EQ(x.grad().to_float_vector(), (std::vector<float>{5, -1, 4}));
}

TEST(Autograd, GradientsAccumulateAcrossBackwardPasses) {
  Tensor x = leaf({2, 3}, {2});
  autograd::backward(ops::sum(ops::mul_scalar(x, 2.0)));
  autograd::backward(ops::sum(ops::mul_scalar(x, 5.0)));
  EXPECT_EQ(x.grad().to_float_vector(), (std::vector<float>{7, 7}));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
}

TEST(Autograd, GradientsAreStoredInTheTensorsDtype) {
  Tensor w = leaf({0.1f, 0.2f, 0.3f, 0.4f}, {2, 2}, DType::f16);
  Tensor x = Tensor::from_floats({1, 2}, {1, 2}, DType::bf16);
  Tensor y = ops::sum(ops::linear(x, w, Tensor(), {DType::f32}));
  autograd::backward(y);
  ASSERT_EQ(w.grad().dtype(), DType::f16);
  EXPECT_EQ(w.grad().to_float_vector(), (std::vector<float>{1, 2, 1, 2}));
  EXPECT_EQ(w.grad().storage()->category(), MemoryCategory::gradients);
  EXPECT_FALSE(x.grad().defined());  // x did not require grad
}

TEST(Autograd, NoGradScopeRecordsNothing) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y;
  {
    autograd::NoGradScope guard;
    EXPECT_FALSE(autograd::grad_enabled());
    y = ops::mul_scalar(x, 2.0);
  }
  EXPECT_TRUE(autograd::grad_enabled());
  EXPECT_FALSE(y.requires_grad());
  EXPECT_FALSE(y.grad_fn());
  EXPECT_NE(error_of([&] { autograd::backward(ops::sum(y)); }).find("does not require grad"),
            std::string::npos);
}

TEST(Autograd, DeepChainsDoNotOverflowTheStack) {
  Tensor x = leaf({1.0f}, {1});
  Tensor y = x;
  for (int i = 0; i < 5000; ++i) y = ops::add_scalar(y, 0.001);
  autograd::backward(ops::sum(y));
  EXPECT_EQ(x.grad().item(), 1.0);
}

TEST(Autograd, NodesKeepOnlyWhatBackwardNeeds) {
  Tensor a = leaf({1, 2, 3}, {3}), b = leaf({4, 5, 6}, {3});
  const long before = a.storage().use_count();
  Tensor s = ops::add(a, b);  // d(a+b) needs neither operand
  EXPECT_EQ(a.storage().use_count(), before);
  Tensor r = ops::relu(a);  // relu keeps its output, not its input
  EXPECT_EQ(a.storage().use_count(), before);
  Tensor m = ops::mul(a, b);  // mul needs both
  EXPECT_EQ(a.storage().use_count(), before + 1);
  Tensor d = ops::dropout(a, 0.5, true, 1, 1);  // dropout recomputes its mask: nothing saved
  EXPECT_EQ(a.storage().use_count(), before + 1);
  (void)s, (void)r, (void)m, (void)d;
}

// A node drops what it saved once its gradients have gone out: a pass frees the activations as
// it walks back, not when the graph dies, and a second pass through the graph is an error that
// says so, unless the first kept the graph (retain_graph).
TEST(Autograd, ABackwardPassFreesWhatEachNodeSavedAsItGoes) {
  Tensor x = leaf({1, -2, 3}, {3});
  Tensor y = ops::relu(x);  // relu keeps its output
  const std::weak_ptr<Storage> saved = y.storage();
  Tensor loss = ops::sum(ops::mul_scalar(y, 2.0));
  y = Tensor();
  ASSERT_FALSE(saved.expired()) << "the relu node holds its output until the pass";
  autograd::backward(loss);
  EXPECT_TRUE(saved.expired()) << "freed by the pass while the graph (loss) is still alive";
  EXPECT_EQ(x.grad().to_float_vector(), (std::vector<float>{2, 0, 2}));
  const std::string e = error_of([&] { autograd::backward(loss); });
  EXPECT_NE(e.find("a second time"), std::string::npos) << e;
  EXPECT_NE(e.find("run the forward again"), std::string::npos) << e;
  // retain_graph: the saved output lives on, and a second pass adds its gradient again.
  Tensor x2 = leaf({1, -2, 3}, {3});
  Tensor y2 = ops::relu(x2);
  const std::weak_ptr<Storage> kept = y2.storage();
  Tensor loss2 = ops::sum(ops::mul_scalar(y2, 2.0));
  y2 = Tensor();
  autograd::backward(loss2, Tensor(), /*retain_graph=*/true);
  EXPECT_FALSE(kept.expired());
  autograd::backward(loss2);
  EXPECT_TRUE(kept.expired());
  EXPECT_EQ(x2.grad().to_float_vector(), (std::vector<float>{4, 0, 4}));
}

// An elementwise backward writes its input's gradient over the gradient it was given when
// nothing else holds that one: a chain of ReLUs holds one gradient of the chain's size at a time,
// not two (with anomaly detection on, which reads the given gradient afterwards, each step gets
// its own buffer), with the same values. A gradient two nodes receive (add gives both operands
// its own) is not overwritten by the first of them.
TEST(Autograd, ElementwiseBackwardWritesOverAGradientNothingElseHolds) {
  const int64_t n = 1 << 16;
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i % 7) - 3.0f;
  const Tensor seed = Tensor::full({n}, 0.5f, DType::f32);
  auto chain = [&](bool anomaly) {
    Tensor x = leaf(v, {n});
    Tensor h = ops::relu(ops::relu(ops::relu(x)));
    MemoryTracker& tr = default_memory_tracker();
    const size_t before = tr.stats().current_of(MemoryCategory::gradients);
    tr.reset_peaks();
    {
      std::optional<autograd::DetectAnomalyScope> scope;
      if (anomaly) scope.emplace();
      autograd::backward(h, seed);
    }
    const size_t grown = tr.stats().peak_of(MemoryCategory::gradients) - before;
    return std::make_pair(grown / (n * sizeof(float)), x.grad().to_float_vector());
  };
  const auto [buffers, values] = chain(false);
  EXPECT_EQ(buffers, 1u) << "the first ReLU's gradient, written over by the next two";
  const auto [anomaly_buffers, anomaly_values] = chain(true);
  EXPECT_EQ(anomaly_buffers, 2u);
  EXPECT_EQ(anomaly_values, values);
  for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(values[i], v[i] > 0 ? 0.5f : 0.0f) << i;

  Tensor x = leaf(v, {n});
  autograd::backward(ops::add(ops::relu(x), ops::relu(ops::mul_scalar(x, -1.0))), seed);
  const std::vector<float> got = x.grad().to_float_vector();
  for (size_t i = 0; i < v.size(); ++i)
    ASSERT_EQ(got[i], v[i] > 0 ? 0.5f : v[i] < 0 ? -0.5f : 0.0f) << "at " << i << ": " << v[i];
}

TEST(Autograd, RootsMustBeScalarsOrGetAGradient) {
  Tensor x = leaf({1, 2}, {2});
  Tensor y = ops::mul_scalar(x, 2.0);
  EXPECT_NE(error_of([&] { autograd::backward(y); }).find("must be a scalar"), std::string::npos);
  EXPECT_NE(error_of([&] {
              autograd::backward(y, Tensor::zeros({3}, DType::f32));
            }).find("gradient of shape (3,)"),
            std::string::npos);
  autograd::backward(y, Tensor::from_floats({1, 10}, {2}));
  EXPECT_EQ(x.grad().to_float_vector(), (std::vector<float>{2, 20}));
  EXPECT_NE(
      error_of([] { Tensor::zeros({2}, DType::i64).set_requires_grad(); }).find("floating-point"),
      std::string::npos);
}

TEST(Autograd, BatchNormUpdatesRunningStatisticsLikePyTorch) {
  Tensor x =
      Tensor::from_floats({1, 2, 3, 4, 10, 20, 30, 40}, {4, 2, 1, 1});  // channel 0: 1,3,10,30
  Tensor rm = Tensor::zeros({2}, DType::f32), rv = Tensor::full({2}, 1.0, DType::f32);
  ops::batch_norm(x, Tensor(), Tensor(), rm, rv, true, 0.1, 1e-5);
  const double mean0 = (1 + 3 + 10 + 30) / 4.0;
  const double var0 = ((1 - mean0) * (1 - mean0) + (3 - mean0) * (3 - mean0) +
                       (10 - mean0) * (10 - mean0) + (30 - mean0) * (30 - mean0)) /
                      3.0;  // unbiased
  EXPECT_NEAR(rm.at({0}), 0.1 * mean0, 1e-5);
  EXPECT_NEAR(rv.at({0}), 0.9 + 0.1 * var0, 1e-4);
  // Evaluation mode uses them and leaves them alone.
  Tensor y = ops::batch_norm(x, Tensor(), Tensor(), rm, rv, false);
  EXPECT_NEAR(y.at({0, 0, 0, 0}), (1 - 0.1 * mean0) / std::sqrt(0.9 + 0.1 * var0 + 1e-5), 1e-5);
  EXPECT_NEAR(rm.at({0}), 0.1 * mean0, 1e-5);
}

TEST(Autograd, DropoutIsReproducibleAndDropsTheRightFraction) {
  Tensor x = Tensor::full({100000}, 1.0, DType::f32);
  const Tensor a = ops::dropout(x, 0.25, true, 5, 0), b = ops::dropout(x, 0.25, true, 5, 0);
  const Tensor c = ops::dropout(x, 0.25, true, 5, 1);
  EXPECT_EQ(a.to_float_vector(), b.to_float_vector());
  EXPECT_NE(a.to_float_vector(), c.to_float_vector());
  double kept = 0, total = 0;
  for (float v : a.to_float_vector()) kept += v != 0.0f, total += v;
  EXPECT_NEAR(kept / 100000, 0.75, 0.01);
  EXPECT_NEAR(total / 100000, 1.0, 0.02);  // scaled by 1 / (1 - p): unbiased
  EXPECT_EQ(ops::dropout(x, 0.25, false, 5, 0).storage(), x.storage());  // evaluation: identity
}

TEST(Ops, BadShapesGetClearErrors) {
  const Tensor x = Tensor::zeros({2, 3, 8, 8}, DType::f32);
  EXPECT_NE(error_of([&] {
              ops::conv2d(x, Tensor::zeros({4, 2, 3, 3}, DType::f32));
            }).find("expects 2 input channels"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::linear(Tensor::zeros({2, 5}, DType::f32), Tensor::zeros({3, 4}, DType::f32));
            }).find("last dimension 5 vs 4"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::add(Tensor::zeros({2, 3}, DType::f32), Tensor::zeros({4}, DType::f32));
            }).find("do not broadcast"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::group_norm(x, 2); }).find("do not divide into 2 groups"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::cross_entropy(Tensor::zeros({2, 3}, DType::f32),
                                 Tensor::from_floats({0, 3}, {2}).to(DType::i64));
            }).find("target 3 at row 1 is outside [0, 3)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ops::relu(Tensor::zeros({2}, DType::i32)); }).find("must be f32"),
            std::string::npos);
  kernels::Pool2dParams p;
  p.kernel_h = p.kernel_w = 9;
  EXPECT_NE(error_of([&] { ops::max_pool2d(x, p); }).find("does not fit"), std::string::npos);
  EXPECT_NE(error_of([&] {
              ops::conv2d(x, Tensor::zeros({4, 3, 10, 3}, DType::f32));
            }).find("does not fit"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa

namespace mantissa {
namespace {

// The partials type reaches the GEMM through linear and conv2d.
TEST(Ops, PartialsTypeReachesMatrixOps) {
  const int64_t K = 4096;
  const Tensor x = Tensor::full({1, K}, 1.0, DType::f32), w = Tensor::full({1, K}, 0.1, DType::f32);
  const Tensor b = Tensor::full({1}, 4096.0, DType::f32);
  ops::OpOptions f16p;
  f16p.partials = kernels::Partials::kF16;
  // The bias starts the sum at 4096 (FP16 ulp 4): every 16-product chunk (1.6) is lost in FP16.
  EXPECT_NEAR(ops::linear(x, w, b).item(), 4505.6, 1.0);
  EXPECT_EQ(ops::linear(x, w, b, f16p).item(), 4096.0);
  // A 1x1 convolution over 4096 channels sums 409.6 in FP32; FP16 partials drift from it.
  const Tensor xc = Tensor::full({1, K, 1, 1}, 1.0, DType::f32),
               wc = Tensor::full({1, K, 1, 1}, 0.1, DType::f32);
  const double exact = ops::conv2d(xc, wc).item(),
               fp16 = ops::conv2d(xc, wc, Tensor(), {}, f16p).item();
  EXPECT_NEAR(exact, 409.6, 0.05);          // sequential FP32: 4096 roundings
  EXPECT_GT(std::fabs(fp16 - exact), 1.0);  // measured: 402.5 (ulps of 0.25 and 0.5 past 256)
  EXPECT_LT(std::fabs(fp16 - exact), 20.0);
}

}  // namespace
}  // namespace mantissa

namespace mantissa {
namespace {

// ReLU's gradient is a selection, as PyTorch's threshold_backward: where the output is 0 the input
// gradient is 0 even when the incoming gradient is inf or nan.
TEST(Autograd, ReluGradientSelectsInsteadOfMultiplying) {
  Tensor x = Tensor::from_floats({-1.0f, 0.0f, 2.0f}, {3});
  x.set_requires_grad(true);
  Tensor y = ops::relu(x);
  autograd::backward(y, Tensor::from_floats({INFINITY, NAN, 3.0f}, {3}));
  const std::vector<float> g = x.grad().to_float_vector();
  EXPECT_EQ(g[0], 0.0f);
  EXPECT_EQ(g[1], 0.0f);
  EXPECT_EQ(g[2], 3.0f);
}

// The same selection over a row long enough for the vectorized loop (and its scalar tail): where
// the output is NaN the gradient passes (as in PyTorch), where it is <= 0 it is +0.
TEST(Autograd, ReluGradientSelectionVectorized) {
  constexpr int n = 45;
  std::vector<float> xv(n), gv(n);
  for (int i = 0; i < n; ++i) {
    xv[i] = i % 5 == 0 ? NAN : (i % 3 == 0 ? -0.5f * static_cast<float>(i) : 0.25f * i);
    gv[i] = i % 7 == 0 ? INFINITY : (i % 11 == 0 ? NAN : static_cast<float>(i) - 20.0f);
  }
  xv[1] = -0.0f;
  Tensor x = Tensor::from_floats(xv, {n});
  x.set_requires_grad(true);
  autograd::backward(ops::relu(x), Tensor::from_floats(gv, {n}));
  const std::vector<float> g = x.grad().to_float_vector();
  for (int i = 0; i < n; ++i) {
    const bool passes = std::isnan(xv[i]) || xv[i] > 0.0f;
    if (!passes) {
      EXPECT_EQ(std::bit_cast<uint32_t>(g[i]), 0u) << i;  // +0
    } else if (std::isnan(gv[i])) {
      EXPECT_TRUE(std::isnan(g[i])) << i;
    } else {
      EXPECT_EQ(g[i], gv[i]) << i;
    }
  }
}

// A linear layer's weight gradient handed over in parts (AutogradMeta::consume_grad_parts, as an
// update in the backward pass takes it): every element exactly once, each equal to the whole
// gradient bit for bit, FP32 and FP16 (rounded once, as the matmul rounds); the input's gradient
// computed from the weights before any part is consumed (the consumer overwrites them); nothing
// stored. Outputs 13 (groups of 6, 6 and 1) by inputs 4500 (parts of 2048, 2048 and 404), 7
// rows. A batch above the part kernel's limit, or a second use of the weight, gets the whole
// gradient instead.
TEST(Autograd, LinearWeightGradientInPartsEqualsTheWholeOne) {
  std::mt19937 gen(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  auto values = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (float& e : v) e = dist(gen);
    return v;
  };
  const int64_t out = 13, in = 4500;
  const std::vector<float> w0 = values(out * in), b0 = values(out);
  struct Run {
    std::vector<float> dw, dx;
    std::vector<int> seen;
    bool stored = false;
    int wholes = 0;
  };
  auto run = [&](const std::vector<float>& xv, DType dt, bool parts, bool twice) {
    const int64_t rows = static_cast<int64_t>(xv.size()) / in;
    const Tensor x = leaf(xv, {rows, in}, dt);
    Tensor w = leaf(w0, {out, in}, dt), b = leaf(b0, {out}, dt);
    Run r;
    r.dw.assign(static_cast<size_t>(out * in), 0.0f);
    r.seen.assign(static_cast<size_t>(out * in), 0);
    AutogradMeta& meta = *w.autograd_meta();
    auto record = [&r, dt](int64_t begin, int64_t n, const void* g, DType t) {
      EXPECT_EQ(t, dt);
      std::vector<float> f(static_cast<size_t>(n));
      convert(g, t, f.data(), DType::f32, static_cast<size_t>(n));
      std::copy(f.begin(), f.end(), r.dw.begin() + begin);
      for (int64_t i = begin; i < begin + n; ++i) ++r.seen[static_cast<size_t>(i)];
    };
    meta.consume_grad = [&](int64_t begin, int64_t n, const void* g, DType t) {
      ++r.wholes;
      record(begin, n, g, t);
    };
    if (parts) {
      const Tensor nan = Tensor::full({1}, NAN, dt);
      const size_t es = dtype_size(dt);
      char* wd = static_cast<char*>(w.data_ptr());
      meta.consume_grad_parts = [&, nan, es, wd]() -> GradPartConsumer {
        return [&, nan, es, wd](int64_t begin, int64_t n, const void* g, DType t) {
          record(begin, n, g, t);  // parts are disjoint: no two threads share an element
          for (int64_t i = begin; i < begin + n; ++i)  // as an update would change them
            std::memcpy(wd + i * static_cast<int64_t>(es), nan.data_ptr(), es);
        };
      };
    }
    Tensor y = ops::linear(x, w, b);
    if (twice) y = ops::add(y, ops::linear(x, w, b));
    autograd::backward(ops::sum(ops::mul(y, y)));
    r.dx = x.grad().to_float_vector();
    r.stored = w.grad().defined();
    return r;
  };
  for (const DType dt : {DType::f32, DType::f16})
    for (const int64_t rows : {int64_t{7}, int64_t{17}}) {
      const std::vector<float> xv = values(rows * in);
      const Run p = run(xv, dt, true, false), whole = run(xv, dt, false, false);
      const std::string at = std::string(dtype_name(dt)) + ", " + std::to_string(rows) + " rows";
      EXPECT_FALSE(p.stored || whole.stored) << at;
      EXPECT_EQ(whole.wholes, 1) << at;
      EXPECT_EQ(p.wholes, rows <= 16 ? 0 : 1) << at << ": in parts only for small batches";
      EXPECT_TRUE(std::all_of(p.seen.begin(), p.seen.end(), [](int c) { return c == 1; })) << at;
      EXPECT_EQ(0, std::memcmp(p.dw.data(), whole.dw.data(), whole.dw.size() * sizeof(float)))
          << at;
      for (float v : p.dx) ASSERT_TRUE(std::isfinite(v)) << at;
      EXPECT_EQ(p.dx, whole.dx) << at << ": dx from the weights before the update";
    }
  // Two uses of the weight: its gradients are summed first, the ordinary way.
  const Run twice = run(values(7 * in), DType::f32, true, true);
  EXPECT_TRUE(twice.stored);
  EXPECT_EQ(twice.wholes, 0);
}

// ---- The leaf-gradient-ready hook (AutogradMeta::on_grad_ready) ----

// An op whose backward gives its input no gradient: the graph reaches the leaves behind it, but no
// gradient does.
struct StopGradient : autograd::Node {
  const char* name() const override { return "stop_gradient"; }
  std::vector<Tensor> backward(const Tensor&) override { return {Tensor()}; }
};
Tensor stop_gradient(const Tensor& x) {
  Tensor out = x.detach().clone();
  if (autograd::needs_grad({&x})) autograd::record(out, std::make_shared<StopGradient>(), {&x});
  return out;
}

// Records which leaf became ready, in order, with its gradient at that moment ({} if undefined).
struct ReadyLog {
  std::vector<std::string> order;
  std::vector<std::vector<float>> grads;
  void watch(Tensor& t, const std::string& name) {
    AutogradMeta* meta = t.autograd_meta().get();
    meta->on_grad_ready = [this, meta, name] {
      order.push_back(name);
      grads.push_back(meta->grad ? meta->grad->to_float_vector() : std::vector<float>{});
    };
  }
};

// A chain y = sum(w3 * (w2 * (w1 * x))): the pass finishes w3 first (nearest the root), then w2,
// then w1, each hook called once, after its leaf's gradient is in grad().
TEST(GradReadyHook, LeavesBecomeReadyInTheOrderThePassFinishesThem) {
  Tensor x = Tensor::from_floats({1, 2}, {2});
  Tensor w1 = leaf({2, 3}, {2}), w2 = leaf({5, 7}, {2}), w3 = leaf({-1, 0.5}, {2});
  ReadyLog log;
  log.watch(w1, "w1");
  log.watch(w2, "w2");
  log.watch(w3, "w3");
  autograd::backward(ops::sum(ops::mul(w3, ops::mul(w2, ops::mul(w1, x)))));
  EXPECT_EQ(log.order, (std::vector<std::string>{"w3", "w2", "w1"}));
  ASSERT_EQ(log.grads.size(), 3u);
  EXPECT_EQ(log.grads[0], (std::vector<float>{10, 42}));  // w2 * w1 * x
  EXPECT_EQ(log.grads[1], (std::vector<float>{-2, 3}));   // w3 * w1 * x
  EXPECT_EQ(log.grads[2], (std::vector<float>{-5, 7}));   // w3 * w2 * x
  // Each pass calls each hook once; the second sees the two passes' sum.
  autograd::backward(ops::sum(ops::mul(w3, ops::mul(w2, ops::mul(w1, x)))));
  EXPECT_EQ(log.order, (std::vector<std::string>{"w3", "w2", "w1", "w3", "w2", "w1"}));
  EXPECT_EQ(log.grads[5], (std::vector<float>{-10, 14}));
}

// A weight used at both ends of a chain, y = sum(w * (a * (w * x))): one call, after the second
// contribution (d/dw = 2 w a x), and after a (which the pass finishes between w's two uses).
TEST(GradReadyHook, ASharedWeightIsReadyOnceAfterItsLastContribution) {
  Tensor x = Tensor::from_floats({1, 2}, {2});
  Tensor w = leaf({3, -1}, {2}), a = leaf({2, 5}, {2});
  ReadyLog log;
  log.watch(w, "w");
  log.watch(a, "a");
  autograd::backward(ops::sum(ops::mul(w, ops::mul(a, ops::mul(w, x)))));
  EXPECT_EQ(log.order, (std::vector<std::string>{"a", "w"}));
  ASSERT_EQ(log.grads.size(), 2u);
  EXPECT_EQ(log.grads[1], (std::vector<float>{12, -20}));  // 2 w a x
  // The same weight twice in one op: one call too.
  autograd::backward(ops::sum(ops::mul(w, w)));
  EXPECT_EQ(log.order, (std::vector<std::string>{"a", "w", "w"}));
  EXPECT_EQ(log.grads[2], (std::vector<float>{18, -22}));  // 12 + 2 * 3, -20 + 2 * -1
}

// A leaf outside the graph is not called; a leaf the graph reaches but no gradient does is
// called once, with no gradient; a root that is itself a leaf is called.
TEST(GradReadyHook, LeavesTheGraphReachesAreCalledWithOrWithoutAGradient) {
  Tensor x = Tensor::from_floats({1, 2}, {2});
  Tensor used = leaf({1, 1}, {2}), blocked = leaf({4, 4}, {2}), unused = leaf({9, 9}, {2});
  ReadyLog log;
  log.watch(used, "used");
  log.watch(blocked, "blocked");
  log.watch(unused, "unused");
  autograd::backward(ops::sum(ops::add(ops::mul(used, x), stop_gradient(ops::mul(blocked, x)))));
  EXPECT_EQ(log.order, (std::vector<std::string>{"blocked", "used"}));
  ASSERT_EQ(log.grads.size(), 2u);
  EXPECT_TRUE(log.grads[0].empty()) << "no gradient reached it";
  EXPECT_FALSE(blocked.grad().defined());
  EXPECT_EQ(log.grads[1], (std::vector<float>{1, 2}));
  Tensor root = leaf({3}, {1});
  log.watch(root, "root");
  autograd::backward(root);
  EXPECT_EQ(log.order.back(), "root");
  EXPECT_EQ(log.grads.back(), (std::vector<float>{1}));
}

// An update in the backward pass (consume_grad, and a linear layer's parts) is not used for a
// leaf with a hook: its gradient is stored and the hook sees it. A leaf without a hook in the same
// pass still has its gradient consumed.
TEST(GradReadyHook, AHookedLeafKeepsItsGradientFromAnUpdateInTheBackwardPass) {
  Tensor x = Tensor::from_floats({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor w = leaf({1, 0, -1, 2, 1, 0}, {2, 3}), b = leaf({0.5, -0.5}, {2});
  int consumed_w = 0, consumed_b = 0, parts_w = 0;
  w.autograd_meta()->consume_grad = [&](int64_t, int64_t, const void*, DType) { ++consumed_w; };
  w.autograd_meta()->consume_grad_parts = [&]() -> GradPartConsumer {
    ++parts_w;
    return [](int64_t, int64_t, const void*, DType) {};
  };
  b.autograd_meta()->consume_grad = [&](int64_t, int64_t, const void*, DType) { ++consumed_b; };
  ReadyLog log;
  log.watch(w, "w");
  autograd::backward(ops::sum(ops::linear(x, w, b)));
  EXPECT_EQ(consumed_w + parts_w, 0);
  EXPECT_EQ(consumed_b, 1);
  EXPECT_FALSE(b.grad().defined());
  EXPECT_EQ(log.order, (std::vector<std::string>{"w"}));
  ASSERT_EQ(log.grads.size(), 1u);
  EXPECT_EQ(log.grads[0], (std::vector<float>{5, 7, 9, 5, 7, 9}));  // column sums of x
  EXPECT_FALSE(w.autograd_meta()->consume_grad) << "cleared for the pass, as for a shared weight";
}

// A recomputed layer runs a backward pass of its own inside the outer one, accumulating its
// parameters' gradients there: their hooks are still called once each, by the outer pass, with
// the whole gradient (the same as without recomputation).
TEST(GradReadyHook, ARecomputedLayersParametersAreReadyOnce) {
  auto run = [](bool recompute) {
    nn::InitStreams init(7);
    nn::Sequential m;
    m.add(std::make_shared<nn::Linear>(3, 4, init));
    m.add(std::make_shared<nn::ReLU>());
    m.add(std::make_shared<nn::Linear>(4, 2, init));
    m.submodule("0").set_recompute(recompute);
    ReadyLog log;
    for (auto& p : m.named_parameters()) log.watch(*p.tensor, p.name);
    const Tensor x = Tensor::from_floats({1, -2, 3, 0.5, 0.25, -1}, {2, 3});
    autograd::backward(ops::sum(m(x)));
    std::vector<std::vector<float>> final_grads;
    for (auto& p : m.named_parameters()) final_grads.push_back(p.tensor->grad().to_float_vector());
    return std::make_tuple(log.order, log.grads, final_grads);
  };
  const auto [order, at_ready, final_grads] = run(true);
  EXPECT_EQ(order, (std::vector<std::string>{"2.weight", "2.bias", "0.weight", "0.bias"}));
  ASSERT_EQ(at_ready.size(), 4u);
  EXPECT_EQ(at_ready[2], final_grads[0]);
  EXPECT_EQ(at_ready[3], final_grads[1]);
  EXPECT_EQ(std::get<2>(run(false)), final_grads);
}

}  // namespace
}  // namespace mantissa
