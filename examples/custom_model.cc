// Your own model and data through Mantissa's trainer: a small residual MLP on an in-memory
// dataset, trained in 16-mixed (FP16 compute by automatic casting, FP32 weights, dynamic loss
// scaling), its memory by category, a checkpoint, and a resumed run that continues it exactly.
// docs/cpp_guide.md walks through this file.
//
//   build/example_custom_model [DIR]     (DIR: where the checkpoint goes; default: the current one)
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "mantissa/mantissa.h"

using namespace mantissa;

// ---- The data: four interleaved spirals in 2-D, lifted to 16 features ----------------------

// A uniform number in [0, 1) from the seed and a position (Mantissa's Philox streams), so the
// data depend on nothing but the seed.
float uniform(uint64_t seed, uint64_t stream, int64_t i) {
  return static_cast<float>(philox_bits(seed, stream, static_cast<uint64_t>(i)) >> 8) * 0x1p-24f;
}

// Each example is (F) = (16) floats; its label is the spiral it lies on. The inputs are computed
// once and held in memory as tensors; TensorDataset checks them and hands examples to the loader.
std::shared_ptr<data::TensorDataset> spirals(int64_t n, uint64_t seed, const std::string& name) {
  constexpr int64_t kFeatures = 16, kClasses = 4;
  Tensor x = Tensor::empty({n, kFeatures}, DType::f32);  // (N, F)
  Tensor y = Tensor::empty({n}, DType::i64);             // (N)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = i % kClasses;
    // A position along the spiral and a little noise, both from the seed and the index.
    const float t = uniform(seed, 1, i);
    const float noise = 0.05f * (uniform(seed, 2, i) - 0.5f);
    const float angle = 3.0f * t + 1.5707963f * static_cast<float>(c);
    const float r = t + noise;
    const float px = r * std::cos(angle), py = r * std::sin(angle);
    float* row = x.data<float>() + i * kFeatures;
    for (int64_t k = 0; k < kFeatures / 2; ++k) {  // the point at several frequencies
      const float f = static_cast<float>(k + 1);
      row[2 * k] = std::sin(f * px);
      row[2 * k + 1] = std::cos(f * py);
    }
    y.data<int64_t>()[i] = c;
  }
  return std::make_shared<data::TensorDataset>(x, y, kClasses, name);
}

// ---- The model: input layer, two residual blocks, output layer ------------------------------
//
// A Classifier is a Module with a forward pass (classify) and a loss. Layers registered with
// register_module get PyTorch-style names ("block0.fc1.weight"): precision overrides
// (TrainConfig::keep_fp32 = {"block1"}), checkpoints and the memory report use them.
class ResidualBlock : public nn::Module {
 public:
  ResidualBlock(int64_t width, nn::InitStreams& init) : Module("ResidualBlock") {
    norm = register_module("norm", std::make_shared<nn::LayerNorm>(Shape{width}));
    fc1 = register_module("fc1", std::make_shared<nn::Linear>(width, 2 * width, init));
    fc2 = register_module("fc2", std::make_shared<nn::Linear>(2 * width, width, init));
  }
  Tensor forward(const Tensor& x) override {  // (N, W) -> (N, W)
    return ops::add(x, (*fc2)(ops::relu((*fc1)((*norm)(x)))));
  }

 private:
  std::shared_ptr<nn::Module> norm, fc1, fc2;
};

class ResidualMlp : public nn::Classifier {
 public:
  ResidualMlp(int64_t features, int64_t width, int64_t classes, uint64_t seed)
      : Classifier("ResidualMlp", {.num_classes = classes, .seed = seed}) {
    nn::InitStreams init(seed);
    input = register_module("input", std::make_shared<nn::Linear>(features, width, init));
    block0 = register_module("block0", std::make_shared<ResidualBlock>(width, init));
    block1 = register_module("block1", std::make_shared<ResidualBlock>(width, init));
    output = register_module("output", std::make_shared<nn::Linear>(width, classes, init));
  }
  // Activation recomputation (TrainConfig::recompute) checkpoints at each block.
  std::vector<nn::Module*> recompute_blocks() override { return {block0.get(), block1.get()}; }

 protected:
  // (N, F) -> (N, classes) logits; the default loss is cross entropy on logits.
  Tensor classify(const Tensor& x) override {
    Tensor h = ops::relu((*input)(x));
    h = (*block1)((*block0)(h));
    return (*output)(h);
  }

 private:
  std::shared_ptr<nn::Module> input, block0, block1, output;
};

int main(int argc, char** argv) {
  try {
    const std::string dir = argc > 1 ? argv[1] : ".";
    auto train_data = spirals(4096, 1, "spirals (train)");
    auto test_data = spirals(1024, 2, "spirals (test)");

    // The run's settings: every TrainConfig field that is not about the built-in models and
    // datasets applies, precision modes and levers included.
    train::TrainConfig config;
    config.precision = "16-mixed";
    config.batch_size = 64;
    config.lr = 3e-3;
    config.epochs = 4;
    config.max_steps = 100;  // stop after 100 of the 4 epochs' 256 steps...
    config.save = dir + "/custom_model.safetensors";
    config.progress = false;

    auto model = std::make_shared<ResidualMlp>(16, 32, 4, config.seed);
    train::Trainer trainer(config, model, train_data, test_data, {&std::cout, &std::cerr});
    const train::TrainResult first = trainer.run();
    std::printf("trained %lld steps: loss %.4f -> %.4f, test accuracy %.2f%%; saved %s\n",
                static_cast<long long>(first.steps), first.step_losses.front(),
                first.step_losses.back(), 100.0 * first.test_accuracy.value_or(0),
                config.save.c_str());

    // What the step held at its peak, by category (parameters, gradients, optimizer state,
    // master weights, activations, ...).
    std::printf("peak memory %s, by category:\n", format_bytes(first.memory.peak_total).c_str());
    for (MemoryCategory c : kAllMemoryCategories) {
      const size_t bytes = first.memory.at_peak_total[static_cast<size_t>(c)];
      if (bytes > 0)
        std::printf("  %-16s %10s\n", std::string(memory_category_name(c)).c_str(),
                    format_bytes(bytes).c_str());
    }

    // ...then resume from the checkpoint to step 150: the same run as 150 steps at once.
    train::TrainConfig more = config;
    more.resume = config.save;
    more.max_steps = 150;
    train::Trainer resumed(more, std::make_shared<ResidualMlp>(16, 32, 4, config.seed), train_data,
                           test_data, {&std::cout, &std::cerr});
    const train::TrainResult second = resumed.run();
    std::printf("resumed at step %lld, now at step %lld: loss %.4f, test accuracy %.2f%%\n",
                static_cast<long long>(first.steps), static_cast<long long>(second.steps),
                second.step_losses.back(), 100.0 * second.test_accuracy.value_or(0));

    // The uninterrupted run of 150 steps, for comparison: the same losses, bit for bit.
    train::TrainConfig straight = more;
    straight.resume.clear();
    straight.save.clear();
    train::Trainer whole(straight, std::make_shared<ResidualMlp>(16, 32, 4, config.seed),
                         train_data, test_data);
    const bool same = whole.run().step_losses == second.step_losses;
    std::printf("the resumed run %s the uninterrupted one\n", same ? "equals" : "DIFFERS FROM");
    return same ? 0 : 1;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
