// The precision settings of a run: resolved once from the user's choices (every override applied,
// the printed line), applied to a model and optimizer (O2's normalization layers recognised by
// their property, not their type name), and the loss-scaling protocol of one step.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

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
  const std::vector<float> w0 =
      model.submodule("0").named_parameters()[0].tensor->to_float_vector();
  amp::apply_precision(amp::resolve_precision(c, 0), model, sgd);
  // O2 keeps every parameter in FP32 (the masters) and marks all but the normalization layers'
  // to be read as bf16, with bf16 gradients.
  auto meta = [&](const std::string& path) -> const AutogradMeta& {
    const Tensor& t = *model.submodule(path).named_parameters()[0].tensor;
    EXPECT_EQ(t.dtype(), DType::f32) << path;
    return *t.autograd_meta();
  };
  EXPECT_EQ(meta("0").read_as, DType::bf16);
  EXPECT_EQ(meta("0").grad_dtype, DType::bf16);
  EXPECT_FALSE(meta("1").read_as.has_value());  // LayerNorm
  EXPECT_FALSE(meta("1").grad_dtype.has_value());
  EXPECT_FALSE(meta("2").read_as.has_value());  // a user's normalization layer
  EXPECT_EQ(meta("3").read_as, DType::bf16);
  EXPECT_FALSE(model.submodule("1").precision().has_value()) << "takes 16-bit inputs as they come";
  EXPECT_FALSE(model.submodule("0").precision().has_value()) << "no input cast: ops read as bf16";
  EXPECT_EQ(model.submodule("4").precision(), DType::f32);  // the log-softmax runs in FP32
  // The masters start from the bf16 model's values, as masters copied from a model cast to bf16.
  const std::vector<float> w1 =
      model.submodule("0").named_parameters()[0].tensor->to_float_vector();
  ASSERT_EQ(w0.size(), w1.size());
  size_t moved = 0;
  for (size_t i = 0; i < w0.size(); ++i) {
    EXPECT_EQ(w1[i], Tensor::from_floats({w0[i]}, {1}).to(DType::bf16).to_float_vector()[0]);
    moved += w1[i] != w0[i];
  }
  EXPECT_GT(moved, 0u) << "the initial weights were all bf16 values: the rounding went untested";
  // No 16-bit copy, so no master copies either (the optimizer updates the FP32 parameters).
  EXPECT_TRUE(sgd.has_master_weights());
  EXPECT_EQ(sgd.master_bytes(), 0u);
  EXPECT_EQ(sgd.params()[0].tensor->dtype(), DType::f32);

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

// O2's model is its FP32 masters read as 16-bit: every step's loss, gradient and update are those
// of the layout O2 is known by (Apex: the model cast to 16 bits but its normalization layers, FP32
// master copies in the optimizer, the log-softmax in FP32), built here from the modules' own
// casts, which hold that 16-bit copy.
TEST(PrecisionSettings, O2ReadsItsMastersAsTheSixteenBitCopyWouldBe) {
  for (const char* half : {"fp16", "bf16"}) {
    auto build = [] {
      nn::InitStreams init(5);
      auto m = std::make_shared<nn::Sequential>();
      m->add(std::make_shared<nn::Conv2d>(2, 4, 3, init, 1, 1));
      m->add(std::make_shared<nn::GroupNorm>(2, 4));
      m->add(std::make_shared<nn::ReLU>());
      m->add(std::make_shared<nn::Flatten>());
      m->add(std::make_shared<nn::Linear>(4 * 5 * 5, 3, init));
      m->add(std::make_shared<nn::LogSoftmax>(1));
      return m;
    };
    amp::PrecisionChoices c;
    c.precision = "O2";
    c.half_type = half;
    c.loss_scaling = "none";
    const amp::PrecisionSettings s = amp::resolve_precision(c, 0);
    const DType h = s.mode.half;
    // The 16-bit copy: the model cast to h (its input cast at the entry), the norm's weights FP32
    // taking h activations, the log-softmax FP32, masters made from the cast values.
    auto ref = build();
    ref->to(h);
    ref->submodule("1").cast_parameters(DType::f32);
    ref->submodule("5").to(DType::f32);
    optim::Adam ref_opt(ref->named_parameters(), optim::AdamOptions{.lr = 0.05}, true);
    ref_opt.enable_master_weights();
    auto o2 = build();
    optim::Adam o2_opt(o2->named_parameters(), optim::AdamOptions{.lr = 0.05}, true);
    amp::apply_precision(s, *o2, o2_opt);

    std::mt19937 gen(11);
    std::normal_distribution<float> normal;
    for (int step = 0; step < 4; ++step) {
      std::vector<float> xv(6 * 2 * 5 * 5);
      for (float& v : xv) v = normal(gen);
      const Tensor x = Tensor::from_floats(xv, {6, 2, 5, 5});
      const Tensor y = Tensor::from_floats({0, 1, 2, 2, 1, 0}, {6}).to(DType::i64);
      const Tensor ref_loss = ops::nll_loss((*ref)(x), y);
      Tensor o2_out;
      {
        amp::ForwardPrecision fp(s, nullptr, 0);
        o2_out = (*o2)(x.to(h));  // the loader hands O2 its input in 16 bits
      }
      EXPECT_EQ(o2_out.dtype(), DType::f32);  // the log-softmax's
      const Tensor o2_loss = ops::nll_loss(o2_out, y);
      ASSERT_EQ(ref_loss.item(), o2_loss.item()) << half << " step " << step;
      autograd::backward(ref_loss);
      autograd::backward(o2_loss);
      const auto rp = ref->named_parameters(), op = o2->named_parameters();
      for (size_t i = 0; i < rp.size(); ++i) {
        const Tensor& rg = *rp[i].tensor->autograd_meta()->grad;
        const Tensor& og = *op[i].tensor->autograd_meta()->grad;
        EXPECT_EQ(og.dtype(), rg.dtype()) << rp[i].name;  // h, the norm's f32
        EXPECT_EQ(og.to_float_vector(), rg.to_float_vector()) << half << " " << rp[i].name;
      }
      ref_opt.step();
      o2_opt.step();
      ref_opt.zero_grad();
      o2_opt.zero_grad();
    }
    // The FP32 parameters hold the masters' values; the 16-bit copy holds their rounding.
    const auto masters = ref_opt.state_tensors();
    const auto rp = ref->named_parameters(), op = o2->named_parameters();
    for (size_t i = 0; i < rp.size(); ++i) {
      const std::vector<float> o = op[i].tensor->to_float_vector();
      if (rp[i].tensor->dtype() == DType::f32) {
        EXPECT_EQ(o, rp[i].tensor->to_float_vector()) << rp[i].name;
        continue;
      }
      EXPECT_EQ(op[i].tensor->to(h).to_float_vector(), rp[i].tensor->to_float_vector())
          << rp[i].name;
      bool found = false;
      for (const auto& [name, t] : masters)
        if (name == rp[i].name + ".master") {
          EXPECT_EQ(o, t.to_float_vector()) << name;
          found = true;
        }
      EXPECT_TRUE(found) << rp[i].name;
    }
  }
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
