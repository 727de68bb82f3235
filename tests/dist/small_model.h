// What the reducer tests share: a small classifier of linear layers and a fixed global batch, of
// which each rank (or each accumulation micro-batch) takes a slice of rows.
#pragma once

#include <cmath>
#include <memory>
#include <vector>

#include "mantissa/nn/layers.h"
#include "mantissa/ops/ops.h"

namespace mantissa::testing {

constexpr int64_t kInputs = 8, kHidden = 16, kClasses = 4;

// Linear(8, 16), ReLU, Linear(16, 16), ReLU, Linear(16, 4), initialised from `seed`.
inline std::shared_ptr<nn::Sequential> small_model(uint64_t seed) {
  nn::InitStreams init(seed);
  auto m = std::make_shared<nn::Sequential>();
  m->add(std::make_shared<nn::Linear>(kInputs, kHidden, init));
  m->add(std::make_shared<nn::ReLU>());
  m->add(std::make_shared<nn::Linear>(kHidden, kHidden, init));
  m->add(std::make_shared<nn::ReLU>());
  m->add(std::make_shared<nn::Linear>(kHidden, kClasses, init));
  return m;
}

// The mean cross-entropy of `m` on rows [first, first + rows) of a fixed global batch (inputs
// (rows, 8) in `dtype`, the model's, labels (rows,)).
inline Tensor slice_loss(nn::Module& m, int64_t first, int64_t rows, DType dtype = DType::f32) {
  std::vector<float> x(static_cast<size_t>(rows * kInputs)), y(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first + r;
    for (int64_t c = 0; c < kInputs; ++c)
      x[static_cast<size_t>(r * kInputs + c)] =
          static_cast<float>(std::sin(0.37 * static_cast<double>(row * kInputs + c + 1)));
    y[static_cast<size_t>(r)] = static_cast<float>((row * 7) % kClasses);
  }
  const Tensor inputs = Tensor::from_floats(x, {rows, kInputs}, dtype);
  const Tensor labels = Tensor::from_floats(y, {rows}).to(DType::i64);
  return ops::cross_entropy(m(inputs), labels);
}

// The gradients of a model's parameters, as FP32 vectors in registration order.
inline std::vector<std::vector<float>> gradients(nn::Module& m) {
  std::vector<std::vector<float>> g;
  for (const auto& p : m.named_parameters())
    g.push_back(p.tensor->grad().defined() ? p.tensor->grad().to_float_vector()
                                           : std::vector<float>{});
  return g;
}

}  // namespace mantissa::testing
