// Neural-network kernels (convolution, pooling, normalization, losses, dropout, linear) over
// NCHW tensors of any float storage dtype, computing in FP32. Layouts follow PyTorch: activations
// (N, C, H, W), convolution weights (O, C/groups, KH, KW), linear weights (out, in).
// Raw kernels: they record nothing (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>
#include <tuple>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/gemm.h"

namespace mantissa::kernels {

// ---- Linear algebra
// ------------------------------------------------------------------------------- y = x w^T + b, x
// (*, in), w (out, in), b (out) or undefined.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, DType out,
              Partials p = Partials::kF32);
// The weight gradient of linear, dw = g^T x (g: (rows, out), x: (rows, in), float dtypes), given
// to `consume` in parts instead of stored (AutogradMeta::consume_grad_parts): blocks of a few
// outputs by a few thousand inputs, each computed into a buffer that stays in cache and handed
// over row by row (flat offsets o * in + j) in dtype `out`. Every element is matmul's with FP32
// partials and output `out`, bit for bit (an FMA chain over the rows in order, rounded once). For
// a small batch through a wide layer, where the update's pass over the parameter and its state
// costs more than the products.
void linear_weight_grad_parts(const Tensor& g, const Tensor& x, DType out,
                              const GradPartConsumer& consume);
// Whether linear's backward gives its weight gradient in parts at this many rows (a batch small
// enough that computing dw costs less than storing and re-reading it).
bool linear_weight_grad_parts_fit(int64_t rows);

// a (..., M, K) @ b (..., K, N) with equal batch dimensions, or b 2-D.
Tensor matmul(const Tensor& a, const Tensor& b, DType out, Partials p = Partials::kF32,
              MemoryCategory cat = MemoryCategory::activations);

// ---- Convolution
// ------------------------------------------------------------------------------------
struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
};
// Checks the shapes (throws mantissa::Error naming the mismatch) and returns the output's.
Shape conv2d_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p);
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p, DType out,
              Partials partials = Partials::kF32);
Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                             const Conv2dParams& p, DType out, Partials partials = Partials::kF32);
Tensor conv2d_backward_weight(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                              const Conv2dParams& p, DType out, Partials partials = Partials::kF32);

// ---- Pooling
// -------------------------------------------------------------------------------------------
struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;  // average pooling
};
Shape pool2d_output_shape(const Shape& x, const Pool2dParams& p);
// Returns y and the flat (h * W + w) index of each maximum in its input plane (i32).
std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p, DType out);
Tensor max_pool2d_backward(const Tensor& dy, const Tensor& indices, const Shape& x_shape,
                           DType out);
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p, DType out);
Tensor avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, const Pool2dParams& p,
                           DType out);
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w, DType out);
Tensor adaptive_avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, DType out);

// ---- Normalization
// --------------------------------------------------------------------------------------- Each
// returns y, the mean and 1/sqrt(var + eps) used (FP32, one per normalized group). batch_norm in
// training mode normalizes with the batch statistics (biased variance) and updates running_mean/var
// (FP32, unbiased variance, PyTorch's momentum convention) when given; in evaluation mode it uses
// the running statistics.
std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& weight,
                                              const Tensor& bias, Tensor running_mean,
                                              Tensor running_var, bool training, double momentum,
                                              double eps, DType out);
// Returns dx, dweight, dbias (dweight/dbias undefined when weight is).
std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                       const Tensor& weight, const Tensor& mean,
                                                       const Tensor& rstd, bool training,
                                                       DType dx_type);
std::tuple<Tensor, Tensor, Tensor> group_norm(const Tensor& x, int64_t groups, const Tensor& weight,
                                              const Tensor& bias, double eps, DType out);
std::tuple<Tensor, Tensor, Tensor> group_norm_backward(const Tensor& dy, const Tensor& x,
                                                       int64_t groups, const Tensor& weight,
                                                       const Tensor& mean, const Tensor& rstd,
                                                       DType dx_type);
// Normalizes over the last `normalized_dims` dimensions.
std::tuple<Tensor, Tensor, Tensor> layer_norm(const Tensor& x, int64_t normalized_dims,
                                              const Tensor& weight, const Tensor& bias, double eps,
                                              DType out);
std::tuple<Tensor, Tensor, Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x,
                                                       int64_t normalized_dims,
                                                       const Tensor& weight, const Tensor& mean,
                                                       const Tensor& rstd, DType dx_type);

// ---- Losses
// ------------------------------------------------------------------------------------------------
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

// ---- Dropout
// ---------------------------------------------------------------------------------------------
// Keeps each element with probability 1 - p (scaled by 1 / (1 - p)). The mask of element i is a
// Philox draw of (seed, stream, i): backward recomputes it instead of storing it.
Tensor dropout(const Tensor& x, double p, uint64_t seed, uint64_t stream, DType out,
               MemoryCategory cat = MemoryCategory::activations);

}  // namespace mantissa::kernels
