// The precision settings of a run: resolved once from the user's choices (every override applied,
// the printed line), applied to a model and optimizer (O2's normalization layers recognised by
// their property, not their type name), and the loss-scaling protocol of one step.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "mantissa/mantissa.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using testing::error_of;

TEST(PrecisionSettings, ResolveAppliesEveryOverrideOnce) {
  amp::PrecisionChoices c;
  c.precision = "16-true";
  c.first_moment_type = "fp32";
  c.accum_type = "bf16";
  c.partials = "fp16";
  c.loss_scaling = "dynamic";
  c.loss_scale_init = 1024;
  c.loss_scale_growth_interval = 10;
  c.loss_scale_hysteresis = 2;
  c.stochastic_rounding = true;
  const amp::PrecisionSettings s = amp::resolve_precision(c, 7);
  EXPECT_EQ(s.mode.name, "16-true");
  EXPECT_EQ(s.mode.param_dtype, DType::f16);
  EXPECT_EQ(s.partials, kernels::Partials::kF16);
  EXPECT_EQ(s.grad_dtype, DType::bf16);
  EXPECT_EQ(s.state_types.first_moment, DType::f32);
  EXPECT_EQ(s.state_types.second_moment, DType::bf16);  // the mode's
  ASSERT_TRUE(s.loss_scaling.has_value());
  EXPECT_EQ(s.loss_scaling->init_scale, 1024);
  EXPECT_EQ(s.loss_scaling->growth_interval, 10);
  EXPECT_EQ(s.loss_scaling->hysteresis, 2);
  EXPECT_TRUE(s.stochastic_rounding_seed.has_value());
  EXPECT_FALSE(s.stochastic_outputs_seed.has_value());
  EXPECT_EQ(s.describe(),
            "precision 16-true: parameters f16, input f16, autocast off, master weights none, "
            "loss as computed, loss scaling dynamic (initial 1024, x2 after 10 clean steps, x0.5 "
            "on overflow, hysteresis 2), optimizer state f32/bf16, partials fp16, gradients bf16, "
            "stochastic rounding");
  // The mode's own defaults when nothing overrides them.
  const amp::PrecisionSettings d = amp::resolve_precision(amp::PrecisionChoices{}, 0);
  EXPECT_EQ(d.describe(), d.mode.describe() + ", partials fp32");
  EXPECT_FALSE(d.loss_scaling.has_value());
}

TEST(PrecisionSettings, BadChoicesNameTheFlag) {
  auto error = [](auto edit) {
    amp::PrecisionChoices c;
    edit(c);
    return error_of([&] { amp::resolve_precision(c, 0); });
  };
  EXPECT_NE(error([](auto& c) { c.partials = "fp8"; }).find("--partials 'fp8'"), std::string::npos);
  EXPECT_NE(error([](auto& c) { c.second_moment_type = "int8"; }).find("--second-moment-type"),
            std::string::npos);
  EXPECT_NE(error([](auto& c) { c.loss_scale_hysteresis = 0; }).find("--loss-scale-hysteresis"),
            std::string::npos);
  EXPECT_NE(error([](auto& c) { c.stochastic_outputs = true; }).find("needs 16-bit op outputs"),
            std::string::npos);
  EXPECT_NE(error([](auto& c) {
              c.keep_fp32 = {"fc"};
              c.half_modules = {"fc"};
            }).find("in both --keep-fp32 and --half-modules"),
            std::string::npos);
}

// A layer of a user's own with one weight, a normalization layer or not.
class Scale : public nn::Module {
 public:
  explicit Scale(bool normalization) : Module("Scale"), normalization_(normalization) {
    register_parameter("weight", Tensor::full({4}, 1.0, DType::f32));
  }
  Tensor forward(const Tensor& x) override { return ops::mul(x, param("weight")); }
  bool is_normalization() const override { return normalization_; }

 private:
  bool normalization_;
};

TEST(PrecisionSettings, ApplyRecognisesNormalizationLayersByTheirProperty) {
  nn::InitStreams init(0);
  nn::Sequential model;
  model.add(std::make_shared<nn::Linear>(4, 4, init));
  model.add(std::make_shared<nn::LayerNorm>(Shape{4}));
  model.add(std::make_shared<Scale>(true));
  model.add(std::make_shared<Scale>(false));
  model.add(std::make_shared<nn::LogSoftmax>(1));
  optim::Sgd sgd(model.named_parameters(), optim::SgdOptions{});
  amp::PrecisionChoices c;
  c.precision = "O2";
  c.half_type = "bf16";
  amp::apply_precision(amp::resolve_precision(c, 0), model, sgd);
  auto dtype = [&](const std::string& path) {
    return model.submodule(path).named_parameters()[0].tensor->dtype();
  };
  EXPECT_EQ(dtype("0"), DType::bf16);
  EXPECT_EQ(dtype("1"), DType::f32);  // LayerNorm
  EXPECT_EQ(dtype("2"), DType::f32);  // a user's normalization layer
  EXPECT_EQ(dtype("3"), DType::bf16);
  EXPECT_FALSE(model.submodule("1").precision().has_value()) << "takes 16-bit inputs as they come";
  EXPECT_EQ(model.submodule("4").precision(), DType::f32);  // the log-softmax runs in FP32
  EXPECT_TRUE(sgd.has_master_weights());
  // The optimizer holds the model's tensors, cast in place.
  EXPECT_EQ(sgd.params()[0].tensor->dtype(), DType::bf16);

  // Module overrides: keep_fp32 wins; an unknown path is named.
  nn::Sequential other;
  other.add(std::make_shared<nn::Linear>(4, 4, init));
  other.add(std::make_shared<nn::Linear>(4, 4, init));
  optim::Adam adam(other.named_parameters(), optim::AdamOptions{}, true);
  c.precision = "16-true";
  c.half_type.clear();
  c.keep_fp32 = {"1"};
  c.second_moment_type = "fp16";
  amp::apply_precision(amp::resolve_precision(c, 0), other, adam);
  EXPECT_EQ(other.submodule("0").named_parameters()[0].tensor->dtype(), DType::f16);
  EXPECT_EQ(other.submodule("1").named_parameters()[0].tensor->dtype(), DType::f32);
  EXPECT_EQ(adam.state_types().first_moment, DType::f16);
  EXPECT_EQ(adam.state_types().second_moment, DType::f16);
  c.keep_fp32 = {"7"};
  EXPECT_NE(error_of([&] {
              amp::apply_precision(amp::resolve_precision(c, 0), other, adam);
            }).find("'7'"),
            std::string::npos);
}

