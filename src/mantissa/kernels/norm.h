// Batch, group and layer normalization over tensors of any float storage dtype, computing in
// FP32 with FP64 sums across chunks (statistics over whole batches lose too much in FP32).
// Raw kernels: they record nothing (src/mantissa/ops adds autograd).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>

#include "mantissa/core/tensor.h"

namespace mantissa::kernels {

// Sync batch norm: the processes of a data-parallel job normalize with the statistics of their
// batches together. A ChannelSums replaces each of n values by its sum over the processes (an
// all-reduce); every process calls it at the same points in the same order (twice in a training
// forward, once in its backward), so it may be a collective.
using ChannelSums = std::function<void(double* values, size_t n)>;

// Each returns y, the mean and 1/sqrt(var + eps) used (FP32, one per normalized group). batch_norm
// in training mode normalizes with the batch statistics (biased variance) and updates
// running_mean/var (FP32, unbiased variance, PyTorch's momentum convention) when given; in
// evaluation mode it uses the running statistics.
//
// With `sync` (training mode), the batch is every process's together. The arithmetic is the
// unsynchronised one with each process's partial sums as terms of the total: each channel's
// values are summed over this process's batch (FP32 lanes, FP64 across chunks), the processes'
// sums and element counts added (sync), the mean taken; the squared deviations from that mean are
// summed likewise and added (sync again); the variance is their total over the total count (the
// running variance's unbiased n / (n - 1) uses the total count too). A sync that adds nothing
// (one process) gives the unsynchronised result bit for bit. The backward adds each channel's
// sums of dy * w and dy * w * xhat and the count over the processes (one sync) before computing
// dx; dweight and dbias stay this process's own sums (the gradient reducer adds them).
std::tuple<Tensor, Tensor, Tensor> batch_norm(const Tensor& x, const Tensor& weight,
                                              const Tensor& bias, Tensor running_mean,
                                              Tensor running_var, bool training, double momentum,
                                              double eps, DType out,
                                              const ChannelSums* sync = nullptr);
// Returns dx, dweight, dbias (dweight/dbias undefined when weight is).
std::tuple<Tensor, Tensor, Tensor> batch_norm_backward(const Tensor& dy, const Tensor& x,
                                                       const Tensor& weight, const Tensor& mean,
                                                       const Tensor& rstd, bool training,
                                                       DType dx_type,
                                                       const ChannelSums* sync = nullptr);
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
