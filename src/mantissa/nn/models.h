// The models by name: the PopTorch half-precision tutorial's CNN, LeNet-5 (the MindSpore seed) and
// torchvision's ResNets, with PyTorch's parameter names and default initialisations.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mantissa/nn/layers.h"

namespace mantissa::nn {

struct ModelConfig {
  int64_t in_channels = 1;
  int64_t image_size = 128;  // square inputs
  int64_t num_classes = 10;
  uint64_t seed = 0;
  bool imagenet_stem = false;  // ResNets: 7x7/2 convolution and max pool instead of the CIFAR 3x3/1
};

// A classifier: images (N, C, H, W) in, one row of scores per image out, and its training loss.
class Classifier : public Module {
 public:
  Classifier(std::string type, ModelConfig config) : Module(std::move(type)), config_(config) {}
  const ModelConfig& config() const { return config_; }
  // The loss of a batch of outputs against i64 class labels (N): NLL for models that end in a
  // log-softmax, cross entropy on logits for the others. A one-element f32 tensor.
  virtual Tensor loss(const Tensor& output, const Tensor& labels) const;
  // Whether forward() returns log-probabilities (true) or logits.
  virtual bool outputs_log_probs() const { return false; }

  // 8-bit input (the IPU guide's ModelWithNormalization): u8 images are normalized, (x / 255 -
  // mean) / std, and cast to `dtype` by the model's first op. Float inputs pass unchanged.
  void set_input_normalization(std::vector<float> mean, std::vector<float> std, DType dtype);
  // The model: the input op, then classify().
  Tensor forward(const Tensor& x) final;
  // Where activation recomputation checkpoints go (Module::set_recompute): each ResNet block.
  // Empty for models without blocks.
  virtual std::vector<Module*> recompute_blocks() { return {}; }

 protected:
  // The model proper, on float images.
  virtual Tensor classify(const Tensor& x) = 0;

 private:
  ModelConfig config_;
  struct InputNormalization {
    std::vector<float> mean, std;
    DType dtype = DType::f32;
  };
  std::optional<InputNormalization> input_normalization_;
};

// The tutorial's model: conv1 1->5 k3, ReLU, max-pool 2, conv2 5->12 k5, ReLU, GroupNorm(3, 12),
// flatten, fc1 -> 100, ReLU, fc2 100 -> 10, log-softmax over the classes (dim 1; the seed's dim=0
// is a bug that normalizes over the batch), NLL loss. fc1 has 12 * s * s inputs, s = (size-2)/2-4:
// 41772 at 128x128.
std::shared_ptr<Classifier> tutorial_cnn(const ModelConfig& c);
// LeNet-5: conv1 C->6 k5, ReLU, max-pool 2, conv2 6->16 k5, ReLU, max-pool 2, flatten, fc1 ->120,
// fc2 120->84, fc3 84->classes; convolutions without bias and dense weights N(0, 0.02) as in the
// MindSpore seed.
std::shared_ptr<Classifier> lenet5(const ModelConfig& c);
// torchvision's ResNets (v1.5: stride in the 3x3 convolution of bottlenecks), depth 18, 34, 50 or
// 101. The CIFAR stem (3x3/1 convolution, no max pool) unless imagenet_stem.
std::shared_ptr<Classifier> resnet(int depth, const ModelConfig& c);

// By name: "tutorial-cnn", "lenet5", "resnet18", "resnet34", "resnet50", "resnet101".
std::shared_ptr<Classifier> make_model(const std::string& name, const ModelConfig& c);
std::vector<std::string> model_names();
// The image size a model is made for when the user gives none (128, 32, 32...).
int64_t default_image_size(const std::string& model);
// The channels of the images a model is made for when no dataset fixes them (the synthetic
// dataset): 1 for the grayscale models (tutorial-cnn, lenet5), 3 for the ResNets.
int64_t default_in_channels(const std::string& model);

}  // namespace mantissa::nn
