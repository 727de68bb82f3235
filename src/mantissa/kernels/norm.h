// Batch, group and layer normalization over tensors of any float storage dtype, computing in
// FP32 with FP64 sums across chunks (statistics over whole batches lose too much in FP32).
// Raw kernels: they record nothing (src/mantissa/ops adds autograd).
#pragma once

#include <cstdint>
#include <tuple>

#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

// Each returns y, the mean and 1/sqrt(var + eps) used (FP32, one per normalized group). batch_norm
// in training mode normalizes with the batch statistics (biased variance) and updates
// running_mean/var (FP32, unbiased variance, PyTorch's momentum convention) when given; in
// evaluation mode it uses the running statistics.
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

}  // namespace mantissa::kernels
