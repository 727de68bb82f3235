// Anomaly detection: the first op whose output (forward) or gradient (backward) holds inf/NaN
// stops the computation with its name, module path, dtype and the statistics of its inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "mantissa/mantissa.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using testing::error_of;

std::string anomaly_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const autograd::AnomalyError& e) {
    return e.what();
  }
  return "";
}

TEST(Anomaly, ForwardNamesTheFirstOpItsModuleDtypeAndInputs) {
  nn::InitStreams init(0);
  auto seq = std::make_shared<nn::Sequential>();
  seq->add(std::make_shared<nn::Linear>(4, 4, init));
  seq->add(std::make_shared<nn::ReLU>());
  seq->to(DType::f16);
  for (auto& p : seq->named_parameters())
    p.tensor->copy_from(Tensor::full(p.tensor->shape(), 300.0, DType::f16));
  const Tensor x = Tensor::full({1, 4}, 100.0, DType::f16);
  // 4 * 300 * 100 + 300 = 120300 > 65504: the linear layer overflows; ReLU is never reached.
  const Tensor quiet = (*seq)(x);  // without the guard: infinities pass silently
  EXPECT_TRUE(std::isinf(quiet.to_float_vector()[0]));
  autograd::DetectAnomalyScope guard;
  const std::string e = anomaly_of([&] { (*seq)(x); });
  EXPECT_NE(
      e.find("anomaly in forward: linear in module '0' produced 4 inf/nan values (f16 (1, 4)"),
      std::string::npos)
      << e;
  EXPECT_NE(e.find("input 0: f16 (1, 4): min 100, max 100, largest |x| 100, 0 of 4 inf/nan"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("input 1: f16 (4, 4): min 300"), std::string::npos) << e;
  EXPECT_NE(e.find("run this module in FP32 (--keep-fp32 0)"), std::string::npos) << e;
  // Inputs that are already non-finite are blamed on where they came from.
  const Tensor bad = Tensor::from_floats({1, NAN, 3, 4}, {1, 4}, DType::f16);
  const std::string e2 = anomaly_of([&] { ops::relu(bad); });
  EXPECT_NE(e2.find("relu outside any module produced 1 inf/nan"), std::string::npos) << e2;
  EXPECT_NE(e2.find("inputs were already inf/nan"), std::string::npos) << e2;
  // Finite results pass, and the cast op (never autocast) is checked too.
  EXPECT_EQ(anomaly_of([&] { ops::relu(x); }), "");
  const std::string e3 =
      anomaly_of([&] { ops::cast(Tensor::full({2}, 1e5, DType::f32), DType::f16); });
  EXPECT_NE(e3.find("anomaly in forward: cast outside any module produced 2 inf/nan"),
            std::string::npos)
      << e3;
}

TEST(Anomaly, BackwardNamesTheNodeAndTheModuleThatRecordedIt) {
  // Forward in FP32 is finite (1e6); the gradient cast back to the f16 leaf is not.
  Tensor w = Tensor::full({3}, 1.0, DType::f16);
  w.set_requires_grad(true);
  auto loss = [&] { return ops::sum(ops::mul_scalar(ops::cast(w, DType::f32), 1e6)); };
  {
    autograd::DetectAnomalyScope guard;
    const Tensor l = loss();
    const std::string e = anomaly_of([&] { autograd::backward(l); });
    EXPECT_NE(e.find("anomaly in backward: the gradient of "), std::string::npos) << e;
    EXPECT_NE(e.find("for its input 0 has 3 inf/nan values (f16 (3,): all 3 values inf/nan)"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("gradient of its output: f32 (3,): min 1e+06"), std::string::npos) << e;
  }
  {
    // Under loss scaling an infinite gradient is the scaler's signal: only NaN stops.
    autograd::DetectAnomalyScope guard(/*inf_in_backward=*/false);
    EXPECT_EQ(anomaly_of([&] { autograd::backward(loss()); }), "");
    const Tensor l = ops::sum(ops::cast(w, DType::f32));
    const std::string e =
        anomaly_of([&] { autograd::backward(l, Tensor::full({}, NAN, DType::f32)); });
    EXPECT_NE(e.find("has 3 nan values"), std::string::npos) << e;
  }
  w.set_grad(Tensor());
  autograd::backward(loss());  // no guard: no check
  EXPECT_TRUE(std::isinf(w.grad().to_float_vector()[0]));
}

TEST(Anomaly, TheTrainerStopsAtTheFirstAndSaysWhichStep) {
  train::TrainConfig c;
  c.model = "lenet5";
  c.dataset = "synthetic";
  c.synthetic_size = 192;
  c.image_size = 16;
  c.progress = c.evaluate = false;
  c.precision = "16-true";
  c.optimizer = "sgd";
  c.lr = 1e5;  // the first update blows the weights past FP16's range
  c.detect_anomaly = true;
  const std::string e = anomaly_of([&] { train::Trainer(c).run(); });
  EXPECT_NE(e.find("step 2: anomaly in forward: linear in module 'fc1'"), std::string::npos) << e;
  // A run that produces no inf/NaN is not stopped: every step runs.
  c.lr = 1e-3;
  c.max_steps = 4;
  EXPECT_EQ(anomaly_of([&] { EXPECT_EQ(train::Trainer(c).run().steps, 4); }), "");
}

}  // namespace
}  // namespace mantissa
