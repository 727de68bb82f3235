// 2-D convolution over NCHW tensors of any float storage dtype, computing in FP32 (or the FP16
// partials asked for): activations (N, C, H, W), weights (O, C/groups, KH, KW), as in PyTorch.
// Each direction runs one of several paths chosen by geometry, dtype and partials; every path
// accumulates in FP32 (or the FP16 partials), adds the bias in FP32 and rounds the output once.
// conv_paths.h holds the table of which path runs when. Raw kernels: they record nothing
// (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/gemm.h"

namespace mantissa::kernels {

struct Conv2dParams {
  int64_t stride_h = 1, stride_w = 1;
  int64_t pad_h = 0, pad_w = 0;
  int64_t dilation_h = 1, dilation_w = 1;
  int64_t groups = 1;
};
// Checks the shapes (throws mantissa::Error naming the mismatch) and returns the output's.
Shape conv2d_output_shape(const Shape& x, const Shape& w, const Conv2dParams& p);
// y (N, O, Ho, Wo) = x * w + b (b: (O) or undefined), in dtype `out`. read_x f16 or bf16: an FP32
// x read as if stored in that type (each value rounded to nearest even as the padding paths stage
// it; the other paths cast a copy for the call), so y is exactly that of x's 16-bit copy, which is
// not kept. read_w likewise for an FP32 w: Winograd rounds the weights as it transforms them (no
// copy, and the transformed filters made whole, as for any FP32 weight); the other paths read a
// 16-bit copy made for the call.
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b, const Conv2dParams& p, DType out,
              Partials partials = Partials::kF32, DType read_x = DType::f32,
              DType read_w = DType::f32);
// dx (x_shape) from dy (N, O, Ho, Wo); read_w as conv2d's.
Tensor conv2d_backward_input(const Tensor& dy, const Tensor& w, const Shape& x_shape,
                             const Conv2dParams& p, DType out, Partials partials = Partials::kF32,
                             DType read_w = DType::f32);
// dw (w_shape) from dy (N, O, Ho, Wo) and x, summed over the batch; read_x as conv2d's.
Tensor conv2d_backward_weight(const Tensor& dy, const Tensor& x, const Shape& w_shape,
                              const Conv2dParams& p, DType out, Partials partials = Partials::kF32,
                              DType read_x = DType::f32);
// An upper bound of |v| over every value conv2d_backward_weight(dy, x, w_shape, p, out,
// Partials::kF32, read_x) gives: each is a sum over the images of at most Ho x Wo products of a dy
// value by an x value (as read) of the same image, so the images' Ho * Wo * max|dy| * max|x|
// summed bound the exact sums; widened for the FP32 sums' roundings (Winograd's transforms
// included) and the one rounding into `out`. +infinity when dy or x holds an inf or NaN, when x
// read as read_x could overflow, when a value sums more than 2^21 products, or when a value could
// round past out's largest finite value. It reads dy and x once (no product): a
// finite bound proves every value finite without computing it (the optimizer's check of a
// gradient kept as its producer, optim::Optimizer::defer_gradients).
double conv2d_weight_grad_bound(const Tensor& dy, const Tensor& x, DType out,
                                DType read_x = DType::f32);

}  // namespace mantissa::kernels
