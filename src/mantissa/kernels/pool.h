// 2-D pooling over NCHW tensors of any float storage dtype, computing in FP32, as PyTorch defines
// it (windows, padding, ceil mode, divisors). Raw kernels: they record nothing (src/mantissa/ops
// adds autograd).
#pragma once

#include <cstdint>
#include <utility>

#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

struct Pool2dParams {
  int64_t kernel_h = 2, kernel_w = 2;
  int64_t stride_h = 2, stride_w = 2;
  int64_t pad_h = 0, pad_w = 0;
  bool ceil_mode = false;
  bool count_include_pad = true;  // average pooling
};
Shape pool2d_output_shape(const Shape& x, const Pool2dParams& p);
// Returns y and where each maximum is: its offset in its window, kh * kernel_w + kw from the
// window's corner (padding included). Windows of at most 256 positions pack the offsets into u8
// rows, (N, C, Ho, ceil(Wo * b / 8)), b bits an output, the fewest of 2, 4 or 8 that hold the
// window (2x2: a quarter of a byte); larger windows keep an i32 an output, (N, C, Ho, Wo). The
// offsets live from the forward to the backward pass in every precision, so they take a fraction
// of a 16-bit output's bytes where PyTorch's plane indices take eight. The first maximum in window
// order wins; a NaN wins from the first one found (PyTorch's propagation).
std::pair<Tensor, Tensor> max_pool2d(const Tensor& x, const Pool2dParams& p, DType out);
// The input position (h * W + w in its plane) of output i's maximum (i: the flat output index).
int64_t max_pool2d_argmax(const Tensor& offsets, const Shape& x_shape, const Pool2dParams& p,
                          int64_t i);
Tensor max_pool2d_backward(const Tensor& dy, const Tensor& offsets, const Shape& x_shape,
                           const Pool2dParams& p, DType out);
// Each output is its window's FP32 sum (rows, then columns, in order) times 1 / count (count:
// the window's size, with the padding when count_include_pad).
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p, DType out);
Tensor avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, const Pool2dParams& p,
                           DType out);
// Output (oh, ow) averages input rows [floor(oh H / out_h), ceil((oh + 1) H / out_h)) and the
// columns alike: its window's FP32 sum divided by the window's size.
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w, DType out);
Tensor adaptive_avg_pool2d_backward(const Tensor& dy, const Shape& x_shape, DType out);

}  // namespace mantissa::kernels
