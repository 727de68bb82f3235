// Classification losses over (N, C) inputs of any float storage dtype, computing in FP32 with
// FP64 sums; the loss is a one-element FP32 tensor. Raw kernels: they record nothing
// (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>

#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

// Mean negative log-likelihood of log-probabilities (N, C) at integer targets (N), skipping
// targets equal to ignore_index. A one-element f32 tensor.
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index = -100);
Tensor nll_loss_backward(const Tensor& grad_loss, const Tensor& log_probs, const Tensor& target,
                         int64_t ignore_index, DType out);
// Cross entropy of logits (N, C) with label smoothing (PyTorch's definition).
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     int64_t ignore_index = -100);
Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              double label_smoothing, int64_t ignore_index, DType out);

}  // namespace mantissa::kernels
