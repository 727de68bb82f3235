// Small training runs for the trainer tests: a built-in model on the synthetic dataset (no files
// needed), and a user-defined model on an in-memory dataset.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mantissa/core/philox.h"
#include "mantissa/data/source.h"
#include "mantissa/nn/layers.h"
#include "mantissa/nn/models.h"
#include "mantissa/train/trainer.h"

namespace mantissa::testing {

inline train::TrainConfig small_run(const std::string& model, int64_t synthetic_size) {
  train::TrainConfig c;
  c.model = model;
  c.dataset = "synthetic";
  c.synthetic_size = synthetic_size;
  c.batch_size = 16;
  c.image_size = model == "tutorial-cnn" ? 24 : 16;
  c.progress = false;
  c.evaluate = false;
  return c;
}

// The tutorial CNN at its own 128x128, batch 12, one thread, 32-true: the memory tests'
// configuration (mantissa memory --model tutorial-cnn --batch-size 12 --threads 1).
inline train::TrainConfig tutorial_cnn_batch_12() {
  train::TrainConfig c = small_run("tutorial-cnn", 64);
  c.image_size = 0;  // the model's own 128x128
  c.batch_size = 12;
  c.threads = 1;
  c.precision = "32-true";
  return c;
}

// A user-defined classifier: features -> width, a residual block (layer norm, two linear layers),
// -> classes. Its blocks can be recomputed.
class UserMlp : public nn::Classifier {
 public:
  UserMlp(int64_t features, int64_t width, int64_t classes, uint64_t seed,
          std::string type = "UserMlp")
      : Classifier(std::move(type), {.num_classes = classes, .seed = seed}) {
    nn::InitStreams init(seed);
    input = register_module("input", std::make_shared<nn::Linear>(features, width, init));
    block = register_module("block", std::make_shared<nn::Sequential>());
    block->add(std::make_shared<nn::LayerNorm>(Shape{width}));
    block->add(std::make_shared<nn::Linear>(width, width, init));
    block->add(std::make_shared<nn::ReLU>());
    block->add(std::make_shared<nn::Linear>(width, width, init));
    output = register_module("output", std::make_shared<nn::Linear>(width, classes, init));
  }
  std::vector<nn::Module*> recompute_blocks() override { return {block.get()}; }

 protected:
  Tensor classify(const Tensor& x) override {  // (N, F) -> (N, classes)
    const Tensor h = ops::relu((*input)(x));
    return (*output)(ops::add(h, (*block)(h)));
  }

 private:
  std::shared_ptr<nn::Module> input, output;
  std::shared_ptr<nn::Sequential> block;
};

// n examples of `classes` Gaussian blobs in `features` dimensions (class i % classes), from the
// seed: a dataset a small model learns in a few dozen steps.
inline std::shared_ptr<data::TensorDataset> blobs(int64_t n, int64_t features, int64_t classes,
                                                  uint64_t seed) {
  auto uniform = [](uint64_t s, uint64_t stream, uint64_t i) {
    return (static_cast<float>(philox_bits(s, stream, i) >> 8) + 0.5f) * 0x1p-24f;
  };
  Tensor x = Tensor::empty({n, features}, DType::f32);
  Tensor y = Tensor::empty({n}, DType::i64);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = i % classes;
    for (int64_t k = 0; k < features; ++k) {
      // The class's centre (a fixed function of class and feature) plus noise of sd 0.5.
      const float centre = 2.0f * std::sin(static_cast<float>(c * features + k));
      const uint64_t e = static_cast<uint64_t>(i * features + k);
      const float noise = std::sqrt(-2.0f * std::log(uniform(seed, 1, e))) *
                          std::cos(6.2831853f * uniform(seed, 2, e));
      x.data<float>()[i * features + k] = centre + 0.5f * noise;
    }
    y.data<int64_t>()[i] = c;
  }
  return std::make_shared<data::TensorDataset>(x, y, classes, "blobs");
}

}  // namespace mantissa::testing
