#include "mantissa/nn/models.h"

#include "mantissa/core/error.h"
#include "mantissa/nn/init.h"

namespace mantissa::nn {

Tensor Classifier::loss(const Tensor& output, const Tensor& labels) const {
  return outputs_log_probs() ? ops::nll_loss(output, labels) : ops::cross_entropy(output, labels);
}

void Classifier::set_input_normalization(std::vector<float> mean, std::vector<float> std,
                                         DType dtype) {
  input_normalization_ = InputNormalization{std::move(mean), std::move(std), dtype};
}

Tensor Classifier::forward(const Tensor& x) {
  if (!x.defined() || x.dtype() != DType::u8) return classify(x);
  MANTISSA_CHECK(input_normalization_.has_value(),
                 type() + " got u8 images but has no input normalization",
                 "call set_input_normalization (the trainer does with --eight-bit-io), or hand it "
                 "float images");
  const InputNormalization& n = *input_normalization_;
  return classify(ops::normalize_input(x, n.mean, n.std, n.dtype));
}

namespace {

std::string config_str(const char* model, const ModelConfig& c) {
  return std::string(model) + " (" + std::to_string(c.in_channels) + " channels, " +
         std::to_string(c.image_size) + "x" + std::to_string(c.image_size) + ")";
}

void check_config(const char* model, const ModelConfig& c) {
  MANTISSA_CHECK(c.in_channels > 0 && c.num_classes > 1 && c.image_size > 0,
                 std::string(model) + ": channels, classes (>= 2) and image size must be positive",
                 "");
}

// Each model calls every module it registers, as its PyTorch original does (the shared `relu` is
// called after each layer it follows): a per-module precision (--keep-fp32 relu), a profile row or
// a numerics entry that names a module then names one that runs.
class TutorialCnn : public Classifier {
 public:
  explicit TutorialCnn(const ModelConfig& c) : Classifier("TutorialCNN", c) {
    check_config("tutorial-cnn", c);
    const int64_t s = (c.image_size - 2) / 2 - 4;
    MANTISSA_CHECK(c.image_size >= 12 && s > 0,
                   config_str("tutorial-cnn", c) + " is too small for its 3x3 and 5x5 convolutions",
                   "use --image-size 12 or more (the tutorial uses 128)");
    InitStreams init(c.seed);
    conv1 = register_module("conv1", std::make_shared<Conv2d>(c.in_channels, 5, 3, init));
    pool = register_module("pool", std::make_shared<MaxPool2d>(2, 2));
    conv2 = register_module("conv2", std::make_shared<Conv2d>(5, 12, 5, init));
    norm = register_module("norm", std::make_shared<GroupNorm>(3, 12));
    fc1 = register_module("fc1", std::make_shared<Linear>(12 * s * s, 100, init));
    relu = register_module("relu", std::make_shared<ReLU>());
    fc2 = register_module("fc2", std::make_shared<Linear>(100, c.num_classes, init));
    log_softmax = register_module("log_softmax", std::make_shared<LogSoftmax>(1));
  }
  Tensor classify(const Tensor& x) override {
    Tensor y = (*pool)((*relu)((*conv1)(x)));
    y = (*norm)((*relu)((*conv2)(y)));
    y = ops::flatten(y, 1);
    y = (*relu)((*fc1)(y));
    return (*log_softmax)((*fc2)(y));
  }
  bool outputs_log_probs() const override { return true; }

 private:
  std::shared_ptr<Module> conv1, pool, conv2, norm, fc1, relu, fc2, log_softmax;
};

class LeNet5 : public Classifier {
 public:
  explicit LeNet5(const ModelConfig& c) : Classifier("LeNet5", c) {
    check_config("lenet5", c);
    const int64_t s = ((c.image_size - 4) / 2 - 4) / 2;
    MANTISSA_CHECK(c.image_size >= 16 && s > 0,
                   config_str("lenet5", c) + " is too small for two 5x5 convolutions and pools",
                   "use --image-size 16 or more (LeNet-5 is made for 32)");
    InitStreams init(c.seed);
    conv1 = register_module("conv1",
                            std::make_shared<Conv2d>(c.in_channels, 6, 5, init, 1, 0, 1, 1, false));
    conv2 = register_module("conv2", std::make_shared<Conv2d>(6, 16, 5, init, 1, 0, 1, 1, false));
    auto dense = [&](const char* name, int64_t in, int64_t out) {
      auto l = std::make_shared<Linear>(in, out, init);
      register_module(name, l);
      init::normal_(*l->named_parameters()[0].tensor, 0.0, 0.02, init.seed(), init.next());
      l->named_parameters()[1].tensor->fill(0.0);
      return l;
    };
    fc1 = dense("fc1", 16 * s * s, 120);
    fc2 = dense("fc2", 120, 84);
    fc3 = dense("fc3", 84, c.num_classes);
    relu = register_module("relu", std::make_shared<ReLU>());
    max_pool2d = register_module("max_pool2d", std::make_shared<MaxPool2d>(2, 2));
    flatten = register_module("flatten", std::make_shared<Flatten>());
  }
  Tensor classify(const Tensor& x) override {
    Tensor y = (*max_pool2d)((*relu)((*conv1)(x)));
    y = (*max_pool2d)((*relu)((*conv2)(y)));
    y = (*flatten)(y);
    y = (*relu)((*fc1)(y));
    y = (*relu)((*fc2)(y));
    return (*fc3)(y);
  }

