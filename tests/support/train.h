// A small training run on the synthetic dataset (no files needed): the configuration the trainer
// tests start from.
#pragma once

#include <cstdint>
#include <string>

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

}  // namespace mantissa::testing