TEST(PrecisionSettings, StateTypesAreSetBeforeTheFirstStep) {
  Tensor w = Tensor::full({4}, 1.0, DType::f32).set_requires_grad();
  optim::Adam adam({{"w", &w}}, optim::AdamOptions{}, false);
  adam.set_state_types({DType::bf16, DType::f16});
  w.set_grad(Tensor::full({4}, 0.5, DType::f32));
  adam.step();
  EXPECT_EQ(adam.state_tensors()[0].second.dtype(), DType::bf16);
  EXPECT_NE(error_of([&] {
              adam.set_state_types({DType::f32, DType::f32});
            }).find("cannot change after its first step"),
            std::string::npos);
  EXPECT_THROW(adam.set_state_types({DType::i64, DType::f32}), Error);
}

// loss = sum(w * x): the gradient of w is x.
Tensor product_loss(const Tensor& w, const std::vector<float>& x) {
  return ops::sum(ops::mul(w, Tensor::from_floats(x, {2})));
}

TEST(ScaledStep, ScalesUnscalesSkipsAndUpdatesTheScaler) {
  amp::LossScalerOptions o;
  o.init_scale = 1024;
  o.growth_interval = 1;
  amp::LossScaler scaler(o);
  Tensor w = Tensor::from_floats({1, 2}, {2}).set_requires_grad();
  optim::SgdOptions so;
  so.lr = 1;
  optim::Sgd sgd({{"w", &w}}, so);
  {
    amp::ScaledStep scaled(&scaler);
    EXPECT_EQ(scaled.scale(), 1024.0f);
    EXPECT_EQ(scaled.inverse_scale(), 1.0f / 1024);
    EXPECT_EQ(scaled.inverse_scale(4), 1.0f / 4096);
    const Tensor loss = product_loss(w, {0.5f, 0.25f});
    const Tensor s = scaled.scale_loss(loss);
    EXPECT_EQ(s.item(), 1024 * loss.item());
    autograd::backward(s);
    EXPECT_EQ(w.grad().to_float_vector(), (std::vector<float>{512, 256}));  // S x
    const optim::StepReport r = scaled.step(sgd, {});
    EXPECT_FALSE(r.skipped);
    EXPECT_EQ(w.to_float_vector(), (std::vector<float>{0.5f, 1.75f}));  // w - x: unscaled
    EXPECT_EQ(scaler.scale(), 2048);                                    // one clean step grows it
    sgd.zero_grad();
  }
  {
    // An overflow: the step is skipped and the scale backs off.
    amp::ScaledStep scaled(&scaler);
    autograd::backward(scaled.scale_loss(product_loss(w, {INFINITY, 1})));
    const optim::StepReport r = scaled.step(sgd, {});
    EXPECT_TRUE(r.skipped);
    EXPECT_EQ(r.nonfinite, (std::vector<std::string>{"w"}));
    EXPECT_EQ(w.to_float_vector(), (std::vector<float>{0.5f, 1.75f}));
    EXPECT_EQ(scaler.scale(), 1024);
    EXPECT_EQ(scaler.skipped_steps(), 1);
    sgd.zero_grad();
  }
  {
    // Without a scaler: S = 1, the loss as it is, and nothing is skipped.
    amp::ScaledStep scaled(nullptr);
    EXPECT_EQ(scaled.scale(), 1.0f);
    const Tensor loss = product_loss(w, {1, 1});
    EXPECT_EQ(scaled.scale_loss(loss).item(), loss.item());
    autograd::backward(scaled.scale_loss(loss, 0.5));  // a micro-batch's weight
    EXPECT_EQ(w.grad().to_float_vector(), (std::vector<float>{0.5f, 0.5f}));
    EXPECT_FALSE(scaled.step(sgd, {}, 0.5).skipped);  // divided by 0.5: the whole gradient
    EXPECT_EQ(w.to_float_vector(), (std::vector<float>{-0.5f, 0.75f}));
  }
}

}  // namespace
}  // namespace mantissa