 private:
  std::shared_ptr<Module> conv1, conv2, fc1, fc2, fc3, relu, max_pool2d, flatten;
};

// torchvision's blocks. Convolutions without bias (batch norm follows each).
std::shared_ptr<Conv2d> conv(int64_t in, int64_t out, int64_t k, int64_t stride,
                             InitStreams& init) {
  auto c = std::make_shared<Conv2d>(in, out, k, init, stride, k / 2, 1, 1, false);
  init::kaiming_normal_fan_out_(*c->named_parameters()[0].tensor, init.seed(), init.next());
  return c;
}

class BasicBlock : public Module {
 public:
  static constexpr int64_t kExpansion = 1;
  BasicBlock(int64_t in, int64_t planes, int64_t stride, InitStreams& init) : Module("BasicBlock") {
    conv1 = register_module("conv1", conv(in, planes, 3, stride, init));
    bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
    relu = register_module("relu", std::make_shared<ReLU>());
    conv2 = register_module("conv2", conv(planes, planes, 3, 1, init));
    bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
    if (stride != 1 || in != planes) {
      auto d = std::make_shared<Sequential>();
      d->add(conv(in, planes, 1, stride, init)).add(std::make_shared<BatchNorm2d>(planes));
      downsample = register_module("downsample", d);
    }
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = (*relu)((*bn1)((*conv1)(x)));
    y = (*bn2)((*conv2)(y));
    return (*relu)(ops::add(y, downsample ? (*downsample)(x) : x));
  }

 private:
  std::shared_ptr<Module> conv1, bn1, relu, conv2, bn2, downsample;
};

class Bottleneck : public Module {
 public:
  static constexpr int64_t kExpansion = 4;
  Bottleneck(int64_t in, int64_t planes, int64_t stride, InitStreams& init) : Module("Bottleneck") {
    conv1 = register_module("conv1", conv(in, planes, 1, 1, init));
    bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(planes));
    conv2 = register_module("conv2", conv(planes, planes, 3, stride, init));
    bn2 = register_module("bn2", std::make_shared<BatchNorm2d>(planes));
    conv3 = register_module("conv3", conv(planes, planes * kExpansion, 1, 1, init));
    bn3 = register_module("bn3", std::make_shared<BatchNorm2d>(planes * kExpansion));
    relu = register_module("relu", std::make_shared<ReLU>());
    if (stride != 1 || in != planes * kExpansion) {
      auto d = std::make_shared<Sequential>();
      d->add(conv(in, planes * kExpansion, 1, stride, init))
          .add(std::make_shared<BatchNorm2d>(planes * kExpansion));
      downsample = register_module("downsample", d);
    }
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = (*relu)((*bn1)((*conv1)(x)));
    y = (*relu)((*bn2)((*conv2)(y)));
    y = (*bn3)((*conv3)(y));
    return (*relu)(ops::add(y, downsample ? (*downsample)(x) : x));
  }

