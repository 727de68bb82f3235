// A program built outside Mantissa's tree against the installed library: LeNet-5 trained for a few
// steps in mixed precision on the synthetic dataset (no files needed), then evaluated.
#include <iostream>

#include "mantissa/mantissa.h"

using namespace mantissa;

int main() {
  try {
    train::TrainConfig config;
    config.model = "lenet5";
    config.dataset = "synthetic";
    config.synthetic_size = 512;
    config.precision = "16-mixed";  // FP16 compute by automatic casting, dynamic loss scaling
    config.max_steps = 20;
    train::Trainer trainer(config, {&std::cout, nullptr});
    const train::TrainResult result = trainer.run();
    std::cout << "downstream: " << result.step_losses.size() << " steps, loss "
              << result.step_losses.front() << " -> " << result.step_losses.back() << "\n";
    return 0;
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
