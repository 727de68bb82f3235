// Training from C++: the tutorial CNN on Fashion-MNIST, as `mantissa train` does, in a few lines;
// then the same model driven by hand (modules, optimizer, loader) for one more step, in mixed
// precision.
//
//   build/example_train_fashion_mnist [DATASET]     (default fashion-mnist; "synthetic" needs no
//   files)
#include <iostream>
#include <string>

#include "mantissa/mantissa.h"

using namespace mantissa;

int main(int argc, char** argv) {
  try {
    train::TrainConfig config;  // tutorial-cnn at 128x128, AdamW lr 1e-3, batch 12
    if (argc > 1) config.dataset = argv[1];
    config.max_steps = 100;
    config.test_limit = 1000;
    train::Trainer trainer(config, {&std::cout, &std::cerr});
    const train::TrainResult result = trainer.run();
    std::cout << "first loss " << result.step_losses.front() << ", last loss "
              << result.step_losses.back() << "\n";

    // The same pieces by hand: one more step with the model and optimizer of the trainer, in
    // mixed precision (what config.precision = "16-mixed" does in the trainer; README's example).
    nn::Classifier& model = trainer.model();
    optim::Optimizer& optimizer = trainer.optimizer();
    data::Dataset test = data::load_dataset(config.dataset, config.data_dir, false);
    data::LoaderConfig lc;
    lc.transform.image_size = 128;
    lc.shuffle = false;
    data::Loader loader(test.head(12), lc);
    data::Batch batch = loader.make_batch(0, 0);
    const Tensor& images = batch.images;
    const Tensor& labels = batch.labels;
    ops::AutocastPolicy policy;       // the default op lists, editable
    amp::LossScaler scaler;           // GradScaler's defaults: 2^16, x2 / 2000, x0.5
    amp::ScaledStep scaled(&scaler);  // this step's scale S
    Tensor loss;
    {
      ops::AutocastScope autocast(DType::f16, policy);  // conv, linear in f16; norms, losses f32
      loss = model.loss(model(images), labels);
    }
    autograd::backward(scaled.scale_loss(loss));     // backward of S * loss, in FP32
    scaled.step(optimizer, {.max_grad_norm = 1.0});  // unscale, check, clip, update: one pass;
    optimizer.zero_grad();                           // skips and backs off on inf/NaN
    std::cout << "one more step by hand: loss " << loss.item() << "\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