 private:
  std::shared_ptr<Module> conv1, bn1, conv2, bn2, conv3, bn3, relu, downsample;
};

class ResNet : public Classifier {
 public:
  ResNet(int depth, const ModelConfig& c) : Classifier("ResNet", c) {
    const std::string name = "resnet" + std::to_string(depth);
    check_config(name.c_str(), c);
    const int64_t min_size = c.imagenet_stem ? 32 : 8;
    MANTISSA_CHECK(c.image_size >= min_size,
                   config_str(name.c_str(), c) + " is too small for its four stages",
                   "use --image-size " + std::to_string(min_size) + " or more");
    std::vector<int> blocks;
    bool bottleneck = false;
    switch (depth) {
      case 18:
        blocks = {2, 2, 2, 2};
        break;
      case 34:
        blocks = {3, 4, 6, 3};
        break;
      case 50:
        blocks = {3, 4, 6, 3};
        bottleneck = true;
        break;
      case 101:
        blocks = {3, 4, 23, 3};
        bottleneck = true;
        break;
      default:
        throw Error("no ResNet of depth " + std::to_string(depth), "use 18, 34, 50 or 101");
    }
    InitStreams init(c.seed);
    if (c.imagenet_stem) {
      conv1 = register_module(
          "conv1", std::make_shared<Conv2d>(c.in_channels, 64, 7, init, 2, 3, 1, 1, false));
      init::kaiming_normal_fan_out_(*conv1->named_parameters()[0].tensor, init.seed(), init.next());
    } else {
      conv1 = register_module("conv1", conv(c.in_channels, 64, 3, 1, init));
    }
    bn1 = register_module("bn1", std::make_shared<BatchNorm2d>(64));
    relu = register_module("relu", std::make_shared<ReLU>());
    if (c.imagenet_stem) maxpool = register_module("maxpool", std::make_shared<MaxPool2d>(3, 2, 1));
    const int64_t expansion = bottleneck ? Bottleneck::kExpansion : BasicBlock::kExpansion;
    int64_t in = 64;
    for (int stage = 0; stage < 4; ++stage) {
      const int64_t planes = int64_t{64} << stage;
      auto layer = std::make_shared<Sequential>();
      for (int b = 0; b < blocks[static_cast<size_t>(stage)]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
        if (bottleneck)
          layer->add(std::make_shared<Bottleneck>(in, planes, stride, init));
        else
          layer->add(std::make_shared<BasicBlock>(in, planes, stride, init));
        in = planes * expansion;
      }
      layers[stage] = register_module("layer" + std::to_string(stage + 1), layer);
    }
    avgpool = register_module("avgpool", std::make_shared<AdaptiveAvgPool2d>(1, 1));
    fc = register_module("fc", std::make_shared<Linear>(512 * expansion, c.num_classes, init));
  }
  Tensor classify(const Tensor& x) override {
    Tensor y = (*relu)((*bn1)((*conv1)(x)));
    if (maxpool) y = (*maxpool)(y);
    for (auto& l : layers) y = (*l)(y);
    y = ops::flatten((*avgpool)(y), 1);
    return (*fc)(y);
  }

  std::vector<Module*> recompute_blocks() override {
    std::vector<Module*> blocks;
    for (auto& l : layers)
      for (auto& [name, block] : l->children()) blocks.push_back(block.get());
    return blocks;
  }

 private:
  std::shared_ptr<Module> conv1, bn1, relu, maxpool, layers[4], avgpool, fc;
};

}  // namespace

std::shared_ptr<Classifier> tutorial_cnn(const ModelConfig& c) {
  return std::make_shared<TutorialCnn>(c);
}
std::shared_ptr<Classifier> lenet5(const ModelConfig& c) { return std::make_shared<LeNet5>(c); }
std::shared_ptr<Classifier> resnet(int depth, const ModelConfig& c) {
  return std::make_shared<ResNet>(depth, c);
}

std::vector<std::string> model_names() {
  return {"tutorial-cnn", "lenet5", "resnet18", "resnet34", "resnet50", "resnet101"};
}

std::shared_ptr<Classifier> make_model(const std::string& name, const ModelConfig& c) {
  std::shared_ptr<Classifier> m;
  if (name == "tutorial-cnn")
    m = tutorial_cnn(c);
  else if (name == "lenet5")
    m = lenet5(c);
  else if (name == "resnet18")
    m = resnet(18, c);
  else if (name == "resnet34")
    m = resnet(34, c);
  else if (name == "resnet50")
    m = resnet(50, c);
  else if (name == "resnet101")
    m = resnet(101, c);
  else {
    std::string names;
    for (auto& n : model_names()) names += (names.empty() ? "" : ", ") + n;
    throw Error("unknown model '" + excerpt(name) + "'", "choose one of: " + names);
  }
  m->name_storage();
  return m;
}

int64_t default_image_size(const std::string& model) { return model == "tutorial-cnn" ? 128 : 32; }

int64_t default_in_channels(const std::string& model) {
  return model == "tutorial-cnn" || model == "lenet5" ? 1 : 3;
}

}  // namespace mantissa::nn
