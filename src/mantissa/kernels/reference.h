// Scalar reference implementations of every op's forward pass, in FP64 on plain arrays, written
// for clarity (direct loops, textbook formulas) and sharing no code with the fast kernels. The
// tests compare the fast kernels with them for every dtype combination, and take reference
// gradients by central differences of these FP64 functions.
#pragma once

#include <cstdint>
#include <vector>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/nn.h"

namespace mantissa::reference {

// A row-major FP64 array.
struct Array {
  Shape shape;
  std::vector<double> v;
  int64_t numel() const { return static_cast<int64_t>(v.size()); }
};
Array from_tensor(const Tensor& t);  // exact decode of any dtype
Array zeros(const Shape& shape);

Array linear(const Array& x, const Array& w, const Array* b);
Array matmul(const Array& a, const Array& b);
Array conv2d(const Array& x, const Array& w, const Array* b, const kernels::Conv2dParams& p);
Array max_pool2d(const Array& x, const kernels::Pool2dParams& p);
Array avg_pool2d(const Array& x, const kernels::Pool2dParams& p);
Array adaptive_avg_pool2d(const Array& x, int64_t oh, int64_t ow);
enum class Unary { kRelu, kGelu, kSigmoid, kTanh };
Array unary(Unary op, const Array& x);
enum class Binary { kAdd, kSub, kMul, kDiv };
Array binary(Binary op, const Array& a, const Array& b);  // broadcasting
Array scalar(Binary op, const Array& a, double s);
// Training: batch statistics (biased variance); evaluation: the given running statistics.
Array batch_norm(const Array& x, const Array* w, const Array* b, const Array* running_mean,
                 const Array* running_var, bool training, double eps);
Array group_norm(const Array& x, int64_t groups, const Array* w, const Array* b, double eps);
Array layer_norm(const Array& x, int64_t normalized_dims, const Array* w, const Array* b,
                 double eps);
Array dropout(const Array& x, double p, uint64_t seed, uint64_t stream);
Array transpose(const Array& x, int64_t d0, int64_t d1);
Array cat(const std::vector<Array>& xs, int64_t dim);
Array sum(const Array& x, const std::vector<int64_t>& dims, bool keepdim);
Array softmax(const Array& x, int64_t dim, bool log);
Array nll_loss(const Array& log_probs, const Array& target, int64_t ignore_index);
Array cross_entropy(const Array& logits, const Array& target, double smoothing,
                    int64_t ignore_index);

}  // namespace mantissa::reference
