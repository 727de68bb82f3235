// Training from C++: the tutorial CNN on Fashion-MNIST, as `mantissa train` does, in a few lines;
// then the same model driven by hand (modules, optimizer, loader) for one more step.
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

    // The same pieces by hand: one more step with the model and optimizer of the trainer.
    nn::Classifier& model = trainer.model();
    data::Dataset test = data::load_dataset(config.dataset, config.data_dir, false);
    data::LoaderConfig lc;
    lc.transform.image_size = 128;
    lc.shuffle = false;
    data::Loader loader(test.head(12), lc);
    data::Batch batch = loader.make_batch(0, 0);
    Tensor loss = model.loss(model(batch.images), batch.labels);
    autograd::backward(loss);
    trainer.optimizer().step();
    trainer.optimizer().zero_grad();
    std::cout << "one more step by hand: loss " << loss.item() << "\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
