// Modules and models: PyTorch's names, shapes and parameter counts, dtype casts of the whole model
// and of sub-modules, state dicts, the printout, and the initial distributions.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "mantissa/mantissa.h"
#include "support/errors.h"

namespace mantissa {
namespace {

using testing::error_of;

std::vector<std::string> names(nn::Module& m) {
  std::vector<std::string> out;
  for (auto& p : m.named_parameters()) out.push_back(p.name);
  return out;
}

// A module registered under itself, or under a module it holds, is refused at registration:
// every walk of the tree (parameters, state_dict, printing) would otherwise recurse forever.
TEST(Modules, ACycleOfModulesIsRefused) {
  auto a = std::make_shared<nn::Sequential>();
  auto b = std::make_shared<nn::Sequential>();
  std::string e = error_of([&] { a->register_module("me", a); });
  EXPECT_NE(e.find("sub-module 'me' is this module itself: the modules would form a cycle"),
            std::string::npos)
      << e;
  a->register_module("b", b);
  e = error_of([&] { b->register_module("a", a); });
  EXPECT_NE(e.find("sub-module 'a' is a module that holds this one"), std::string::npos) << e;
  EXPECT_EQ(a->named_modules().size(), 2u);
  // The same module in two places is not a cycle.
  auto shared = std::make_shared<nn::ReLU>();
  a->register_module("r1", shared);
  b->register_module("r2", shared);
  EXPECT_EQ(a->named_modules().size(), 4u);
}

TEST(Models, TutorialCnnHasTheSeedsNamesShapesAndCount) {
  auto m = nn::make_model("tutorial-cnn", {});
  const std::vector<std::string> want = {"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                         "norm.weight",  "norm.bias",  "fc1.weight",   "fc1.bias",
                                         "fc2.weight",   "fc2.bias"};
  EXPECT_EQ(names(*m), want);
  EXPECT_EQ(m->submodule("fc1").named_parameters()[0].tensor->shape(), (Shape{100, 41772}));
  EXPECT_EQ(m->num_parameters(), 4179896);  // sum(p.numel() for p in model.parameters())
  Tensor x = Tensor::zeros({2, 1, 128, 128}, DType::f32);
  Tensor y = m->forward(x);
  EXPECT_EQ(y.shape(), (Shape{2, 10}));
  // Log-probabilities over the classes (dim 1): each row's probabilities sum to 1.
  const std::vector<float> v = y.to_float_vector();
  for (int r = 0; r < 2; ++r) {
    double s = 0;
    for (int k = 0; k < 10; ++k) s += std::exp(v[static_cast<size_t>(r * 10 + k)]);
    EXPECT_NEAR(s, 1.0, 1e-5);
  }
}

TEST(Models, ResNetsHaveTorchvisionNamesAndCounts) {
  nn::ModelConfig c;
  c.in_channels = 3;
  c.image_size = 32;
  auto r18 = nn::make_model("resnet18", c);
  // torchvision resnet18(num_classes=10) has 11,181,642 parameters; the CIFAR stem's 3x3 conv1
  // has 1,728 weights instead of 9,408.
  EXPECT_EQ(r18->num_parameters(), 11181642 - 9408 + 1728);
  std::map<std::string, Shape> sd;
  for (auto& [n, t] : r18->state_dict()) sd[n] = t.shape();
  EXPECT_EQ(sd.at("conv1.weight"), (Shape{64, 3, 3, 3}));
  EXPECT_EQ(sd.at("layer1.0.bn1.running_mean"), (Shape{64}));
  EXPECT_EQ(sd.at("layer2.0.downsample.0.weight"), (Shape{128, 64, 1, 1}));
  EXPECT_EQ(sd.at("layer2.0.downsample.1.num_batches_tracked"), (Shape{}));
  EXPECT_EQ(sd.at("fc.weight"), (Shape{10, 512}));
  EXPECT_EQ(sd.count("layer1.0.downsample.0.weight"), 0u);
  EXPECT_EQ(sd.size(), 122u);  // len(torchvision.models.resnet18().state_dict())

  c.imagenet_stem = true;
  c.num_classes = 1000;
  c.image_size = 64;
  EXPECT_EQ(nn::make_model("resnet50", c)->num_parameters(), 25557032);  // torchvision resnet50
  EXPECT_EQ(nn::make_model("resnet34", c)->num_parameters(), 21797672);
}

TEST(Models, ForwardShapesOfEveryModel) {
  for (const std::string name : {"lenet5", "resnet18", "resnet50"}) {
    nn::ModelConfig c;
    c.in_channels = name == "lenet5" ? 1 : 3;
    c.image_size = 32;
    auto m = nn::make_model(name, c);
    Tensor y = m->forward(Tensor::zeros({2, c.in_channels, 32, 32}, DType::f32));
    EXPECT_EQ(y.shape(), (Shape{2, 10})) << name;
  }
}

TEST(Models, ForwardMultiplyAddsMatchPyTorchsCount) {
  // Conv2d and Linear multiply-adds of one image's forward. The ResNet and tutorial figures are
  // PyTorch's: forward hooks on scripts/torch_models.py's models adding, per layer, the output's
  // elements x in_channels/groups x KH x KW (Conv2d) or x in_features (Linear). LeNet-5's is by
  // hand at 16x16: conv1 6x12x12x25, conv2 16x2x2x150, fc 16x120 + 120x84 + 84x10.
  struct Case {
    const char* name;
    int64_t channels, size;
    bool imagenet_stem;
    int64_t macs;
  };
  for (const Case& k :
       {Case{"tutorial-cnn", 1, 128, false, 10114120}, Case{"resnet18", 3, 32, false, 555422720},
        Case{"resnet18", 3, 64, true, 148050944},
        Case{"lenet5", 1, 16, false, 21600 + 9600 + 1920 + 10080 + 840}}) {
    nn::ModelConfig c;
    c.in_channels = k.channels;
    c.image_size = k.size;
    c.imagenet_stem = k.imagenet_stem;
    auto m = nn::make_model(k.name, c);
    m->eval();
    MacCounter counter;
    m->forward(Tensor::zeros({2, k.channels, k.size, k.size}, DType::f32));
    EXPECT_EQ(counter.macs(), 2 * k.macs) << k.name << " at " << k.size;
  }
}

TEST(Models, BadConfigurationsAreExplained) {
  EXPECT_NE(error_of([] { nn::make_model("vgg16", {}); }).find("choose one of: tutorial-cnn"),
            std::string::npos);
  nn::ModelConfig c;
  c.image_size = 8;
  EXPECT_NE(error_of([&] { nn::make_model("tutorial-cnn", c); }).find("--image-size"),
            std::string::npos);
  nn::ModelConfig small;
  small.image_size = 16;
  auto m = nn::make_model("lenet5", small);
  EXPECT_NE(error_of([&] { m->forward(Tensor::zeros({1, 1, 32, 32}, DType::f32)); }), "");
}

TEST(Modules, HalfAndPerLayerCastsAsInTheSeed) {
  auto m = nn::make_model("tutorial-cnn", {});
  m->half();  // model.half()
  for (auto& p : m->named_parameters()) EXPECT_EQ(p.tensor->dtype(), DType::f16) << p.name;
  m->submodule("conv1").float_();  // model.conv1.float()
  EXPECT_EQ(m->submodule("conv1").named_parameters()[0].tensor->dtype(), DType::f32);
  EXPECT_EQ(m->submodule("conv2").named_parameters()[0].tensor->dtype(), DType::f16);
  EXPECT_TRUE(m->submodule("conv1").named_parameters()[0].tensor->requires_grad());
  Tensor y = m->forward(Tensor::zeros({1, 1, 128, 128}, DType::f16));
  EXPECT_EQ(y.shape(), (Shape{1, 10}));
  m->bfloat16();
  for (auto& p : m->named_parameters()) EXPECT_EQ(p.tensor->dtype(), DType::bf16) << p.name;
  EXPECT_NE(error_of([&] { m->to(DType::i32); }).find("cannot cast a module"), std::string::npos);
}

TEST(Modules, NormStatisticsStayF32WhenTheModelIsHalved) {
  nn::ModelConfig c;
  c.in_channels = 3;
  c.image_size = 16;
  auto m = nn::make_model("resnet18", c);
  m->half();
  for (auto& b : m->named_buffers()) {
    if (b.name.ends_with("num_batches_tracked"))
      EXPECT_EQ(b.tensor->dtype(), DType::i64);
    else
      EXPECT_EQ(b.tensor->dtype(), DType::f32) << b.name;
  }
  m->train();
  Tensor y = m->forward(Tensor::zeros({2, 3, 16, 16}, DType::f16));
  EXPECT_EQ(y.dtype(), DType::f16);
  EXPECT_EQ(m->submodule("bn1").named_buffers()[2].tensor->data<int64_t>()[0], 1);
}

TEST(Modules, SubmoduleErrorsListTheNames) {
  auto m = nn::make_model("tutorial-cnn", {});
  const std::string e = error_of([&] { m->submodule("conv3"); });
  EXPECT_NE(e.find("no sub-module 'conv3'"), std::string::npos) << e;
  EXPECT_NE(e.find("conv1, pool, conv2"), std::string::npos) << e;
}

TEST(Modules, StateDictRoundTripsAndRejectsOtherModels) {
  nn::ModelConfig c1;
  c1.image_size = 32;
  c1.seed = 1;
  nn::ModelConfig c2 = c1;
  c2.seed = 2;
  auto x = nn::make_model("lenet5", c1), y = nn::make_model("lenet5", c2);
  std::map<std::string, Tensor> sd;
  for (auto& [n, t] : x->state_dict()) sd.emplace(n, t);
  EXPECT_NE(x->state_dict()[0].second.to_float_vector(),
            y->state_dict()[0].second.to_float_vector());
  y->load_state_dict(sd, "x.safetensors");
  EXPECT_EQ(x->state_dict()[0].second.to_float_vector(),
            y->state_dict()[0].second.to_float_vector());

  auto missing = sd;
  missing.erase("fc3.bias");
  EXPECT_NE(error_of([&] {
              y->load_state_dict(missing, "f.safetensors");
            }).find("f.safetensors has no tensor 'fc3.bias'"),
            std::string::npos);
  auto extra = sd;
  extra.emplace("fc4.weight", Tensor::zeros({1}, DType::f32));
  EXPECT_NE(error_of([&] { y->load_state_dict(extra, "f.safetensors"); }).find("'fc4.weight'"),
            std::string::npos);
  auto wrong = sd;
  wrong["fc1.weight"] = Tensor::zeros({120, 401}, DType::f32);
  const std::string e = error_of([&] { y->load_state_dict(wrong, "f.safetensors"); });
  EXPECT_NE(e.find("'fc1.weight' has shape (120, 401) but the model's is (120, 400)"),
            std::string::npos)
      << e;
}

TEST(Modules, SummaryAndReprNameEveryLayer) {
  auto m = nn::make_model("tutorial-cnn", {});
  const std::string s = m->summary();
  EXPECT_NE(s.find("(conv1): Conv2d(1, 5, kernel_size=(3, 3), stride=(1, 1))"), std::string::npos)
      << s;
  EXPECT_NE(s.find("(norm): GroupNorm(3, 12, eps=1e-05, affine=True)"), std::string::npos) << s;
  EXPECT_NE(s.find("fc1.weight"), std::string::npos);
  EXPECT_NE(s.find("(100, 41772)"), std::string::npos);
  EXPECT_NE(s.find("parameters: 4179896"), std::string::npos);
}

TEST(Init, DefaultLinearIsUniformWithinOneOverSqrtFanIn) {
  nn::InitStreams init(5);
  nn::Linear l(400, 300, init);
  const std::vector<float> w = l.named_parameters()[0].tensor->to_float_vector();
  const double bound = 1 / std::sqrt(400.0);
  double mean = 0, var = 0, mx = 0;
  for (float v : w) mean += v, mx = std::max(mx, std::fabs(double(v)));
  mean /= static_cast<double>(w.size());
  for (float v : w) var += (v - mean) * (v - mean);
  var /= static_cast<double>(w.size());
  EXPECT_LE(mx, bound);
  EXPECT_GT(mx, 0.99 * bound);
  EXPECT_NEAR(mean, 0, 0.01 * bound);
  EXPECT_NEAR(var, bound * bound / 3, 0.02 * bound * bound / 3);  // U(-b, b) has variance b^2/3
}

TEST(Init, KaimingNormalFanOutHasTheRightStd) {
  Tensor w = Tensor::empty({256, 64, 3, 3}, DType::f32);
  nn::init::kaiming_normal_fan_out_(w, 3, 1);
  const std::vector<float> v = w.to_float_vector();
  double s = 0, s2 = 0;
  for (float x : v) s += x, s2 += double(x) * x;
  const double n = static_cast<double>(v.size()), mean = s / n,
               sd = std::sqrt(s2 / n - mean * mean);
  const double want = std::sqrt(2.0 / (256 * 9));
  EXPECT_NEAR(sd, want, 0.01 * want);
  EXPECT_NEAR(mean, 0, 0.01 * want);
}

TEST(Init, SeedsAreReproducibleAndDistinct) {
  nn::ModelConfig a;
  a.image_size = 32;
  auto m1 = nn::make_model("lenet5", a), m2 = nn::make_model("lenet5", a);
  a.seed = 9;
  auto m3 = nn::make_model("lenet5", a);
  EXPECT_EQ(m1->state_dict()[0].second.to_float_vector(),
            m2->state_dict()[0].second.to_float_vector());
  EXPECT_NE(m1->state_dict()[0].second.to_float_vector(),
            m3->state_dict()[0].second.to_float_vector());
  // Different tensors of one model draw from different streams.
  EXPECT_NE(m1->state_dict()[0].second.to_float_vector()[0],
            m1->state_dict()[1].second.to_float_vector()[0]);
}

TEST(Layers, DropoutDependsOnStepAndIsOffInEval) {
  nn::InitStreams init(0);
  nn::Dropout d(init, 0.5);
  Tensor x = Tensor::full({1000}, 1.0, DType::f32);
  nn::set_random_context({7, 1});
  const std::vector<float> a = d.forward(x).to_float_vector();
  nn::set_random_context({7, 2});
  const std::vector<float> b = d.forward(x).to_float_vector();
  nn::set_random_context({7, 1});
  nn::InitStreams init2(0);
  nn::Dropout d2(init2, 0.5);
  const std::vector<float> a2 = d2.forward(x).to_float_vector();
  EXPECT_NE(a, b);
  EXPECT_EQ(a, a2);  // same layer position, seed and step: same mask (a resumed run)
  int zeros = 0;
  for (float v : a) {
    zeros += v == 0;
    EXPECT_TRUE(v == 0 || v == 2);
  }
  EXPECT_NEAR(zeros, 500, 60);
  d.eval();
  EXPECT_EQ(d.forward(x).to_float_vector(), x.to_float_vector());
}

TEST(Layers, SequentialNamesChildrenByIndex) {
  nn::InitStreams init(0);
  nn::Sequential s;
  s.add(std::make_shared<nn::Linear>(4, 3, init))
      .add(std::make_shared<nn::ReLU>())
      .add(std::make_shared<nn::Linear>(3, 2, init));
  EXPECT_EQ(names(s), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(s.forward(Tensor::zeros({5, 4}, DType::f32)).shape(), (Shape{5, 2}));
  nn::LayerNorm ln({4});
  EXPECT_EQ(ln.forward(Tensor::zeros({2, 4}, DType::f32)).shape(), (Shape{2, 4}));
  EXPECT_NE(error_of([&] {
              ln.forward(Tensor::zeros({2, 5}, DType::f32));
            }).find("last dimensions must be (4,)"),
            std::string::npos);
}

}  // namespace
}  // namespace mantissa
