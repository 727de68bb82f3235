// The differentiable ops: functions on tensors that record what backward needs when an input
// requires grad (see autograd/autograd.h). Each is declared in op_table.h (its name, autocast
// category and kind) and consults that entry when called (detail::OpCall). Each accepts inputs
// stored in f32, f16 or bf16, computes in FP32, and writes its output in OpOptions::out (default:
// the type its kind gives, op_table.h's default_output_type: the input's dtype, or the promoted
// dtype of several inputs; losses: f32). Gradients come back in each input's dtype.
#pragma once

#include <optional>
#include <vector>

#include "mantissa/core/tensor.h"
#include "mantissa/kernels/gemm.h"
#include "mantissa/kernels/nn.h"
#include "mantissa/ops/op_table.h"

namespace mantissa::ops {

using kernels::Conv2dParams;
using kernels::Partials;
using kernels::Pool2dParams;

struct OpOptions {
  std::optional<DType> out;  // output dtype
  // Accumulation type of the matrix ops (linear, matmul, conv2d: OpKind::kMatrix); default: the
  // op context's (FP32 unless a PartialsScope says otherwise, see autocast.h).
  std::optional<Partials> partials = std::nullopt;
  // linear and conv2d: an FP32 weight read as if cast to this type (f16 or bf16, rounded to
  // nearest even), forward and backward, without a 16-bit copy saved for the backward pass:
  // linear's kernels round each value as they stage or pack it (no copy at all); conv2d casts a
  // copy for each call (workspace, freed when the call returns). Autocast sets it instead of
  // casting the weight (a leaf that requires grad) of these two ops; the gradient reaches the FP32
  // weight as it reached the cast copy's stand-in (computed in FP32, never reading the weight).
  std::optional<DType> weight_as = std::nullopt;
  // conv2d and linear: an FP32 input read as if cast to this type (f16 or bf16), forward and
  // backward, with the input gradient of the cast copy widened, as the cast's backward widens it.
  // conv2d's kernels round its values as they stage them (kernels::conv2d's read_x), so no 16-bit
  // copy is made or saved for the backward pass (the graph keeps the FP32 input, which its
  // producer usually saves anyway), and compute the input gradient in that type and widen it.
  // linear makes the 16-bit copy and keeps it for the weight gradient (as the cast would), and
  // computes the input gradient in FP32, each value rounded to the type as the GEMM stores it
  // (the copy's gradient widened, bit for bit), without a 16-bit gradient. Autocast sets it
  // instead of casting these ops' activation input (linear's only at batches of at most 16 rows,
  // and not under stochastic outputs, whose cast rounds stochastically).
  std::optional<DType> input_as = std::nullopt;
};

// ---- Matrix ops ----
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b = {}, const OpOptions& opt = {});
Tensor matmul(const Tensor& a, const Tensor& b, const OpOptions& opt = {});
Tensor conv2d(const Tensor& x, const Tensor& w, const Tensor& b = {}, const Conv2dParams& p = {},
              const OpOptions& opt = {});

// ---- Pooling ----
Tensor max_pool2d(const Tensor& x, const Pool2dParams& p, const OpOptions& opt = {});
Tensor avg_pool2d(const Tensor& x, const Pool2dParams& p, const OpOptions& opt = {});
Tensor adaptive_avg_pool2d(const Tensor& x, int64_t out_h, int64_t out_w,
                           const OpOptions& opt = {});

// ---- Elementwise ----
Tensor relu(const Tensor& x, const OpOptions& opt = {});
Tensor gelu(const Tensor& x, const OpOptions& opt = {});  // exact (erf) form
Tensor sigmoid(const Tensor& x, const OpOptions& opt = {});
Tensor tanh(const Tensor& x, const OpOptions& opt = {});
Tensor add(const Tensor& a, const Tensor& b, const OpOptions& opt = {});  // broadcasting
Tensor sub(const Tensor& a, const Tensor& b, const OpOptions& opt = {});
Tensor mul(const Tensor& a, const Tensor& b, const OpOptions& opt = {});
Tensor div(const Tensor& a, const Tensor& b, const OpOptions& opt = {});
Tensor add_scalar(const Tensor& a, double s, const OpOptions& opt = {});
Tensor mul_scalar(const Tensor& a, double s, const OpOptions& opt = {});

// ---- Normalization ----
// Running statistics (f32) are updated in place in training mode when given.
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Tensor& running_mean, const Tensor& running_var, bool training,
                  double momentum = 0.1, double eps = 1e-5, const OpOptions& opt = {});
// batch_norm whose training statistics are those of every process's batch together (sync batch
// norm; `sync` adds per-channel sums over the processes: kernels::ChannelSums), forward and
// backward. In evaluation mode it is batch_norm.
Tensor sync_batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                       const Tensor& running_mean, const Tensor& running_var, bool training,
                       const kernels::ChannelSums& sync, double momentum = 0.1, double eps = 1e-5,
                       const OpOptions& opt = {});
Tensor group_norm(const Tensor& x, int64_t groups, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5, const OpOptions& opt = {});
Tensor layer_norm(const Tensor& x, int64_t normalized_dims, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5, const OpOptions& opt = {});

// Dropout with probability p in training mode (identity otherwise); the mask is a function of
// (seed, stream, element index), so a run is reproducible.
Tensor dropout(const Tensor& x, double p, bool training, uint64_t seed, uint64_t stream,
               const OpOptions& opt = {});

// ---- Layout ----
// Views of x (no copy) unless OpOptions::out names another type, then a copy in it.
Tensor reshape(const Tensor& x, const Shape& shape, const OpOptions& opt = {});
Tensor flatten(const Tensor& x, int64_t start_dim = 1, int64_t end_dim = -1,
               const OpOptions& opt = {});
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1, const OpOptions& opt = {});
Tensor cat(const std::vector<Tensor>& xs, int64_t dim, const OpOptions& opt = {});

// ---- Reductions and probabilities ----
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false,
           const OpOptions& opt = {});
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false,
            const OpOptions& opt = {});
Tensor softmax(const Tensor& x, int64_t dim, const OpOptions& opt = {});
Tensor log_softmax(const Tensor& x, int64_t dim, const OpOptions& opt = {});

// ---- Losses (one-element results, mean over the batch; computed in FP32 and written in f32
// unless OpOptions::out names another type) ----
Tensor nll_loss(const Tensor& log_probs, const Tensor& target, int64_t ignore_index = -100,
                const OpOptions& opt = {});
Tensor cross_entropy(const Tensor& logits, const Tensor& target, double label_smoothing = 0.0,
                     int64_t ignore_index = -100, const OpOptions& opt = {});

// ---- Cast ----
// A copy in another dtype (stochastic rounding through `cast`); the gradient flows back cast to
// the input's dtype.
Tensor cast(const Tensor& x, DType dtype, const CastOptions& rounding = {});

// ---- Input ----
// 8-bit I/O (the IPU guide's ModelWithNormalization): u8 images (N, C, H, W) -> (x / 255 -
// mean[c]) / std[c] in `out` (f32, f16 or bf16), the loader's arithmetic (float, then one
// rounding). One mean/std for all channels, or one per channel. Data, not differentiable; never
// cast (the output type is its argument), but checked by anomaly detection.
Tensor normalize_input(const Tensor& x, const std::vector<float>& mean,
                       const std::vector<float>& std, DType out);

}  // namespace mantissa::ops
